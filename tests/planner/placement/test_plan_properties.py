"""Property tests of the planner's invariants over random skeletons and capacities (no torch involved)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.api import plan
from planner.errors import PlanError
from planner.hardware.device_inventory import build_hardware
from planner.placement.sizing import block_bytes
from planner.placement.solve import make_problem
from planner.placement.strategies import compute_loads
from planner.types import Block, KVGeometry, Plan, Skeleton, TensorSpec

DTYPES = ("float32", "float16", "bfloat16")


@st.composite
def skeletons(draw) -> Skeleton:
    hidden = draw(st.sampled_from([16, 32, 64]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 24))
    vocab = draw(st.integers(8, 400))
    tied = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    blocks = [
        Block(
            "model.embed_tokens", (TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype),), is_embedding=True
        )
    ]
    for i in range(layers):
        n_t = draw(st.integers(1, 4))
        tensors = tuple(
            TensorSpec(f"model.layers.{i}.part{j}.weight", (draw(st.integers(1, 96)), hidden), dtype, "parameter", True)
            for j in range(n_t)
        )
        if draw(st.booleans()):
            tensors += (
                TensorSpec(f"model.layers.{i}.buf", (draw(st.integers(1, 8)),), "float32", "buffer_nonpersistent"),
            )
        blocks.append(Block(f"model.layers.{i}", tensors, no_split=True, layer_index=i))
    blocks.append(Block("model.norm", (TensorSpec("model.norm.weight", (hidden,), dtype),)))
    groups: tuple[tuple[str, ...], ...] = ()
    if tied:
        blocks.append(Block("lm_head", (), is_head=True))
        groups = (("model.embed_tokens.weight", "lm_head.weight"),)
    else:
        blocks.append(Block("lm_head", (TensorSpec("lm_head.weight", (vocab, hidden), dtype),), is_head=True))
    return Skeleton(
        name="random",
        architecture="Random",
        model_type="random",
        blocks=tuple(blocks),
        tied_groups=groups,
        kv=KVGeometry(layers, kv_heads, hidden // 4),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        default_dtype=dtype,
    )


capacities = st.lists(st.integers(0, 3_000_000), min_size=0, max_size=4)
workloads = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["fp32", "fp16", "bf16"]),
        "quantization": st.sampled_from([None, None, "int8", "nf4"]),
        "batch_size": st.integers(1, 4),
        "context": st.integers(1, 64),
    }
)
strategy_names = st.sampled_from(["auto", "sequential", "balanced", "balanced_low_0"])


def _max_memory(gpus: list[int], cpu: int, disk: int | None) -> dict:
    mm: dict = {i: c for i, c in enumerate(gpus)}
    mm["cpu"] = cpu
    if disk is not None:
        mm["disk"] = disk
    return mm


def _check_invariants(skel: Skeleton, p: Plan, mm: dict, workload_kwargs: dict) -> None:
    # Every tensor placed exactly once; no-split blocks whole (a block is the unit of placement).
    assert list(p.placement) == [b.name for b in skel.blocks]
    placed = [t.name for b in skel.blocks for t in b.tensors]
    assert len(placed) == len(set(placed))
    # The merged device map resolves every tensor to its block's device (most specific key wins).
    keys = sorted(p.device_map, key=len, reverse=True)
    for b in skel.blocks:
        for name in [t.name for t in b.tensors] or [b.name]:
            match = next(k for k in keys if k == "" or name == k or name.startswith(k + "."))
            assert p.device_map[match] == p.placement[b.name], (name, match)
    # Tied groups together.
    if skel.tied_groups:
        assert p.placement["lm_head"] == p.placement["model.embed_tokens"]
    # No device over capacity, and the budgets add up to what the blocks weigh.
    for budget in p.budgets:
        assert budget.total <= budget.capacity, (budget.device, budget.total, budget.capacity)
        assert budget.free >= 0
    workload = p.workload
    # (quantization="int8" on a CPU-only box plans the native int8 layout, whose head is quantized too)
    assert sum(b.weights for b in p.budgets) == sum(block_bytes(b, workload, skel) for b in skel.blocks)
    # Contiguity: free blocks (not tied, not pinned) visit devices in hardware order, never going back.
    order = [b.device for b in p.budgets]
    seq = [order.index(p.placement[b.name]) for b in skel.blocks if not (skel.tied_groups and b.name == "lm_head")]
    if "embeddings_on_" not in p.strategy:
        assert seq == sorted(seq)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    skel=skeletons(),
    gpus=capacities,
    cpu=st.one_of(st.integers(0, 8_000_000), st.just(10**8)),
    disk=st.one_of(st.none(), st.integers(0, 8_000_000)),
    wl=workloads,
    strategy=strategy_names,
)
def test_plans_satisfy_invariants_or_fail_cleanly(skel, gpus, cpu, disk, wl, strategy):
    mm = _max_memory(gpus, cpu, disk)
    try:
        p = plan(skel, max_memory=mm, strategy=strategy, gpu_reserve=1000, **wl)
    except PlanError as e:
        msg = str(e)
        assert "does not fit" in msg and "short by" in msg
        # Nothing fits must be true: everything on the last device with unlimited room is over some capacity.
        return
    _check_invariants(skel, p, mm, wl)
    # Deterministic: the same inputs give the same plan, byte for byte.
    again = plan(skel, max_memory=mm, strategy=strategy, gpu_reserve=1000, **wl)
    assert again.to_json() == p.to_json()
    # Lossless JSON.
    assert Plan.from_json(p.to_json()) == p


@settings(max_examples=60, deadline=None)
@given(skel=skeletons(), wl=workloads)
def test_plan_fails_only_when_the_whole_demand_exceeds_every_device_combined(skel, wl):
    """With one huge CPU the plan always succeeds; with nothing at all it always fails."""
    p = plan(skel, max_memory={"cpu": 10**12}, **wl)
    assert all(dev == "cpu" for dev in p.placement.values())
    try:
        plan(skel, max_memory={"cpu": 0}, **wl)
    except PlanError as e:
        assert "does not fit" in str(e)
    else:
        raise AssertionError("a plan with zero bytes of memory must fail")


@settings(max_examples=80, deadline=None)
@given(skel=skeletons(), n=st.integers(2, 4), cap=st.integers(200_000, 3_000_000))
def test_balanced_never_worse_than_sequential_on_peak_utilisation(skel, n, cap):
    mm = {i: cap for i in range(n)}
    mm["cpu"] = 10**9
    try:
        seq = plan(skel, max_memory=mm, strategy="sequential", gpu_reserve=0)
        bal = plan(skel, max_memory=mm, strategy="balanced", gpu_reserve=0)
    except PlanError:
        return

    def peak(p: Plan) -> float:
        return max(b.total / b.capacity for b in p.budgets if isinstance(b.device, int))

    assert peak(bal) <= peak(seq) + 1e-9


def test_loads_match_budget_fields():
    from tests.planner.synthetic import llama_like

    skel = llama_like(layers=6, hidden=64, intermediate=128, vocab=100)
    p = plan(skel, max_memory={0: "2MiB", 1: "2MiB", "cpu": "1GiB"}, dtype="fp32", gpu_reserve=0, context=16)
    hw = build_hardware({0: "2MiB", 1: "2MiB", "cpu": "1GiB"}, gpu_reserve=0)
    problem = make_problem(skel, hw, p.workload)
    loads = compute_loads(problem, [p.placement[b.name] for b in skel.blocks])
    for b in p.budgets:
        assert b.total == loads.total(b.device)
