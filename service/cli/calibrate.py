"""``loadmaster env --calibrate``: measure the rates the cost model needs, on this machine, in under a minute.

- memory read bandwidth (a large tensor summed, best of a few);
- disk read rate, cold (pages dropped after an fsync, then read through a map with readahead, as the disk tier
  streams: :func:`loaders.checkpoint.disk_rate.streamed_read_rate`) and warm, on a scratch
  file in the offload folder;
- the host -> GPU link, where there is a GPU (pinned copies);
- per dtype, the decode-time linear path (the native kernel where it loads, else torch): one-row products over a
  sweep of matrix sizes (256 KiB to 32 MiB of weights) and two row widths, each size cut from a pool larger than the
  CPU's caches and read once per pass, as a decode step reads its weights;
  ``seconds = fixed cost per call + output rows * cost per row + bytes / rate`` fitted over the sweep, with the
  weights resident and read in place from a memory-mapped file (a warm ``disk`` block), the two timed interleaved;
- the time a decode step spends besides reading weights: small, narrow Llamas (2 and 10 layers) loaded by our loader
  (native linears, alignment and readahead hooks as served) and decoded with ``generate``, taking turns; the slope is
  per layer, the rest per step; the 10-layer one again with every layer on ``disk`` gives what a disk layer adds;
  what their own matrices cost by the kernel figures is taken out (the cost model charges it per block).

Everything runs on torch's threads as set when it is called: the figures describe that thread count (recorded), and
on a shared machine the neighbours' load of that moment.

The record (:class:`planner.hardware.calibration.Calibration`) is validated and saved atomically to the user's cache.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from loaders.checkpoint.disk_rate import streamed_read_rate
from loaders.run.memory_rate import memory_read, typical_seconds
from planner.hardware.calibration import Calibration, CallFit, CallPoint, KernelRate, fit_calls, machine_id

log = logging.getLogger(__name__)

Say = Callable[[str], None]


#: Runs of a measurement whose best is kept, as the decode benches keep the best of their runs (bench.common.best_of
#: keeps the best of fresh-process runs, each run's rate from its median step): on a shared machine a calibration and
#: a decode measured under the same load then agree.
RUNS = 3


def _read_all(path: Path, chunk: int = 8 << 20) -> int:
    total = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                return total
            total += n


def disk_read(folder: Path, nbytes: int) -> tuple[float, float, list[str]]:
    """(cold, warm) bytes/s reading a fresh scratch file of ``nbytes`` in ``folder``, and notes on the cold one."""
    notes: list[str] = []
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".loadmaster-calibrate-", dir=folder)
    path = Path(name)
    try:
        block = os.urandom(1 << 20)
        with os.fdopen(fd, "wb") as fh:
            for _ in range(nbytes >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        # Cold as the disk tier reads it (mapped, read ahead), the rate a server's own probe would measure.
        cold = streamed_read_rate([path], nbytes >> 20 << 20).bytes_per_s
        size = _read_all(path)
        warm = size / min(_timed(lambda: _read_all(path)) for _ in range(3))
        if cold > 0.7 * warm:
            notes.append(
                "the cold read ran near the warm rate: this filesystem may not drop cached pages "
                "(overlay/tmpfs), so the cold figure is an upper bound"
            )
        return cold, warm, notes
    finally:
        path.unlink(missing_ok=True)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def link(nbytes: int, repeats: int = 5) -> float | None:
    """Host -> GPU 0 bytes/s from pinned memory; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / typical_seconds(copy, repeats)


def _linear_fn(dtype: torch.dtype) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The decode-time linear the loader uses for ``dtype``: the native operator where it runs, else torch's."""
    from loaders.native import kernel_build, operators  # noqa: F401  (kernel_ops registers torch.ops.loadmaster)

    if dtype in kernel_build.KERNELS and kernel_build.status(dtype).available:
        return "native", lambda x, w: torch.ops.loadmaster.linear(x, w, None)
    return "torch", lambda x, w: torch.nn.functional.linear(x, w)


#: Weight bytes of the matrices the kernel sweep times: from a 100M model's smallest projection to a 1B model's MLP.
SWEEP_BYTES = (1 << 18, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
#: The inner (input) dimensions of the swept matrices: narrower and wider than decoders' hidden sizes, so that the
#: bytes and the output rows of a call vary apart and the fit can tell the cost per row from the rate.
SWEEP_WIDTHS = (512, 4096)
#: Runs of the sweep whose best is kept per point: more than elsewhere, because three coefficients are fitted from
#: it and its smallest calls (tens of microseconds) are the ones a neighbour's burst disturbs most.
SWEEP_RUNS = 5


def _cut(pool: torch.Tensor, width: int, nbytes: int) -> list[torch.Tensor]:
    """The ``[rows, width]`` matrices of about ``nbytes`` each that tile ``pool`` (flat), back to back."""
    per = max(nbytes // (width * pool.element_size()), 1) * width
    return [pool[i : i + per].view(-1, width) for i in range(0, pool.numel() - per + 1, per)]


def _sweep(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], pools: dict[str, torch.Tensor], per_run: int = 3
) -> dict[str, CallFit]:
    """Per pool, matrix width and size, the time of a pass that multiplies one row by every matrix cut from the pool
    in turn (each read once, as a decode step reads each weight once; the pools are larger than the CPU's caches),
    divided by the number of matrices; then the fit over sizes and widths.

    The pools are timed interleaved, size by size, and each point is the best of ``SWEEP_RUNS`` runs' medians: resident
    and memory-mapped weights then see the same moments of a shared machine, and one lucky sample cannot make one
    of them look faster than the other."""
    best: dict[tuple[str, int, int], float] = {}
    cases = [(width, nbytes) for width in SWEEP_WIDTHS for nbytes in SWEEP_BYTES]
    for run in range(SWEEP_RUNS):
        for width, nbytes in cases:
            for name, pool in pools.items():
                mats = _cut(pool, width, nbytes)
                x = torch.randn(1, width).to(pool.dtype)
                if run == 0:
                    for w in mats:  # warm-up: first touch of the pages, lazy builds
                        fn(x, w)
                times = []
                for _ in range(per_run):
                    t0 = time.perf_counter()
                    for w in mats:
                        fn(x, w)
                    times.append((time.perf_counter() - t0) / len(mats))
                key = (name, width, nbytes)
                best[key] = min(best.get(key, float("inf")), statistics.median(times))
    elt = next(iter(pools.values())).element_size()
    out = {}
    for name in pools:
        points = []
        for width, nbytes in cases:
            rows = max(nbytes // (width * elt), 1)
            points.append(CallPoint(rows * width * elt, rows, best[(name, width, nbytes)]))
        out[name] = fit_calls(points)
    return out


#: Rows of x the decode-batch probe multiplies, against one (:func:`measure_extra_row_cost`): the bench's 16 clients.
BATCH_ROWS = 16


def measure_extra_row_cost(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], pool: torch.Tensor) -> float:
    """The fraction of a one-row pass's time each further row adds: a pass over the pool's widest, largest matrices
    with :data:`BATCH_ROWS` rows against one, each the best of :data:`RUNS` medians, taking turns. What several
    sequences decoding at once cost the CPU beyond one weight read (the cost model's per-row term)."""
    width = max(SWEEP_WIDTHS)
    mats = _cut(pool, width, min(max(SWEEP_BYTES), pool.numel() * pool.element_size()))
    xs = {rows: torch.randn(rows, width).to(pool.dtype) for rows in (1, BATCH_ROWS)}
    best = {rows: float("inf") for rows in xs}
    for _ in range(RUNS):
        for rows, x in xs.items():
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for w in mats:
                    fn(x, w)
                times.append(time.perf_counter() - t0)
            best[rows] = min(best[rows], statistics.median(times))
    return max(best[BATCH_ROWS] / best[1] - 1.0, 0.0) / (BATCH_ROWS - 1)


def kernel_rate(dtype: torch.dtype, nbytes: int, folder: Path) -> KernelRate:
    """One-row products (a decode step's linears) over a sweep of matrix sizes and widths, weights resident and
    memory-mapped, timed interleaved: the fitted bytes/s, fixed seconds per call and per output row; then what each
    further decode row adds (:func:`measure_extra_row_cost`)."""
    elt = torch.tensor([], dtype=dtype).element_size()
    numel = max(nbytes // elt, max(SWEEP_WIDTHS) * 64)
    path_name, fn = _linear_fn(dtype)
    with torch.inference_mode():
        pool = torch.randn(numel).to(dtype)
        fd, name = tempfile.mkstemp(prefix=".loadmaster-calibrate-", dir=folder)
        os.close(fd)
        try:
            pool.view(torch.uint8).numpy().tofile(name)
            # read in place, as a disk block's weights are (views of the shard's mapping); the pages are cached
            mapped_pool = torch.from_file(name, shared=True, size=numel, dtype=dtype)
            fits = _sweep(fn, {"resident": pool, "mapped": mapped_pool})
            del mapped_pool
            per_row = measure_extra_row_cost(fn, pool)
        finally:
            Path(name).unlink(missing_ok=True)
    resident = fits["resident"]
    return KernelRate(
        dtype=str(dtype).removeprefix("torch."),
        path=path_name,
        resident=resident.rate,
        mapped=fits["mapped"].rate,
        call_overhead=resident.overhead,
        row_overhead=resident.row_overhead,
        extra_row_cost=round(per_row, 4),
    )


#: The probe Llamas' shape: narrow, so that reading their weights costs little next to the fixed costs measured.
_PROBE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2}
_PROBE_VOCAB = 256


@dataclass(frozen=True)
class Matrices:
    """The output rows and weight bytes of a set of linear layers (what the kernel costs are charged on)."""

    rows: int
    nbytes: int

    def seconds(self, kernel: KernelRate, rate: float) -> float:
        """What the calibrated cost model charges for reading these matrices once, besides fixed costs per call."""
        return self.rows * kernel.row_overhead + self.nbytes / rate


def _probe_layer_matrices(elt: int = 4) -> Matrices:
    """One probe decoder layer's seven projections (q, k, v, o, gate, up, down)."""
    h, i = _PROBE["hidden_size"], _PROBE["intermediate_size"]
    kv = h // _PROBE["num_attention_heads"] * _PROBE["num_key_value_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    return Matrices(rows=sum(n for n, _ in shapes), nbytes=sum(n * k for n, k in shapes) * elt)


def _small_llama(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, vocab_size=_PROBE_VOCAB, max_position_embeddings=256, **_PROBE)
    torch.manual_seed(0)
    out = folder / f"llama-{layers}"
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _layers_map(layers: int, where: str) -> dict[str, str]:
    """Every decoder layer on ``where`` (``cpu`` or ``disk``), the rest of the model on the CPU."""
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": where for i in range(layers)})
    return dm


def _median_gap(model: torch.nn.Module, new_tokens: int) -> float:
    """The median seconds between tokens of one greedy generation (the decode benches' per-run estimator)."""
    from transformers import StoppingCriteria

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    clock = Clock()
    with torch.inference_mode():
        model.generate(
            torch.arange(1, 17).unsqueeze(0),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=[clock],
            pad_token_id=0,
        )
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def _decode_step_seconds(
    models: dict[str, tuple[Path, dict[str, str]]], new_tokens: int = 24, repeats: int = RUNS
) -> dict[str, float]:
    """Seconds between generated tokens of each model, loaded by our loader as ``serve`` and the benches load it
    (native linears; on ``disk`` layers the memory maps and readahead hooks): the best of ``repeats`` generations'
    median gaps, the estimator of the decode benches. The models take turns, run by run, so that on a shared
    machine their differences (the per-layer and per-disk-layer costs) are not the neighbours' load changing."""
    from loaders import load_model

    loaded = {
        name: load_model(path, device_map=dm, dtype=torch.float32, offload_folder=path / "offload", show_progress=False)
        for name, (path, dm) in models.items()
    }
    for model in loaded.values():
        _median_gap(model, 2)  # warm-up: first touch of the pages, lazy builds
    best = dict.fromkeys(loaded, float("inf"))
    for _ in range(repeats):
        for name, model in loaded.items():
            best[name] = min(best[name], _median_gap(model, new_tokens))
    return best


@dataclass(frozen=True)
class StepOverheads:
    """Seconds a decode step costs besides reading weights: per decoder layer, extra per disk layer, per step."""

    per_layer: float
    per_disk_layer: float
    per_step: float


def step_overheads(folder: Path, kernel: KernelRate) -> StepOverheads:
    """Decode a small Llama (narrow layers, so reading their weights costs little) with 2 and with 10 layers: the
    slope is the cost of a layer, the rest the cost of a step; the 10-layer model once more with every layer on
    ``disk`` gives what a disk layer adds (its readahead hook and mapped pages).

    The cost model charges a block's matrices by ``kernel`` (fp32, the probes' dtype) on top of these overheads, so
    what the probes' own matrices cost by that measure is taken out: a layer's rows and bytes from the slope, the
    head's call, rows and bytes from the step; a disk layer's bytes at the mapped rate from its extra."""
    few, many = 2, 10
    with tempfile.TemporaryDirectory(prefix="loadmaster-calibrate-", dir=folder) as tmp:
        small, big = _small_llama(Path(tmp), few), _small_llama(Path(tmp), many)
        t = _decode_step_seconds(
            {
                "few": (small, _layers_map(few, "cpu")),
                "many": (big, _layers_map(many, "cpu")),
                "disk": (big, _layers_map(many, "disk")),
            }
        )
    layer = _probe_layer_matrices()
    h = _PROBE["hidden_size"]
    head = Matrices(rows=_PROBE_VOCAB, nbytes=_PROBE_VOCAB * h * 4)
    mapped = min(kernel.mapped, kernel.resident)  # as the cost model reads it (Calibration.kernel_rate)
    slope = (t["many"] - t["few"]) / (many - few)
    disk_extra = (t["disk"] - t["many"]) / many - (
        layer.seconds(kernel, mapped) - layer.seconds(kernel, kernel.resident)
    )
    return StepOverheads(
        per_layer=max(slope - layer.seconds(kernel, kernel.resident), 0.0),
        per_disk_layer=max(disk_extra, 0.0),
        per_step=max(t["few"] - few * slope - kernel.call_overhead - head.seconds(kernel, kernel.resident), 0.0),
    )


def calibrate(
    folder: Path,
    size: int = 128 << 20,
    say: Say = log.info,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> Calibration:
    """Measure everything; ``size`` bytes per buffer (big enough to leave the CPU caches, small enough to be quick)."""
    started = time.perf_counter()
    notes: list[str] = []
    say("memory read bandwidth ...")
    mem = memory_read(size)
    say(f"  {mem / 1e9:.1f} GB/s")
    say(f"disk read at {folder} ...")
    cold, warm, disk_notes = disk_read(folder, size)
    notes += disk_notes
    say(f"  cold {cold / 1e9:.2f} GB/s, warm {warm / 1e9:.2f} GB/s")
    host_link = link(size)
    if host_link is not None:
        say(f"host -> GPU link {host_link / 1e9:.1f} GB/s")
    kernels: dict[str, KernelRate] = {}
    for dtype in dtypes:
        say(f"decode linear path, {str(dtype).removeprefix('torch.')} ...")
        kr = kernel_rate(dtype, size, folder)
        kernels[kr.dtype] = kr
        say(
            f"  {kr.path}: resident {kr.resident / 1e9:.1f} GB/s, memory-mapped {kr.mapped / 1e9:.1f} GB/s, "
            f"{kr.call_overhead * 1e6:.0f} us per call, {kr.row_overhead * 1e9:.0f} ns per output row"
        )
    say("per-layer and per-step decode overhead (small Llamas, resident and on disk) ...")
    probe_kernel = kernels.get("float32") or kernel_rate(torch.float32, size, folder)
    over = step_overheads(folder, probe_kernel)
    say(
        f"  {over.per_layer * 1e3:.3f} ms per layer (+{over.per_disk_layer * 1e3:.3f} on disk), "
        f"{over.per_step * 1e3:.3f} ms per step"
    )
    notes.append(f"measured in {time.perf_counter() - started:.1f} s with {torch.get_num_threads()} torch threads")
    return Calibration(
        machine=machine_id(),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        threads=torch.get_num_threads(),
        memory_read=mem,
        disk_cold=cold,
        disk_warm=warm,
        kernels=kernels,
        layer_overhead=over.per_layer,
        step_overhead=over.per_step,
        disk_layer_overhead=over.per_disk_layer,
        link=host_link,
        notes=notes,
    )
