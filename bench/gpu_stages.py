"""The stages of the GPU check (``bench/gpu_check.sh`` → :mod:`bench.gpu_check`), each a function of the run's
context and a ``report`` callback that writes one ``PASS|FAIL|SKIP`` line to the results the moment it is known.

Every stage runs in a process of its own under its own timeout (the driver, :mod:`bench.gpu_check`, decides), so a
stage that raises, hangs or kills its interpreter costs its own lines only. With ``ctx["dry"]`` (``--dry-run``,
``LOADMASTER_GPU_CHECK_CPU=1``) the CPU stands in for GPU 0 and a tiny model for the 1B one: every stage runs the
same code, and what only a GPU can measure is a SKIP line that says so.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Report = Callable[..., None]
SERVING_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "sse_starlette", "httpx")


# -- the run's setting -------------------------------------------------------------------------------------------
def device_of(ctx: dict) -> tuple[Any, torch.device]:
    """(device map label, torch device) of "GPU 0": the CPU in a dry run."""
    return ("cpu", torch.device("cpu")) if ctx["dry"] else (0, torch.device("cuda", 0))


def model_dir(ctx: dict) -> Path:
    """The run's random-weight Llama (1B bf16 on a GPU, tiny fp32 in a dry run), built once into the work folder."""
    from service.model.random_models import build_model

    size, dtype = ("tiny", "float32") if ctx["dry"] else ("1b", "bfloat16")
    return build_model("llama", Path(ctx["work"]) / "models" / f"llama-{size}-{dtype}", size=size, dtype=dtype)


def half_dtype(ctx: dict) -> str:
    """The serving dtype of the speed runs: bf16 on a GPU; fp32 in a dry run (the CPU's bf16 is not the point)."""
    return "float32" if ctx["dry"] else "bfloat16"


def offload_maps(n_layers: int, gpu: Any) -> dict[str, dict[str, Any]]:
    """All on GPU 0; the second half of the layers on ``cpu`` (streamed); the same on ``disk``."""
    half = n_layers // 2
    out: dict[str, dict[str, Any]] = {"all on GPU": {"": gpu}}
    for kind in ("cpu", "disk"):
        dm: dict[str, Any] = {"model.embed_tokens": gpu, "model.rotary_emb": gpu, "model.norm": gpu, "lm_head": gpu}
        dm.update({f"model.layers.{i}": gpu if i < half else kind for i in range(n_layers)})
        out[f"{kind}-offloaded"] = dm
    return out


def n_layers(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])


def prompt(path: Path, length: int, salt: int = 0) -> torch.Tensor:
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    return ((torch.arange(length) * 7 + 3 + salt * 13) % (vocab - 10) + 5).unsqueeze(0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def load(ctx: dict, dm: Any, dtype: str, **kw: Any) -> torch.nn.Module:
    import loaders

    kw.setdefault("offload_folder", Path(ctx["work"]) / "offload")
    return loaders.load_model(model_dir(ctx), device_map=dm, dtype=dtype, show_progress=False, **kw)


def greedy(model: torch.nn.Module, ids: torch.Tensor, device: torch.device, n: int) -> list[int]:
    """``n`` greedy tokens (EOS cannot end them early)."""
    with torch.inference_mode():
        out = model.generate(
            ids.to(device), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=None
        )
    return out[0, ids.shape[1] :].tolist()


def tok_per_s(model: torch.nn.Module, ids: torch.Tensor, device: torch.device, n: int) -> float:
    """Greedy decode rate of ``n`` tokens after a warm-up forward."""
    with torch.inference_mode():
        model(ids.to(device))
    sync(device)
    t0 = time.perf_counter()
    greedy(model, ids, device, n)
    sync(device)
    return n / (time.perf_counter() - t0)


def pinned_ceiling(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best host-to-device rate of a pinned copy, in bytes/s (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3))
    del src, dst
    return best


def nvidia_smi(query: str = "name,driver_version,memory.total,memory.used") -> list[str] | None:
    """nvidia-smi's CSV answer, one line a GPU; None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


# -- 1. preflight ------------------------------------------------------------------------------------------------
def _versions() -> dict[str, str | None]:
    from importlib import metadata

    names = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface_hub")
    names += SERVING_MODULES + ("xgrammar", "bitsandbytes")
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def stage_preflight(ctx: dict, report: Report) -> None:
    """GPU, driver, package versions; FAIL on a transformers older than the engine needs; the model built."""
    from service.engine.model_runner import MIN_TRANSFORMERS, installed_transformers

    smi = nvidia_smi()
    if smi is None:
        report("nvidia-smi", "SKIP" if ctx["dry"] else "FAIL", "nvidia-smi missing or failing")
    else:
        report("nvidia-smi", "PASS", "; ".join(smi), gpus=smi)
    if ctx["dry"]:
        report("device", "PASS", f"dry run: the CPU stands in for GPU 0 (torch {torch.__version__})")
    elif not torch.cuda.is_available():
        report("device", "FAIL", f"torch {torch.__version__} sees no CUDA device", no_gpu=True)
        return
    else:
        props = torch.cuda.get_device_properties(0)
        detail = f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"
        report("device", "PASS", detail)
    versions = _versions()
    report("versions", "PASS", ", ".join(f"{k} {v or '-'}" for k, v in versions.items()), versions=versions)
    from packaging.version import Version

    have = installed_transformers()
    ok = Version(have) >= Version(MIN_TRANSFORMERS)
    report("transformers version", "PASS" if ok else "FAIL", f"{have} (the engine needs >= {MIN_TRANSFORMERS})")
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    report("allocator", "PASS", f"PYTORCH_CUDA_ALLOC_CONF={alloc or '(unset)'}", alloc_conf=alloc)
    t0 = time.perf_counter()
    path = model_dir(ctx)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    report("model", "PASS", f"{path.name}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")


# -- 2. correctness ----------------------------------------------------------------------------------------------
def stage_correctness(ctx: dict, report: Report) -> None:
    """Greedy tokens vs transformers on the same GPU; offloaded logits vs all-GPU; fp32 (TF32 off) vs the CPU."""
    from transformers import AutoModelForCausalLM

    gpu, device = device_of(ctx)
    path, dtype, n = model_dir(ctx), half_dtype(ctx), ctx["tokens"]
    ids = prompt(path, 24)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), device_map=str(device)).eval()
    want = greedy(ref, ids, device, n)
    del ref
    release(device)
    logits: dict[str, torch.Tensor] = {}
    for label, dm in offload_maps(n_layers(path), gpu).items():
        model = load(ctx, dm, dtype)
        with torch.inference_mode():
            logits[label] = model(ids.to(device)).logits.float().cpu()
        if label == "all on GPU":
            got = greedy(model, ids, device, n)
            same = sum(a == b for a, b in zip(got, want))
            report(
                f"{n} greedy tokens vs transformers device_map={device.type!r}",
                "PASS" if got == want else "FAIL",
                f"{same}/{n} equal ({dtype})",
            )
            report("byte-exact parameters on GPU 0", *_bytes_equal(model, path))
        else:
            diff = (logits[label] - logits["all on GPU"]).abs().max().item()
            scale = max(1.0, logits["all on GPU"].abs().max().item())
            report(
                f"{label} logits vs all on GPU",
                "PASS" if diff <= 1e-3 * scale else "FAIL",
                f"max |diff| {diff:.3g} (scale {scale:.3g}); bitwise equal: {diff == 0}",
            )
        del model
        release(device)
    _fp32_vs_cpu(ctx, report, ids)


def _bytes_equal(model: torch.nn.Module, path: Path) -> tuple[str, str]:
    from safetensors.torch import load_file

    state = model.state_dict()
    compared = wrong = 0
    for shard in sorted(path.glob("*.safetensors")):
        for key, t in load_file(shard).items():
            if key in state:
                compared += 1
                wrong += not torch.equal(state[key].cpu(), t)
    return ("PASS" if compared and not wrong else "FAIL"), f"{compared} tensors compared, {wrong} differ"


def _fp32_vs_cpu(ctx: dict, report: Report, ids: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    gpu, device = device_of(ctx)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir(ctx)), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(ids).logits.float()
    del ref
    model = load(ctx, {"": gpu}, "float32")
    with torch.inference_mode():
        got = model(ids.to(device)).logits.float().cpu()
    diff, scale = (got - want).abs().max().item(), max(1.0, want.abs().max().item())
    report(
        "fp32 (TF32 off) logits vs the CPU reference",
        "PASS" if diff <= 1e-3 * scale else "FAIL",
        f"max |diff| {diff:.3g}, tolerance {1e-3 * scale:.3g}",
    )
    del model
    release(device)


# -- 3. the engine without HTTP ----------------------------------------------------------------------------------
def run_engine(engine: Any, requests: list, timeout: float) -> list[list]:
    """Submit ``requests`` and gather each one's events up to its finish or error."""
    import queue

    from service.engine.requests import ErrorEvent, FinishEvent

    sinks = [queue.Queue() for _ in requests]
    for req, sink in zip(requests, sinks):
        engine.submit(req, sink.put)
    out = []
    for sink in sinks:
        events = [sink.get(timeout=timeout)]
        while not isinstance(events[-1], (FinishEvent, ErrorEvent)):
            events.append(sink.get(timeout=timeout))
        out.append(events)
    return out


def stage_engine(ctx: dict, report: Report) -> None:
    """16 rows of mixed prompt lengths through chunked prefill and decode; each row's greedy tokens equal its own
    generate (fp32, TF32 off); host synchronisations per step counted by torch's sync debug mode."""
    import warnings

    from transformers import AutoTokenizer

    from service.engine.engine import Engine
    from service.engine.requests import GenerationRequest, TokenEvent

    gpu, device = device_of(ctx)
    path, n, rows = model_dir(ctx), ctx["tokens"] // 2, ctx["clients"]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    model = load(ctx, {"": gpu}, "float32")
    lengths = [3 + (37 * i) % 300 for i in range(rows)]  # 3 .. 300 tokens: several prefill chunks for some
    reqs = [
        GenerationRequest(prompt_ids=prompt(path, k, i)[0].tolist(), max_new_tokens=n, ignore_eos=True)
        for i, k in enumerate(lengths)
    ]
    engine = Engine(model, AutoTokenizer.from_pretrained(path), max_batch_size=rows, max_total_tokens=512)
    engine.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            results = run_engine(engine, reqs, timeout=ctx["stage_timeout"])
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            engine.stop()
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    same = 0
    for req, events in zip(reqs, results):
        got = [e.id for e in events if isinstance(e, TokenEvent)]
        same += got == greedy(model, torch.tensor([req.prompt_ids]), device, n)
    report(
        f"engine: {rows} rows' greedy tokens vs each row's own generate",
        "PASS" if same == rows else "FAIL",
        f"{same}/{rows} rows equal, prompts {min(lengths)}-{max(lengths)} tokens, {engine.steps} steps",
    )
    if device.type == "cuda":
        report(
            "engine: host synchronisations per step",
            "PASS",
            f"{syncs} in {engine.steps} steps ({syncs / max(1, engine.steps):.1f} a step)",
            syncs=syncs,
            steps=engine.steps,
        )
    else:
        report("engine: host synchronisations per step", "SKIP", "torch's sync debug mode needs a GPU")


# -- 4. streaming ------------------------------------------------------------------------------------------------
def stage_streaming(ctx: dict, report: Report) -> None:
    """Prefetch overlap and bytes per token against the plan; then tok/s side by side with accelerate, transformers
    and other maps; the host-to-device rate against a pinned copy's."""
    from planner.api import plan

    gpu, device = device_of(ctx)
    path, dtype, n = model_dir(ctx), half_dtype(ctx), ctx["tokens"] // 2
    maps = offload_maps(n_layers(path), gpu)
    if ctx["dry"]:
        report("prefetch: copy waits after the first forward", "SKIP", "nothing streams when GPU 0 is the CPU")
    else:
        model = load(ctx, maps["cpu-offloaded"], dtype)
        late, per_forward = _copies(model, device, prompt(path, 16))
        predicted = plan(
            str(path),
            strategy=maps["cpu-offloaded"],
            dtype=dtype,
            max_memory={0: "1000GiB", "cpu": "1000GiB"},
            gpu_reserve=0,
        ).offloaded_bytes
        ratio = per_forward / predicted if predicted else float("nan")
        report("prefetch: copy waits after the first forward", "PASS" if late == 0 else "FAIL", f"{late} waited")
        report(
            "prefetch: bytes copied per token vs plan",
            "PASS" if abs(ratio - 1) <= 0.02 else "FAIL",
            f"{per_forward} copied, plan {predicted} ({ratio:.3f}x)",
        )
        del model
        release(device)
    ceiling = pinned_ceiling(device) if device.type == "cuda" else 0.0
    offloaded = _offloaded_bytes(path, maps["cpu-offloaded"], dtype)
    emb_cpu = dict(maps["cpu-offloaded"], **{"model.embed_tokens": "cpu"})
    contenders: list[tuple[str, Callable[[], torch.nn.Module]]] = [
        ("loadmaster all on GPU", lambda: load(ctx, {"": gpu}, dtype)),
        ("loadmaster cpu-offloaded", lambda: load(ctx, maps["cpu-offloaded"], dtype)),
        ("loadmaster cpu-offloaded, embed_tokens on the CPU", lambda: load(ctx, emb_cpu, dtype)),
        ("loadmaster disk-offloaded", lambda: load(ctx, maps["disk-offloaded"], dtype)),
        ("accelerate cpu offload (same map)", lambda: _accelerate(path, maps["cpu-offloaded"], dtype)),
        ("transformers device_map + max_memory", lambda: _transformers_auto(path, dtype, device, offloaded)),
    ]
    for label, make in contenders:
        try:
            model = make()
            rate = tok_per_s(model, prompt(path, 16), device, n)
        except Exception as exc:  # noqa: BLE001 - a baseline failing must not lose the others
            report(f"speed: {label}", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        streamed = offloaded if "offloaded" in label or "accelerate" in label else 0
        h2d = streamed * rate
        share = f", {h2d / ceiling:.0%} of the pinned {ceiling / 1e9:.1f} GB/s" if streamed and ceiling else ""
        report(f"speed: {label}", "PASS", f"{rate:.1f} tok/s; H2D {h2d / 1e9:.2f} GB/s{share}", tok_s=rate, h2d=h2d)
        del model
        release(device)


def _copies(model: torch.nn.Module, device: torch.device, ids: torch.Tensor) -> tuple[int, int]:
    """(blocks that waited for their copy after the first forward, bytes copied in one forward)."""
    streamer = model._loadmaster_streamer
    copied = [0]
    copy = streamer.backend.copy

    def counting_copy(dst, src, stream):
        copied[0] += dst.numel() * dst.element_size()
        copy(dst, src, stream)

    streamer.backend.copy = counting_copy
    with torch.inference_mode():
        model(ids.to(device))  # learns the order
        waits, before = streamer.sync_loads, copied[0]
        model(ids.to(device))
        sync(device)
    return streamer.sync_loads - waits, copied[0] - before


def _offloaded_bytes(path: Path, dm: dict, dtype: str) -> int:
    from planner.api import plan

    return plan(
        str(path), strategy=dm, dtype=dtype, max_memory={0: "1000GiB", "cpu": "1000GiB"}, gpu_reserve=0, advise=False
    ).offloaded_bytes


def _accelerate(path: Path, dm: dict, dtype: str) -> torch.nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=getattr(torch, dtype))
    model = load_checkpoint_and_dispatch(
        model, str(path), device_map=dm, dtype=getattr(torch, dtype), no_split_module_classes=model._no_split_modules
    )
    model.tie_weights()
    return model.eval()


def _transformers_auto(path: Path, dtype: str, device: torch.device, offloaded: int) -> torch.nn.Module:
    """transformers' own ``device_map="auto"`` with a GPU budget that leaves about the same bytes on the CPU."""
    from transformers import AutoModelForCausalLM

    if device.type != "cuda":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    gpu_bytes = max(1 << 28, total - offloaded)
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), device_map="auto", max_memory={0: gpu_bytes, "cpu": 1 << 40}
    ).eval()


# -- 5. memory ---------------------------------------------------------------------------------------------------
def stage_memory(ctx: dict, report: Report) -> None:
    """A planned load with half the model's bytes on GPU 0: the plan's GPU bytes against what the allocator
    reserved and nvidia-smi reports; pinned host bytes against the plan's CPU bytes."""
    from planner.api import plan

    gpu, device = device_of(ctx)
    if device.type != "cuda":
        report("memory: plan vs allocator and nvidia-smi", "SKIP", "needs a GPU (the allocator's and NVML's figures)")
        return
    path, dtype = model_dir(ctx), half_dtype(ctx)
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    torch.cuda.reset_peak_memory_stats(device)
    p = plan(str(path), max_memory={0: total // 2, "cpu": "1000GiB"}, dtype=dtype, batch_size=1, context=512)
    gpu_budget = next(b for b in p.budgets if str(b.device) == "0")
    cpu_budget = next((b for b in p.budgets if str(b.device) == "cpu"), None)
    smi_before = nvidia_smi("memory.used")
    model = load(ctx, p, dtype)
    tok_per_s(model, prompt(path, 64), device, 8)
    reserved = torch.cuda.max_memory_reserved(device)
    smi_after = nvidia_smi("memory.used")
    used = (int(smi_after[0]) - int(smi_before[0])) * 2**20 if smi_before and smi_after else None
    planned = gpu_budget.weights + gpu_budget.kv_cache + gpu_budget.activations + gpu_budget.reserve
    report(
        "memory: GPU reserved vs plan",
        "PASS" if reserved <= planned else "FAIL",
        f"max reserved {reserved / 2**20:.0f} MiB, plan {planned / 2**20:.0f} MiB (weights "
        f"{gpu_budget.weights / 2**20:.0f}, KV {gpu_budget.kv_cache / 2**20:.0f}, activations "
        f"{gpu_budget.activations / 2**20:.0f}, reserve {gpu_budget.reserve / 2**20:.0f})",
        reserved=reserved,
        planned=planned,
    )
    if used is not None:  # defect 9: the context, cuBLAS workspaces and allocator rounding beyond reserved
        report(
            "memory: nvidia-smi used vs plan",
            "PASS" if used <= planned + gpu_budget.reserve else "FAIL",
            f"nvidia-smi +{used / 2**20:.0f} MiB (reserved + context + workspaces), plan {planned / 2**20:.0f}",
        )
    stats = torch.cuda.host_memory_stats()
    pinned = int(stats.get("allocated_bytes.all.current", 0) or stats.get("reserved_bytes.all.current", 0))
    cpu_weights = cpu_budget.weights if cpu_budget else 0
    report(
        "memory: pinned host bytes vs the plan's CPU weights",
        "PASS" if pinned <= 1.1 * cpu_weights + (64 << 20) else "FAIL",
        f"caching host allocator {pinned / 2**20:.0f} MiB, plan's CPU weights {cpu_weights / 2**20:.0f} MiB",
        pinned=pinned,
        cpu_weights=cpu_weights,
    )
    del model
    release(device)


# -- 6. serving --------------------------------------------------------------------------------------------------
def missing_serving_modules() -> list[str]:
    import importlib.util

    return [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]


def stage_serving(ctx: dict, report: Report) -> None:
    """loadmaster serve and transformers serve --continuous-batching on the same weights: every client answered,
    fp32 greedy texts equal; bf16 tok/s, latency p50/p95 and time to ready side by side; a second loadmaster run
    with offload forced, so the engine and the streamer run under load together."""
    from bench.gpu_serving import serving_runs

    missing = missing_serving_modules()
    if missing:
        report("serving", "SKIP", f"not installed here: {', '.join(missing)} (carry bench/wheelhouse; see docs/gpu.md)")
        return
    serving_runs(ctx, report, model_dir(ctx))


# -- 7. OOM recovery ---------------------------------------------------------------------------------------------
def stage_oom(ctx: dict, report: Report) -> None:
    """One request's forward runs out of memory for real; the next request succeeds, with no copy waits."""
    from transformers import AutoTokenizer

    from service.engine.engine import Engine
    from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest

    gpu, device = device_of(ctx)
    path, dtype = model_dir(ctx), half_dtype(ctx)
    model = load(ctx, offload_maps(n_layers(path), gpu)["cpu-offloaded"], dtype)
    streamer = getattr(model, "_loadmaster_streamer", None)
    forward, armed = model.forward, [False]

    def failing_forward(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            torch.empty(1 << 50, dtype=torch.uint8, device=device)  # a real out-of-memory error
        return forward(*args, **kwargs)

    model.forward = failing_forward  # before the engine binds the model's forward
    engine = Engine(model, AutoTokenizer.from_pretrained(path), max_batch_size=2, max_total_tokens=256)
    engine.start()

    def req(salt: int):  # distinct prompts: no prefix reuse between them
        return GenerationRequest(prompt_ids=prompt(path, 12, salt)[0].tolist(), max_new_tokens=8, ignore_eos=True)

    try:
        run_engine(engine, [req(0)], ctx["stage_timeout"])  # warm: the streamer learns the order
        armed[0] = True
        failed = run_engine(engine, [req(1)], ctx["stage_timeout"])[0][-1]
        waits = streamer.sync_loads if streamer else 0
        after = run_engine(engine, [req(2)], ctx["stage_timeout"])[0][-1]
        late = (streamer.sync_loads - waits) if streamer else 0
    finally:
        engine.stop()
    report(
        "oom: the failing request gets an error",
        "PASS" if isinstance(failed, ErrorEvent) else "FAIL",
        f"{type(failed).__name__}: {getattr(failed, 'message', '')}"[:200],
    )
    ok = isinstance(after, FinishEvent) and late == 0
    report(
        "oom: the next request succeeds with no copy waits",
        "PASS" if ok else "FAIL",
        f"{type(after).__name__}; {late} copy waits" + ("" if streamer else " (nothing streams here)"),
    )


# -- 8. what one GPU cannot show ---------------------------------------------------------------------------------
def stage_multi_gpu(ctx: dict, report: Report) -> None:
    count = 0 if ctx["dry"] else torch.cuda.device_count()
    why = f"{count} GPU(s) here; needs 2 or more" if count < 2 else "not in this one-GPU script's time budget"
    report("multi-GPU staging (weights on GPU 1+)", "SKIP", why)
    report("device pipeline (caller-stream waits, issue 34 defect 2)", "SKIP", why)
    report("NCCL (pipeline across hosts)", "SKIP", why)


STAGES: dict[str, Callable[[dict, Report], None]] = {
    "preflight": stage_preflight,
    "correctness": stage_correctness,
    "engine": stage_engine,
    "streaming": stage_streaming,
    "memory": stage_memory,
    "serving": stage_serving,
    "oom": stage_oom,
    "multi_gpu": stage_multi_gpu,
}
