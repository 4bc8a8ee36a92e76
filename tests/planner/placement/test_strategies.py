"""The strategies' promises: balanced is a true minimax partition, balanced_low_0 keeps GPU 0 light by id,
overflow walks GPU -> cpu -> disk, auto picks and explains, and the plan budgets generation's memory."""

from __future__ import annotations

import itertools

import pytest

from planner.api import plan
from planner.hardware.device_inventory import build_hardware
from planner.placement.sizing import activation_bytes, kv_bytes_per_layer, logits_bytes
from planner.placement.solve import make_problem
from planner.placement.strategies import compute_loads
from planner.types import Plan
from tests.planner.synthetic import llama_like

SKEL = llama_like(layers=12, hidden=128, intermediate=344, vocab=512)
MiB = 2**20


def _peak(p: Plan) -> float:
    return max(b.total / b.capacity for b in p.budgets if isinstance(b.device, int) and b.capacity)


def _brute_force_best_peak(skel, max_memory, **kw) -> float:
    """Exhaustive search over all contiguous splits of the blocks across the GPUs (small cases only)."""
    hw = build_hardware(max_memory, gpu_reserve=0)
    p0 = plan(skel, max_memory=max_memory, gpu_reserve=0, strategy="sequential", **kw)
    problem = make_problem(skel, hw, p0.workload)
    n, gpus = len(skel.blocks), [d for d in hw.devices if isinstance(d.id, int)]
    best = float("inf")
    tied = set(problem.follows)
    free = [i for i in range(n) if i not in tied]
    for cuts in itertools.combinations_with_replacement(range(len(free) + 1), len(gpus) - 1):
        bounds = (0,) + cuts + (len(free),)
        assignment: list = [None] * n
        for g, (a, b) in enumerate(zip(bounds, bounds[1:])):
            for i in free[a:b]:
                assignment[i] = gpus[g].id
        for i, anchor in problem.follows.items():
            assignment[i] = assignment[anchor]
        loads = compute_loads(problem, assignment)
        if any(loads.total(d.id) > d.capacity for d in hw.devices):
            continue
        best = min(best, max(loads.total(g.id) / g.capacity for g in gpus))
    return best


@pytest.mark.parametrize("caps", [(6, 6), (4, 8), (3, 5, 7), (10, 2, 10)])
def test_balanced_is_the_optimal_contiguous_partition(caps):
    mm = {i: c * MiB for i, c in enumerate(caps)}
    kw = dict(dtype="fp32", context=64)
    bal = plan(SKEL, max_memory=mm, strategy="balanced", gpu_reserve=0, **kw)
    assert all(isinstance(d, int) for d in bal.placement.values())
    assert _peak(bal) <= _brute_force_best_peak(SKEL, mm, **kw) + 1e-6


def test_balanced_gives_bigger_gpus_proportionally_more():
    p = plan(SKEL, max_memory={0: 4 * MiB, 1: 12 * MiB}, strategy="balanced", gpu_reserve=0, dtype="fp32", context=64)
    b0, b1 = p.budget(0), p.budget(1)
    assert b1.weights > 2 * b0.weights
    assert abs(b0.total / b0.capacity - b1.total / b1.capacity) < 0.25


def test_sequential_fills_in_order_and_leaves_later_gpus_idle():
    p = plan(
        SKEL, max_memory={0: 20 * MiB, 1: 20 * MiB}, strategy="sequential", gpu_reserve=0, dtype="fp32", context=64
    )
    assert set(p.placement.values()) == {0}
    assert any("GPU 1 holds nothing" in w for w in p.warnings)


def test_balanced_low_0_keeps_the_first_gpu_light_but_used_and_indexes_by_id():
    mm = {1: 8 * MiB, 3: 8 * MiB, 5: 8 * MiB}
    bal = plan(SKEL, max_memory=mm, strategy="balanced", gpu_reserve=0, dtype="fp32", context=64)
    low = plan(SKEL, max_memory=mm, strategy="balanced_low_0", gpu_reserve=0, dtype="fp32", context=64)
    assert low.budget(1).blocks, "the first GPU (id 1) must still be used"
    assert low.budget(1).total < bal.budget(1).total
    assert low.budget(1).total < min(low.budget(3).total, low.budget(5).total)
    assert set(low.placement.values()) == {1, 3, 5}


def test_overflow_goes_gpu_then_cpu_then_disk_and_is_contiguous():
    p = plan(
        SKEL,
        max_memory={0: 3 * MiB, "cpu": 3 * MiB, "disk": "1GiB"},
        strategy="sequential",
        gpu_reserve=0,
        dtype="fp32",
        context=64,
    )
    order = {0: 0, "cpu": 1, "disk": 2}
    seq = [order[p.placement[b.name]] for b in SKEL.blocks]
    assert seq == sorted(seq) and set(seq) == {0, 1, 2}
    assert p.offloaded_bytes == sum(b.weights for b in p.budgets if b.device != 0)


def test_generation_memory_is_budgeted_where_it_lives():
    kw = dict(dtype="fp16", batch_size=4, context=256)
    p = plan(SKEL, max_memory={0: 10 * MiB, 1: 10 * MiB}, strategy="balanced", gpu_reserve=MiB, **kw)
    w = p.workload
    kv = kv_bytes_per_layer(SKEL, w)
    for b in p.budgets:
        layers = [n for n in b.blocks if n.startswith("model.layers.")]
        assert b.kv_cache == kv * len(layers)
        assert b.reserve == MiB
        expected_act = activation_bytes(SKEL, w) + (logits_bytes(SKEL, w) if "lm_head" in b.blocks else 0)
        assert b.activations == expected_act


def test_offloaded_layers_keep_their_kv_and_a_double_buffer_on_the_computing_gpu():
    p = plan(
        SKEL, max_memory={0: 4 * MiB, "cpu": "1GiB"}, strategy="sequential", gpu_reserve=0, dtype="fp32", context=64
    )
    kv = kv_bytes_per_layer(SKEL, p.workload)
    assert p.budget("cpu").kv_cache == 0
    assert p.budget(0).kv_cache == kv * SKEL.kv.num_layers
    offloaded = [b for b in SKEL.blocks if p.placement[b.name] == "cpu"]
    from planner.placement.sizing import block_bytes

    biggest = max(block_bytes(b, p.workload) for b in offloaded)
    assert p.budget(0).activations >= 2 * biggest


def test_auto_explains_its_choice_and_offloads_embeddings_first_when_memory_is_short():
    big_vocab = llama_like(layers=8, hidden=128, intermediate=344, vocab=8192)
    p = plan(big_vocab, max_memory={0: 12 * MiB, "cpu": "1GiB"}, gpu_reserve=0, dtype="fp32", context=64)
    assert p.reasons[0].startswith("auto chose")
    assert p.placement["model.embed_tokens"] == "cpu"
    seq = plan(
        big_vocab,
        max_memory={0: 12 * MiB, "cpu": "1GiB"},
        gpu_reserve=0,
        dtype="fp32",
        context=64,
        strategy="sequential",
    )
    assert p.prediction.decode_tokens_per_s > seq.prediction.decode_tokens_per_s


def test_without_gpus_the_embedding_goes_to_disk_before_any_layer():
    """A lookup reads one row a token: on disk it costs almost nothing per token, and its memory holds more layers
    resident. The plan predicts it faster than embeddings first in memory, and says so."""
    big_vocab = llama_like(layers=8, hidden=128, intermediate=344, vocab=8192)
    box = {"cpu": 10 * MiB, "disk": "1GiB"}
    p = plan(big_vocab, max_memory=box, dtype="fp32", context=64)
    seq = plan(big_vocab, max_memory=box, dtype="fp32", context=64, strategy="sequential")
    assert p.strategy == "auto:sequential+embeddings_on_disk", p.reasons[0]
    assert p.placement["model.embed_tokens"] == "disk" and seq.placement["model.embed_tokens"] == "cpu"
    resident = [n for n, d in p.placement.items() if d == "cpu" and ".layers." in n]
    assert len(resident) > len([n for n, d in seq.placement.items() if d == "cpu" and ".layers." in n])
    assert p.prediction.decode_tokens_per_s > seq.prediction.decode_tokens_per_s
    assert "embeddings_on_disk" in p.reasons[0]


def test_tied_head_follows_the_embedding():
    tied = llama_like(layers=6, hidden=128, intermediate=344, vocab=2048, tied=True)
    p = plan(
        tied,
        max_memory={0: 3 * MiB, 1: 3 * MiB, 2: 3 * MiB},
        strategy="balanced",
        gpu_reserve=0,
        dtype="fp32",
        context=16,
    )
    assert p.placement["lm_head"] == p.placement["model.embed_tokens"]


def test_quantization_shrinks_linear_weights_but_not_embeddings_or_head():
    fp16 = plan(SKEL, max_memory={"cpu": "1GiB"}, dtype="fp16")
    nf4 = plan(SKEL, max_memory={"cpu": "1GiB"}, quantization="nf4")
    int8 = plan(SKEL, max_memory={"cpu": "1GiB"}, quantization="int8")
    assert nf4.budget("cpu").weights < int8.budget("cpu").weights < fp16.budget("cpu").weights
    assert nf4.workload.dtype == "float16"


def test_predictions_follow_the_stated_cost_model():
    p = plan(SKEL, max_memory={0: "1GiB"}, dtype="fp16", context=128, gpu_reserve=0, bandwidths={"gpu": 1e9})
    total_read = sum(b.weights for b in p.budgets) + sum(b.kv_cache for b in p.budgets)
    emb = SKEL.blocks[0].tensors[0]
    emb_bytes = emb.numel * 2
    expected_step = (total_read - emb_bytes + emb_bytes // emb.shape[0]) / 1e9
    assert p.prediction.decode_tokens_per_s == pytest.approx(1 / expected_step, rel=1e-3)
    assert "bandwidth" in p.prediction.cost_model


def test_a_gpu_too_small_to_compute_on_is_skipped_not_fatal():
    # GPU 0 cannot hold a GPU's compute buffers; GPU 1 holds part of the model and computes the offloaded rest
    p = plan(SKEL, max_memory={0: 64 * 1024, 1: 3 * MiB, "cpu": "1GiB"}, gpu_reserve=MiB // 4, dtype="fp32", context=64)
    used = set(p.placement.values())
    assert 0 not in used and {1, "cpu"} <= used
    assert any("GPU 0 left unused" in r for r in p.reasons)
    assert p.budget(1).kv_cache == kv_bytes_per_layer(SKEL, p.workload) * SKEL.kv.num_layers


def test_many_declared_gpus_name_their_runs_once_in_errors():
    from planner.errors import PlanError

    with pytest.raises(PlanError) as e:
        plan(SKEL, gpus="512x64KiB", max_memory={"cpu": "1MiB"}, dtype="fp32", context=64)
    assert "GPU 0-511 64.0KiB each" in str(e.value)


@pytest.mark.parametrize("strategy", ["sequential", "balanced", "auto"])
def test_the_rotary_embedding_goes_with_the_first_layer(strategy):
    """Issue 14 item 12: the rotary embedding is registered last, so a sequential fill put it on the last device,
    although it runs before the first layer and its cos/sin go to every layer: now it follows the first layer."""
    mm = {0: 4 * MiB, 1: 4 * MiB, 2: 4 * MiB, "cpu": 64 * MiB}
    p = plan(SKEL, max_memory=mm, strategy=strategy, gpu_reserve=0, dtype="fp32", context=64)
    first_layer = p.device_map.get("model.layers.0", next(v for k, v in p.device_map.items() if "layers.0" in k))
    last = max(d for d in p.device_map.values() if isinstance(d, int))
    assert last != first_layer, "the plan should spread the layers over several devices"
    assert p.device_map["model.rotary_emb"] == first_layer
    assert any("rotary_emb" in r and "placed with model.layers.0" in r for r in p.reasons), p.reasons


def test_an_offloaded_rotary_embedding_already_computes_with_the_first_layer():
    """Offloaded blocks compute on the first GPU: a rotary embedding left on the CPU runs with layer 0 already."""
    mm = {0: 3 * MiB, "cpu": 64 * MiB}
    p = plan(SKEL, max_memory=mm, strategy="sequential", gpu_reserve=0, dtype="fp32", context=64)
    assert p.placement["model.layers.0"] == 0 and p.placement["model.layers.11"] == "cpu"
    assert p.placement["model.rotary_emb"] == "cpu"


def test_a_custom_map_still_places_the_rotary_embedding_where_it_says():
    dm = {"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    p = plan(SKEL, max_memory={0: 64 * MiB, 1: 64 * MiB}, strategy=dm, gpu_reserve=0, dtype="fp32", context=64)
    assert p.device_map["model.rotary_emb"] == 1


def test_without_gpus_auto_spreads_the_disk_layers_among_the_resident_ones_at_the_same_loads():
    """Each disk layer should be read while the CPU computes the resident layers before it: auto spreads them evenly,
    and since only interchangeable layers trade places, every device holds the same bytes as the contiguous fill."""
    from planner.placement.interleave import interleave_streamed
    from planner.placement.solve import make_problem, sequential

    box = {"cpu": 6 * MiB, "disk": "1GiB"}
    p = plan(SKEL, max_memory=box, dtype="fp32", context=64)
    layers = [b.name for b in SKEL.blocks if ".layers." in b.name]
    on_disk = [i for i, n in enumerate(layers) if p.placement[n] == "disk"]
    assert 1 < len(on_disk) < len(layers) - 1
    gaps = [b - a for a, b in zip(on_disk, on_disk[1:])]
    assert min(gaps) >= (len(layers) - 1) // len(on_disk), (on_disk, gaps)  # evenly spread, not one run
    assert any("spread among the resident ones" in r for r in p.reasons)
    assert all(b.total <= b.capacity for b in p.budgets)

    problem = make_problem(SKEL, build_hardware(box, gpu_reserve=0), p.workload)
    contiguous = sequential(problem).assignment
    spread = interleave_streamed(problem, contiguous)
    assert spread is not None and spread != contiguous
    before, after = compute_loads(problem, contiguous), compute_loads(problem, spread)
    for device in ("cpu", "disk"):
        assert after.total(device) == before.total(device)
    assert [d for d in spread if d == "disk"] == [d for d in contiguous if d == "disk"]


def test_spread_positions_end_each_share():
    from planner.placement.interleave import spread_positions

    assert spread_positions(10, 3) == [2, 5, 9]
    assert spread_positions(4, 4) == [0, 1, 2, 3]
    assert spread_positions(5, 1) == [4]
