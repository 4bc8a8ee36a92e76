"""Sub-layer MoE placement: routed experts on the CPU, the rest of every layer on a GPU (issue 15).

No GPU here: the CPU stands in for GPU 0 (``gpu_device``) and for the execution device, as in the streaming tests,
and a second stand-in (``meta`` as the GPU) proves where each piece receives its inputs. The device maps come from
the planner itself, so the planner's nested ``model.layers.N.mlp.experts`` entries are what the loader obeys.
"""

from __future__ import annotations

import pytest
import torch

import loaders
from loaders.checkpoint.device_order import cpu_expert_entries, host_computed, is_under
from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.layout import resolve_sources
from loaders.checkpoint.load_progress import ProgressReporter
from loaders.checkpoint.materialize import Materializer
from loaders.native.experts import native_experts_forward, takes_native_kernels
from loaders.native.linear import NativeCPULinear
from loaders.run.cpu_experts import install_gpu_execution_with_cpu_experts, native_cpu_modules
from loaders.run.streaming import CpuBackend
from planner.api import plan
from planner.errors import PlanError
from planner.model.skeleton import describe_checkpoint
from planner.placement.hf_device_map import assign_devices
from tests.loaders.gpu_standins import StandInGpus
from tests.loaders.helpers import assert_equivalent, prompt


def _planned_map(path) -> dict:
    """What ``auto`` plans for a GPU too small for the experts, behind a slow host link (at these tiny sizes the
    per-layer hop to the CPU would otherwise cost more than streaming)."""
    p = plan(
        str(path),
        gpus="1x1MiB",
        max_memory={"cpu": "1GiB"},
        gpu_reserve=0,
        context=32,
        dtype="float32",
        bandwidths={"link": 1e8},
    )
    assert "experts_on_cpu" in p.strategy, p.reasons
    return p.device_map


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_experts_on_cpu_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    dm = _planned_map(path)
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    experts = cpu_expert_entries(model, dm)
    n_layers = model.config.num_hidden_layers
    assert experts and all(k.endswith(".mlp.experts") for k in experts)
    # every layer's attention is on the GPU stand-in
    for i in range(n_layers):
        assert loaders.checkpoint.device_order.entry_of(f"model.layers.{i}.self_attn.q_proj.weight", dm) in dm
        assert dm[loaders.checkpoint.device_order.entry_of(f"model.layers.{i}.self_attn.q_proj.weight", dm)] == 0
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution_with_cpu_experts(
        model, dm, placement, torch.device("cpu"), backend=CpuBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    streamed = {b.key for b in streamer.blocks} if streamer is not None else set()
    assert not streamed & set(experts), "experts on the CPU must compute there, not be streamed"
    assert_equivalent(model, path)


def test_cpu_experts_receive_host_inputs_and_return_to_the_gpu(tiny_moe):
    """GPU 0 and the execution device are ``meta``: the experts must get their inputs on the CPU (where their
    weights are) and hand their output back on the GPU; their layer must get its inputs on the GPU."""
    model = loaders.load_model(tiny_moe, device_map={"": "cpu"}, show_progress=False)
    dm = {"": 0, "model.layers.1": 0, "model.layers.1.mlp.experts": "cpu"}
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    install_gpu_execution_with_cpu_experts(
        model, dm, placement, torch.device("meta"), backend=CpuBackend(), gpu_device=lambda i: torch.device("meta")
    )
    seen = {}
    experts = model.model.layers[1].mlp.experts
    experts.forward = lambda h, idx, w: seen.setdefault("experts", h.device) and h * 2
    layer = model.model.layers[1]  # the experts' layer, on GPU 0: aligned there
    layer.forward = lambda x, *a, **k: seen.setdefault("layer", x.device) and x
    h = torch.ones(3, 64)
    out = experts(h, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    layer(h)
    assert seen == {"experts": torch.device("cpu"), "layer": torch.device("meta")}
    assert out.device.type == "cpu"  # called from the CPU, returned to the CPU
    # the output goes back to the device the caller computes on (a meta tensor cannot be copied to the host, so the
    # caller's device is recorded as the pre-hook would for a call from GPU 0)
    experts.forward = lambda h, idx, w: h * 2
    experts.register_forward_pre_hook(lambda m, a: setattr(m, "_loadmaster_return_device", torch.device("meta")))
    out = experts(h, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert out.device.type == "meta"


#: GPU sizes at which the tiny fixtures' layers do not all fit even without their experts (the planner then weighs
#: computing the rest on the CPU against streaming them).
_TOO_SMALL_FOR_ATTENTION = {"tiny_moe": "1x800KiB", "tiny_qwen_moe": "1x900KiB"}


def _cpu_layers_plan(fixture: str, path):
    p = plan(
        str(path),
        gpus=_TOO_SMALL_FOR_ATTENTION[fixture],
        max_memory={"cpu": "1GiB"},
        gpu_reserve=0,
        context=32,
        dtype="float32",
        bandwidths={"link": 1e8},
    )
    assert p.strategy.endswith("+cpu_layers"), p.reasons
    return p


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_layers_computed_on_the_cpu_match_transformers(fixture, request):
    """Issue 15: the planner's own plan where the last layers, the norm and the head compute on the CPU (they did not
    fit the GPU even without their experts) and the first layers on GPU 0 (the CPU standing in) with their experts on
    the CPU: nothing is streamed, and logits are within 1e-5 of transformers with equal greedy tokens."""
    path = request.getfixturevalue(fixture)
    p = _cpu_layers_plan(fixture, path)
    dm = p.device_map
    host_layers = [k for k in p.cpu_compute if k.startswith("model.layers.") and not k.endswith(".experts")]
    gpu_layers = [k for k, d in dm.items() if k.startswith("model.layers.") and d == 0]
    assert host_layers and gpu_layers, dm
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution_with_cpu_experts(
        model,
        dm,
        placement,
        torch.device("cpu"),
        cpu_compute=p.cpu_compute,
        backend=CpuBackend(),
        gpu_device=lambda i: torch.device("cpu"),
    )
    streamed = {b.key for b in streamer.blocks} if streamer is not None else set()
    assert not any(is_under(k, p.cpu_compute) for k in streamed), f"computed on the CPU, yet streamed: {streamed}"
    assert_equivalent(model, path)


def test_a_layer_computed_on_the_cpu_gets_host_inputs_and_is_not_streamed(tiny_moe):
    """GPU 0 and the execution device are ``meta``: a layer the plan computes on the CPU must receive its inputs on
    the CPU and hand its output back to the caller's device, while its neighbour on GPU 0 gets them there; and a
    ``cpu`` layer the plan does not list is streamed, as in transformers."""
    model = loaders.load_model(tiny_moe, device_map={"": "cpu"}, show_progress=False)
    dm = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": "cpu"}
    dm.update({"model.layers.3": "cpu", "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0})
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution_with_cpu_experts(
        model,
        dm,
        placement,
        torch.device("meta"),
        cpu_compute=["model.layers.3"],
        backend=CpuBackend(),
        gpu_device=lambda i: torch.device("meta"),
    )
    assert streamer is not None and [b.key for b in streamer.blocks] == ["model.layers.2"]
    seen = {}
    for i in (1, 3):
        layer = model.model.layers[i]
        layer.forward = lambda x, *a, i=i, **k: seen.setdefault(i, x.device) and x
    h = torch.ones(1, 3, 64)
    model.model.layers[1](h)
    out = model.model.layers[3](h)
    assert seen == {1: torch.device("meta"), 3: torch.device("cpu")}
    assert out.device.type == "cpu"  # called from the CPU, returned to the CPU


def test_a_cpu_compute_key_the_map_does_not_put_on_the_cpu_is_refused(tiny_moe):
    model = loaders.load_model(tiny_moe, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(PlanError, match=r"'model\.layers\.3'.*does not place"):
        install_gpu_execution_with_cpu_experts(
            model, {"": 0}, placement, torch.device("meta"), cpu_compute=["model.layers.3"], backend=CpuBackend()
        )


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_weights_computed_on_the_cpu_are_not_pinned_while_streamed_ones_are(fixture, request):
    """Issue 15: with GPUs present, the materializer pinned every CPU tensor, routed experts and CPU-computed layers
    included, though they never cross to a GPU (hundreds of GiB of locked memory for DeepSeek-V3). On stand-in GPUs
    and the planner's own map plus one layer streamed: only the streamed layer's weights are pinned."""
    path = request.getfixturevalue(fixture)
    p = _cpu_layers_plan(fixture, path)
    dm = dict(p.device_map)
    gpu_layer = next(k for k, d in dm.items() if k.startswith("model.layers.") and d == 0)
    dm[gpu_layer] = "cpu"  # not in cpu_compute: streamed to GPU 0 (its experts key, if any, still says cpu)
    described = describe_checkpoint(path)
    skel = described.skeleton
    wanted = {t.name: t.shape for t in skel.tensors() if t.kind != "buffer_nonpersistent"}
    index = CheckpointIndex.open(path)
    sources = resolve_sources(wanted, index, ignore_unexpected=[r"rotary_emb\.inv_freq$"])
    devices = assign_devices(list(sources), dm, (n for n, _ in described.model.named_modules()))
    gpus = StandInGpus()
    reporter = ProgressReporter(index.total_bytes(), None, show_bar=False)
    mat = Materializer(index, torch.float32, [], reporter, model_path=path, has_gpu=True, copies=gpus)
    unpinned = host_computed(described.model, dm, p.cpu_compute, sources)
    out = mat.materialize(sources, devices, unpinned)
    gpus.flush_all()
    on_cpu = {n for n, d in devices.items() if d == "cpu"}
    pinned = {n for n in on_cpu if gpus.host_pinned.get(out[n].data_ptr())}
    experts = {n for n in on_cpu if ".experts." in n}
    host_layers = {n for n in on_cpu if is_under(n, [k for k in p.cpu_compute if not k.endswith(".experts")])}
    streamed = {n for n in on_cpu if is_under(n, [gpu_layer]) and ".experts." not in n}
    assert experts and host_layers and streamed
    assert not pinned & (experts | host_layers), sorted(pinned & (experts | host_layers))[:4]
    assert streamed <= pinned
    assert {n for n in on_cpu if out[n].data_ptr() in gpus.host_pinned} == on_cpu  # every CPU weight went through it


def _native_ops_run(model, path) -> int:
    """How many ``loadmaster::linear`` calls one forward of the reference prompt makes (torch's profiler)."""
    ids = prompt(model.config.vocab_size)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids)
    return sum(e.count for e in prof.key_averages() if e.key == "loadmaster::linear")


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_cpu_experts_on_the_native_kernels_match_transformers(fixture, request, kernel_path):
    """Issue 15: routed experts on the CPU beside a GPU (stand-in) run on the native CPU kernels where this CPU has
    them, and on torch's otherwise; either way logits are within 1e-5 of transformers (fp32) and greedy tokens equal.
    The profiler shows the kernel really ran (or did not, on the torch path)."""
    path = request.getfixturevalue(fixture)
    dm = _planned_map(path)
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    install_gpu_execution_with_cpu_experts(
        model, dm, placement, torch.device("cpu"), backend=CpuBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    experts = [model.get_submodule(k) for k in cpu_expert_entries(model, dm)]
    assert experts and all(takes_native_kernels(e) for e in experts)
    native = [e for e in experts if getattr(e.forward, "__func__", None) is native_experts_forward]
    assert len(native) == (len(experts) if kernel_path.available else 0)
    calls = _native_ops_run(model, path)
    assert (calls > 0) == kernel_path.available, calls
    assert_equivalent(model, path)


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_a_cpu_only_model_runs_its_experts_on_the_native_kernels(fixture, request, kernel_path):
    """With no GPU at all, the routed experts take the native kernels too (a decode step hands each a few rows):
    within 1e-5 of transformers (fp32), greedy tokens equal; torch's where this CPU lacks the kernel path."""
    path = request.getfixturevalue(fixture)
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    experts = [m for n, m in model.named_modules() if n.endswith(".mlp.experts")]
    native = [e for e in experts if getattr(e.forward, "__func__", None) is native_experts_forward]
    assert experts and len(native) == (len(experts) if kernel_path.available else 0)
    assert (_native_ops_run(model, path) > 0) == kernel_path.available
    assert_equivalent(model, path)


def test_layers_computed_on_the_cpu_use_the_native_kernels_too(tiny_qwen_moe, native_path):
    """The attention and shared-expert linears of a layer the plan computes on the CPU run on the native kernels,
    with the model still equal to transformers."""
    p = _cpu_layers_plan("tiny_qwen_moe", tiny_qwen_moe)
    # loaded as a CPU model on torch's kernels, then wired for the (stand-in) GPU: only the host layers switch
    model = loaders.load_model(tiny_qwen_moe, device_map={"": "cpu"}, show_progress=False, cpu_kernels="torch")
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    install_gpu_execution_with_cpu_experts(
        model,
        p.device_map,
        placement,
        torch.device("cpu"),
        cpu_compute=p.cpu_compute,
        backend=CpuBackend(),
        gpu_device=lambda i: torch.device("cpu"),
    )
    host_layer = next(k for k in p.cpu_compute if not k.endswith(".experts") and k.startswith("model.layers."))
    gpu_layer = next(k for k, d in p.device_map.items() if k.startswith("model.layers.") and d == 0)
    assert isinstance(model.get_submodule(f"{host_layer}.self_attn.q_proj"), NativeCPULinear)
    assert not isinstance(model.get_submodule(f"{gpu_layer}.self_attn.q_proj"), NativeCPULinear)  # a GPU layer
    assert native_cpu_modules(model) > 0
    assert_equivalent(model, tiny_qwen_moe)


def test_native_kernels_asked_for_where_there_are_none_is_an_error(tiny_moe, monkeypatch):
    """cpu_kernels='native' on a machine (here: a process) without the kernels says so rather than running torch."""
    from tests.loaders.kernel_paths import use_path

    use_path(monkeypatch, "torch")
    dm = _planned_map(tiny_moe)
    model = loaders.load_model(tiny_moe, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(RuntimeError, match="cpu_kernels='native'.*Use 'auto' or 'torch'"):
        install_gpu_execution_with_cpu_experts(
            model,
            dm,
            placement,
            torch.device("cpu"),
            cpu_kernels="native",
            backend=CpuBackend(),
            gpu_device=lambda i: torch.device("cpu"),
        )
    monkeypatch.undo()
    from loaders.native import kernel_build

    kernel_build.reset()
