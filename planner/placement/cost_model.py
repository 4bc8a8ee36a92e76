"""Predicted load time and decode speed of a placement, from a cost model simple enough to state in one line.

Decoding is memory-bound: each step reads every weight once (an embedding reads one row per sequence) and the
whole KV cache. So a step takes, summed over blocks, the bytes each block reads divided by the rate they
reach the computing device:

- a block on a GPU: the GPU's memory bandwidth;
- a block on ``cpu`` while GPUs compute: the host link (PCIe), or host memory if slower;
- a block on ``cpu`` without GPUs: host memory bandwidth;
- a block on ``disk``: host memory (then the link) while the disk share fits in the RAM the plan leaves
  free (a warm page cache), the disk's read bandwidth otherwise; on a host without GPUs a cold block is then also
  computed from the page cache at the warm rate, its products counted with the CPU's;
- KV cache: the bandwidth of the device that holds it.

On a host without GPUs, where two or more disk blocks are read whole from a cold disk, a thread reads the next disk
block while the CPU computes (:mod:`loaders.run.readahead`), so a step takes the larger of the disk's reads and
everything else, not their sum. Measured on a Zen 4 (1.03B fp32, cold): the sum predicted 1.57 tok/s in a 3 GiB box
where 2.33 ran (-32%), and 0.72 in 1.5 GiB where 1.12 ran (-35%); the larger of the two came within -28% to +11%
of measured over six rounds (docs/benchmarks.md).

Several sequences decoding at once read the weights once per step, but the CPU's kernels also do each row's
arithmetic: on a host without GPUs, the seconds of every block the CPU computes grow by :func:`extra_row_cost` of
themselves for each row past the first (measured by ``env --calibrate`` per dtype, else :data:`EXTRA_ROW_COST`).
A cold disk tier's reads do not grow; a GPU's products are taken as memory-bound at any decode batch.

Load time is the bytes copied out of the checkpoint over the storage read rate, plus the GPU share over the
link. Disk-placed tensors are served from the checkpoint in place, so they cost nothing to load.

With a calibration of this machine (``loadmaster env --calibrate``, :mod:`planner.hardware.calibration`), the figures the
caller did not set are replaced by measured ones: without GPUs, cpu blocks read at the rate the decode kernels
reach for the workload's dtype, warm disk blocks at the rate they reach on memory-mapped weights, and each step
pays the measured overheads (:func:`calibrated_overhead`): once per step, once per decoder layer (more for a layer
on disk), once per linear call outside the layers (the head), and once per output row of every matrix read; warm
disk blocks never read faster than resident ones (:meth:`Calibration.kernel_rate`); cold disk and checkpoint reads
use the measured disk rate, and the host link its measured rate. The cost-model line then says so.
"""

from __future__ import annotations

from planner.hardware.calibration import Calibration, calibration_path, load_calibration
from planner.hardware.device_inventory import DEFAULT_BANDWIDTHS
from planner.hardware.devices import device_key
from planner.placement.sizing import SizedBlock
from planner.placement.strategies import Loads, Problem
from planner.types import Device, DeviceId, Hardware, Prediction, Workload

#: Per MoE layer whose routed experts compute on the CPU while GPUs compute the rest, and per layer the CPU computes
#: whole: the hidden states go to the host and back (two small copies and a synchronisation).
CPU_EXPERT_HOP_SECONDS = 5e-5

COST_MODEL = (
    "decode step = sum over blocks of bytes read per token / bandwidth of where they are read from "
    "(GPU memory; host link for cpu-offloaded blocks; RAM or disk read for disk blocks, warm if the disk share fits "
    "in free RAM; a cold disk block without GPUs adds its bytes over RAM to the cpu's) "
    "+ KV cache / bandwidth of its device; without GPUs, what the CPU computes grows by a measured fraction per "
    "decode row past the first, and cold disk reads overlap the rest: step = max(disk, rest); "
    "tokens/s = batch / step; "
    "load = non-disk bytes / storage read + GPU bytes / host link"
)


#: Appended to the cost-model line for mixture-of-experts models.
MOE_COST_MODEL = (
    "; routed experts: E*(1-(1-k/E)^batch) of E read per MoE layer where they compute (routed experts kept on the "
    "cpu, and layers the cpu computes whole, compute there at host memory speed, plus a hop of the hidden states; "
    "a disk layer without GPUs reads its touched experts from disk, in its own time: a cold disk's hit experts "
    "are not overlapped with the products), whole blocks when streamed to a GPU"
)


#: Seconds per decoder layer a CPU decode step spends in transformers' forward, for models whose steps run it (off
#: the native decode step: :mod:`planner.model.decode_path`), where no calibration measured it (``env
#: --calibrate`` times its small Llamas through that forward: :attr:`Calibration.layer_overhead`): module calls and
#: the attention's and norms' small torch operators. Measured on 2 cores of an AMD EPYC (Zen 4) on the 100M fp32
#: Llama's forward: 22.4 ms a token, 3.8 ms of it besides the weights' reads, over 14 layers (2026-12-07).
MODULE_LAYER_SECONDS = 2.7e-4
#: Seconds more per MoE layer on that path, calibrated or not: the router, its top-k and softmax, and dispatching
#: the tokens to the hit experts and back (dozens of small operators), at one decode row. Measured on the same
#: machine against the plan's own figures: the Mixtral bench model (top-2 of 8, native experts) ran 16.2 ms a token
#: where its bytes predict 8.1, the gpt-oss one in MXFP4 (top-4 of 32, sinks in its attention) 15.7 where they
#: predict 7.8: 1.0-1.3 ms a layer in all, of which the dense part is the figure above.
ROUTED_LAYER_SECONDS = 9e-4

#: The key of :attr:`~planner.types.Prediction.seconds_per_token_by_device` for a cold disk tier's hit experts,
#: read in the step's own time (never overlapped with the other blocks' products).
HIT_EXPERT_READS = "disk experts (read when hit)"
#: The rate of those reads as a share of the disk's streamed rate: a layer's hit slices are a few MiB each, read
#: together once the router has chosen, so fewer reads are in flight than when a whole block streams. Measured on the
#: 2-core VM's virtual disk (2026-12-07): 16 slices per layer, 7 layers of the gpt-oss bench model in MXFP4, cold,
#: 1.07-1.22 GB/s against 1.8 GB/s streamed.
HIT_EXPERT_READ_RATE = 0.6

#: Appended to the cost-model line for models whose CPU decode steps run transformers' forward.
MODULE_FORWARD_COST_MODEL = (
    f"; off the native decode step, transformers' forward adds {MODULE_LAYER_SECONDS * 1e3:.2f} ms per layer "
    f"(the calibrated per-layer figure where measured) and {ROUTED_LAYER_SECONDS * 1e3:.1f} ms per MoE layer"
)

#: The numbers of sequences decoding at once a plan states its aggregate decode rate for
#: (:attr:`~planner.types.Prediction.concurrent`): a few users, the benches' 16 clients, the engine's default
#: ``--max-batch-size``.
CONCURRENCY = (4, 16, 32)
#: The tokens (prompt and output) of each of those sequences: a chat turn's, not the context's limit, so the rate
#: states what the weights' reads and the CPU's arithmetic allow rather than a pool of full contexts.
CONCURRENT_CONTEXT = 256

#: The fraction of a one-row decode product's time that each further row of the same step adds on the CPU's
#: kernels, by the kernel family (:func:`kernel_family`), where no calibration measured it. Measured on 2 cores of
#: an AMD EPYC (Zen 4, AVX-512), 24 products of 5632x2048, 16 rows against one (2026-12-07): fp32 1.49x (the
#: products stay bound by the weights' read), bf16 1.26x, int8 4.2x and int4 4.9x (each row's activations are
#: quantized and summed in integers, so the small weights stop being the limit).
EXTRA_ROW_COST = {"float32": 0.033, "bfloat16": 0.017, "int8": 0.21, "int4": 0.26}
#: For a kernel family not measured above (float16, bitsandbytes' formats): the fp32 figure.
DEFAULT_EXTRA_ROW_COST = EXTRA_ROW_COST["float32"]


def kernel_family(workload: Workload) -> str | None:
    """Which CPU kernels decode the workload's CPU-computed weights: its native CPU quantization (int8, int4), else
    :func:`compute_dtype`."""
    return workload.cpu_quantization or compute_dtype(workload)


def extra_row_cost(workload: Workload) -> float:
    """The fraction of a one-row CPU product's time each further decode row adds (see :data:`EXTRA_ROW_COST`): the
    calibration's figure for the workload's kernels where it measured one, else the table's."""
    family = kernel_family(workload)
    cal = load_calibration()
    measured = cal.extra_row_cost(family) if cal is not None else None
    if measured is not None:
        return measured
    return EXTRA_ROW_COST.get(family or "", DEFAULT_EXTRA_ROW_COST)


def _is_default(value: float, kind: str) -> bool:
    """Whether a rate is the built-in figure (so a calibration may replace it) rather than one the caller set."""
    return value == DEFAULT_BANDWIDTHS[kind] or (
        kind == "link" and value == min(DEFAULT_BANDWIDTHS["cpu"], DEFAULT_BANDWIDTHS["link"])
    )


def _calibrated_rates(hw: Hardware, cal: Calibration, has_gpu: bool, dtype: str | None) -> dict[str, float]:
    """The measured rates that replace default figures: keys ``cpu``, ``disk_warm``, ``kv``, ``disk``, ``storage``,
    ``link``."""
    by_id = {d.id: d for d in hw.devices}
    out: dict[str, float] = {}
    cpu, disk = by_id.get("cpu"), by_id.get("disk")
    if has_gpu:
        if cal.link is not None and cpu is not None and _is_default(cpu.link_bandwidth, "link"):
            out["cpu"] = out["disk_warm"] = min(cal.link, cal.memory_read)
    elif cpu is not None and _is_default(cpu.bandwidth, "cpu"):
        out["cpu"] = cal.kernel_rate(dtype)
        out["disk_warm"] = cal.kernel_rate(dtype, mapped=True)
        out["kv"] = cal.memory_read
    if disk is not None and _is_default(disk.bandwidth, "disk"):
        out["disk"] = cal.disk_cold
    if _is_default(hw.storage_bandwidth, "disk"):
        out["storage"] = cal.disk_cold
    if has_gpu and cal.link is not None and _is_default(hw.link_bandwidth, "link"):
        out["link"] = cal.link
    return out


def calibrated_overhead(problem: Problem, assignment: list[DeviceId], cal: Calibration, dtype: str | None) -> float:
    """Seconds a CPU decode step spends besides reading weights and KV cache, from the calibration.

    The per-layer figure was measured on a real decoder layer stack with its hooks (norms, attention, rotary,
    residuals, and the fixed cost of its seven linear calls); a layer placed on ``disk`` adds its readahead hook and
    mapped pages. Blocks outside the layers pay one linear call each for a head; the rest (embedding lookup, final
    norm, sampling, the generation loop) is the per-step figure. Every block pays the kernels' cost per output row
    of its matrices (only the share of rows it reads, for routed experts): what makes narrow models slower per byte.
    """
    seconds = cal.step_overhead
    per_row = cal.row_overhead(dtype)
    for item, dev in zip(problem.items, assignment):
        if item.is_layer:
            seconds += cal.layer_overhead + (cal.disk_layer_overhead if dev == "disk" else 0.0)
        elif item.is_head:
            seconds += cal.call_overhead(dtype)
        if per_row and item.matrix_rows and item.weight:
            seconds += per_row * item.matrix_rows * min(item.read_per_token / item.weight, 1.0)
    return seconds


def module_forward_seconds(problem: Problem, cal: Calibration | None) -> float:
    """Seconds a CPU decode step of a model off the native decode step spends in transformers' forward besides its
    reads: per decoder layer :data:`MODULE_LAYER_SECONDS` (unless a calibration's per-layer figure, which measures
    that forward, is charged already), per MoE layer :data:`ROUTED_LAYER_SECONDS` more; 0 on the native step."""
    if not problem.module_forward:
        return 0.0
    seconds = 0.0
    for item in problem.items:
        if item.is_layer:
            seconds += (0.0 if cal is not None else MODULE_LAYER_SECONDS) + (
                ROUTED_LAYER_SECONDS if item.expert_weight else 0.0
            )
    return seconds


def _hit_expert_share(item: SizedBlock) -> float:
    """The share of a disk block's reads that are its hit experts' (:mod:`loaders.run.expert_reads`): read when the
    router has chosen them, in the layer's own time, so they cannot overlap the step's products as the readahead of
    whole blocks does."""
    if not item.expert_weight or not item.read_per_token:
        return 0.0
    dense = item.weight - item.expert_weight
    return min(max(item.read_per_token - dense, 0) / item.read_per_token, 1.0)


def _streamed_disk_blocks(problem: Problem, assignment: list[DeviceId]) -> int:
    """Disk blocks read whole each step (not an embedding's rows): those the readahead thread reads one ahead."""
    return sum(
        1 for it, d in zip(problem.items, assignment) if d == "disk" and not (it.is_embedding and not it.is_head)
    )


def block_read_seconds(
    item: SizedBlock,
    device: DeviceId,
    runs_on: DeviceId,
    rate: float,
    cpu_compute_rate: float | None,
    hop: bool = True,
) -> float:
    """Seconds one decode step spends reading ``item`` placed on ``device`` (sparsity-aware).

    A block that computes where it lives reads ``read_per_token`` (routed experts: only those the batch touches,
    :mod:`planner.model.moe`) at ``rate``; routed experts kept on the CPU while GPUs compute read at the CPU's own memory
    rate (``cpu_compute_rate``, None without GPUs) and pay a hop of the hidden states to the host and back (not
    ``hop`` when the layer around them already computes on the CPU). A streamed block copies ``streamed`` bytes
    (every tensor of it, touched or not) over the link; but a disk block the CPU computes (no GPUs) is read where
    it lies, an embedding by the rows looked up and routed experts by those hit (``read_per_token``), as
    :mod:`loaders.run.expert_reads` reads them.
    """
    if runs_on != device:
        return (item.read_per_token if device == "disk" and runs_on == "cpu" else item.streamed) / rate
    if item.in_place and device == "cpu" and cpu_compute_rate is not None:
        return item.read_per_token / cpu_compute_rate + (CPU_EXPERT_HOP_SECONDS if hop else 0.0)
    return item.read_per_token / rate


def _cpu_compute_rate(cpu: Device | None, cal: Calibration | None, dtype: str | None) -> float:
    """The rate the CPU reads weights it computes with itself: the calibrated kernel rate, else its bandwidth."""
    if cpu is None:
        return DEFAULT_BANDWIDTHS["cpu"]
    if cal is not None and _is_default(cpu.bandwidth, "cpu"):
        return cal.kernel_rate(dtype)
    return cpu.bandwidth


def compute_dtype(workload: Workload) -> str | None:
    """The dtype decode kernels read weights in (None when quantized: the calibrated kernel rates do not apply)."""
    return None if workload.quantization else workload.dtype


def predict(
    problem: Problem,
    assignment: list[DeviceId],
    loads: Loads,
    batch_size: int,
    dtype: str | None = None,
    row_cost: float = 0.0,
    kv_scale: float = 1.0,
) -> Prediction:
    """``dtype``: :func:`compute_dtype` of the workload (picks the calibrated kernel rate); ``row_cost``: its
    :func:`extra_row_cost`, by which the CPU's share of a step grows per decode row past the first; ``kv_scale``:
    the share of the problem's KV cache a step reads (its sequences shorter, or fewer, than the pool holds)."""
    hw = problem.hardware
    by_id = {d.id: d for d in hw.devices}
    cpu = by_id.get("cpu")
    has_gpu = problem.main_gpu is not None
    disk_bytes = sum(i.weight for i, d in zip(problem.items, assignment) if d == "disk")
    cpu_free = (cpu.capacity - loads.total("cpu")) if cpu else 0
    warm = disk_bytes <= cpu_free
    cal = load_calibration()
    measured = _calibrated_rates(hw, cal, has_gpu, dtype) if cal is not None else {}

    seconds_by_dev: dict[DeviceId, float] = {}
    rate_of: dict[DeviceId, float] = {}
    # a disk block in the page cache: read at this rate, warm or (on a host without GPUs) after a cold read
    cached_rate = measured.get("disk_warm", cpu.link_bandwidth if has_gpu else cpu.bandwidth) if cpu else None
    for dev_id, dev in by_id.items():
        if isinstance(dev_id, int):
            rate_of[dev_id] = dev.bandwidth
        elif dev_id == "cpu":
            rate_of[dev_id] = measured.get("cpu", dev.link_bandwidth if has_gpu else dev.bandwidth)
        elif warm and cached_rate is not None:
            rate_of[dev_id] = cached_rate
        else:
            rate_of[dev_id] = measured.get("disk", dev.bandwidth)
    cpu_compute_rate = _cpu_compute_rate(cpu, cal, dtype) if has_gpu else None
    # cold disk blocks on a host without GPUs: read, then computed from the page cache (the module docstring)
    cold_compute_rate = cached_rate if not warm and not has_gpu else None
    rows = 1.0 if has_gpu else 1.0 + row_cost * max(batch_size - 1, 0)  # the CPU's arithmetic for the other rows
    host_blocks: set[int] = set()  # skeleton blocks (layers) the CPU computes whole: their experts add no hop
    for i, (item, dev) in enumerate(zip(problem.items, assignment)):
        runs_on = problem.item_runs_on(i, dev)
        hop = item.block not in host_blocks
        if item.in_place and dev == "cpu" and item.is_layer:
            host_blocks.add(item.block)
        read = block_read_seconds(item, dev, runs_on, rate_of[dev], cpu_compute_rate, hop)
        computed_here = not (dev == "disk" and cold_compute_rate)  # a cold disk block's seconds are its reads
        on_demand = 0.0 if computed_here else read * _hit_expert_share(item)
        seconds_by_dev[dev] = seconds_by_dev.get(dev, 0.0) + read * (rows if computed_here else 1.0) - on_demand
        if on_demand:
            hit = on_demand / HIT_EXPERT_READ_RATE
            seconds_by_dev[HIT_EXPERT_READS] = seconds_by_dev.get(HIT_EXPERT_READS, 0.0) + hit
        if dev == "disk" and cold_compute_rate:  # the CPU's products, once the pages are in
            products = item.read_per_token / cold_compute_rate * rows
            seconds_by_dev["cpu"] = seconds_by_dev.get("cpu", 0.0) + products
        if item.kv:
            kv_rate = measured["kv"] if runs_on == "cpu" and "kv" in measured else by_id[runs_on].bandwidth
            seconds_by_dev[runs_on] = seconds_by_dev.get(runs_on, 0.0) + item.kv * kv_scale / kv_rate
    seconds = {device_key(d): v for d, v in seconds_by_dev.items()}
    step = sum(seconds.values())
    if cal is not None and not has_gpu:
        overhead = calibrated_overhead(problem, assignment, cal, dtype)
        seconds["overhead"] = overhead
        step += overhead
    forward = 0.0 if has_gpu else module_forward_seconds(problem, cal)
    if forward:
        seconds["forward"] = forward
        step += forward
    if cold_compute_rate and _streamed_disk_blocks(problem, assignment) >= 2:
        # the thread's reads overlap the products; hit experts' reads hold up both (the same disk, the step waits)
        disk, hit = seconds.get("disk", 0.0), seconds.get(HIT_EXPERT_READS, 0.0)
        step = hit + max(disk, step - disk - hit)
    tps = batch_size / step if step > 0 else float("inf")

    load = _load_seconds(problem, assignment, measured)
    return Prediction(
        load_seconds=round(load, 4),
        decode_tokens_per_s=round(tps, 4) if tps != float("inf") else 0.0,
        seconds_per_token_by_device={k: round(v, 6) for k, v in seconds.items()},
        cost_model=_cost_model_line(problem, cal, measured, dtype, "overhead" in seconds),
        disk_cached=warm if disk_bytes else None,
    )


def _cost_model_line(
    problem: Problem, cal: Calibration | None, measured: dict[str, float], dtype: str | None, overhead: bool
) -> str:
    """The one-line statement of the model a prediction used, with the calibration's figures where it had one."""
    line = COST_MODEL
    if any(item.expert_weight or item.in_place for item in problem.items):
        line += MOE_COST_MODEL
    if problem.module_forward and not problem.gpus:
        line += MODULE_FORWARD_COST_MODEL
    if cal is None:
        return line
    used = ", ".join(f"{k} {v / 1e9:.3g} GB/s" for k, v in measured.items()) or "none (every rate was set)"
    extra = (
        f" + overhead {cal.step_overhead * 1e3:.2f} ms/step + {cal.layer_overhead * 1e3:.3f} ms/layer "
        f"(+{cal.disk_layer_overhead * 1e3:.3f} on disk) + {cal.call_overhead(dtype) * 1e3:.3f} ms/head call "
        f"+ {cal.row_overhead(dtype) * 1e9:.0f} ns/matrix row"
        if overhead
        else ""
    )
    return f"{line}; calibrated on this machine {cal.created} ({calibration_path()}): {used}{extra}"


def _load_seconds(problem: Problem, assignment: list[DeviceId], measured: dict[str, float]) -> float:
    """Bytes copied out of the checkpoint over the storage read rate, plus the GPU share over the host link
    (disk-placed tensors are served from the checkpoint in place)."""
    hw = problem.hardware
    storage = measured.get("storage", hw.storage_bandwidth)
    link = measured.get("link", hw.link_bandwidth)
    load = 0.0
    for item, dev in zip(problem.items, assignment):
        if dev == "disk":
            continue
        load += item.weight / storage
        if isinstance(dev, int):
            load += item.weight / link
    return load
