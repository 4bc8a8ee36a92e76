"""Putting each tensor on its planned device, straight from the shards.

* resident on the CPU: positioned reads into the tensor's own (anonymous) memory, by a small pool of reader threads
  (``preadv`` releases the GIL), in file order; where the box is tight, each chunk's page-cache pages are dropped
  once copied (``POSIX_FADV_DONTNEED``, :func:`loaders.checkpoint.residency.drops_page_cache`). Why not a view of the shard's map (no copy, as it once was): a map is the file, so a
  shard truncated under the server killed it with SIGBUS, and one rewritten in place changed its answers, even
  with every page locked; a private copy is immune, and costs ~0.1 s a GB from a warm cache. Dropping the
  files' pages keeps a box barely larger than the weights from holding both;
* on a GPU: chunked reads into two pinned staging buffers, each copied to the GPU asynchronously while the next
  chunk is read, so GPU-bound weights never exist as a full CPU copy;
* ``"cpu"`` when GPUs execute: like resident, but in pinned memory so the streaming hooks can copy asynchronously,
  except tensors that compute on the CPU (routed experts, layers the plan computes there): they never cross to a
  GPU, and pinning them would lock host memory for nothing (hundreds of GiB of DeepSeek-V3's experts);
* ``"disk"``: a zero-copy memory map of the shard when the stored dtype is the one run; otherwise (a cast, or a
  fused MoE tensor assembled from per-expert keys) converted once into the offload folder and mapped from there.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loaders.checkpoint.index import CheckpointIndex, ShardEntry
from loaders.checkpoint.layout import to_torch_index
from loaders.checkpoint.load_progress import LoadStats, ProgressReporter
from loaders.checkpoint.offload_folder import OffloadFolder
from loaders.checkpoint.residency import drops_page_cache
from loaders.checkpoint.shard_reader import ShardReader, populate
from planner.hardware.devices import torch_device_name
from planner.model.checkpoint_keys import TensorSource, piece_shape
from planner.types import DeviceId
from planner.user_cache import default_offload_folder

log = logging.getLogger(__name__)

STAGING_CHUNK = 64 * 1024 * 1024


#: Stored dtypes the CPU quantizers read as they are (``mapped_for_quantization``).
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Materializer:
    """Reads a checkpoint's tensors onto their devices and remembers what it cost (``stats``)."""

    def __init__(
        self,
        index: CheckpointIndex,
        run_dtype: torch.dtype,
        keep_fp32: list[str],
        reporter: ProgressReporter,
        *,
        offload_folder=None,
        model_path: Path,
        has_gpu: bool,
        workers: int | None = None,
        copies: CudaCopies | None = None,
        staging_chunk: int = STAGING_CHUNK,
        keep_stored: Collection[str] = (),
        mapped_for_quantization: Collection[str] = (),
    ):
        self.index = index
        self.run_dtype = run_dtype
        self._keep_fp32 = [re.compile(rf"(^|\.){re.escape(p)}(\.|$)") for p in keep_fp32]
        #: Modules whose tensors keep their stored dtype (a pre-quantized checkpoint's packed layers).
        self._keep_stored = frozenset(keep_stored)
        #: CPU weights that CPU quantization replaces right after the load: served as maps of the shards, in their
        #: stored dtype, so that a model bigger than the memory is never copied whole before it shrinks. The
        #: quantizer reads each from the page cache and gives its pages back (loaders.native.quantization).
        self._mapped_for_quantization = frozenset(mapped_for_quantization)
        self.reporter = reporter
        self.offload_folder = Path(offload_folder) if offload_folder is not None else None
        self.model_path = model_path
        self.has_gpu = has_gpu
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.reader = ShardReader()
        self.stats = LoadStats()
        #: Disk-served tensor name -> (file, start, end) of its backing bytes, for readahead hooks.
        self.disk_ranges: dict[str, tuple[str, int, int]] = {}
        #: Drop the shards' cached pages as resident tensors are copied (decided per load: ``drops_page_cache``).
        self.drop_cache = False
        #: The CUDA calls of GPU loads (a stand-in backend in tests); each GPU gets its own staging pair.
        self.copies = copies if copies is not None else CudaCopies()
        self.staging_chunk = staging_chunk

    # -- dtype ----------------------------------------------------------------------------------------------
    def target_dtype(self, name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point or self._in_kept_module(name):
            return stored
        if any(r.search(name) for r in self._keep_fp32):
            return torch.float32
        return self.run_dtype

    def _in_kept_module(self, name: str) -> bool:
        """Whether ``name`` belongs to a module that keeps its stored dtypes, at any depth below it (bitsandbytes
        4-bit's ``<layer>.weight.absmax`` is the layer's)."""
        mod = name.rpartition(".")[0]
        while mod:
            if mod in self._keep_stored:
                return True
            mod = mod.rpartition(".")[0]
        return False

    def _count(self, device: str, nbytes: int) -> None:
        self.stats.bytes_per_device[device] = self.stats.bytes_per_device.get(device, 0) + nbytes

    # -- entry point ---------------------------------------------------------------------------------------
    def materialize(
        self,
        sources: Mapping[str, TensorSource],
        devices: Mapping[str, DeviceId],
        unpinned: Collection[str] = (),
    ) -> dict[str, torch.Tensor]:
        """Every tensor of ``sources`` on its device. ``unpinned``: names of CPU tensors that compute on the CPU
        while GPUs compute the rest, so are not pinned."""
        out: dict[str, torch.Tensor] = {}
        cpu_jobs, gpu_jobs, to_convert = [], [], []
        for name, src in sources.items():
            dev = devices[name]
            stored = self.index[src.pieces[0].key].dtype
            dtype = self.target_dtype(name, stored)
            if dev == "disk":
                if src.is_plain and dtype == stored:
                    entry = self.index[src.pieces[0].key]
                    out[name] = self.reader.mapped(entry)
                    self.disk_ranges[name] = (entry.file, entry.start, entry.end)
                    self.stats.zero_copy_bytes += entry.nbytes
                    self._count("disk", entry.nbytes)
                    self.reporter.advance(entry.nbytes, "disk")
                else:
                    to_convert.append((name, src, dtype))
            elif name in self._mapped_for_quantization and src.is_plain and stored in QUANTIZABLE_DTYPES:
                entry = self.index[src.pieces[0].key]
                out[name] = self.reader.mapped(entry)
                self._count("cpu", entry.nbytes)
                self.reporter.advance(entry.nbytes, "cpu")
            elif isinstance(dev, int):
                gpu_jobs.append((name, src, dtype, dev))
            else:
                cpu_jobs.append((name, src, dtype))

        cpu_jobs.sort(key=lambda j: self._file_order(j[1]))
        self.drop_cache = drops_page_cache(sum(self.index[p.key].nbytes for _, src, _ in cpu_jobs for p in src.pieces))
        unpinned = set(unpinned)

        def load(job: tuple[str, TensorSource, torch.dtype]) -> torch.Tensor:
            return self._load_cpu(job[1], job[2], self.has_gpu and job[0] not in unpinned)

        if cpu_jobs:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="loadmaster-read") as pool:
                for (name, src, _), t in zip(cpu_jobs, pool.map(load, cpu_jobs)):
                    out[name] = t
                    self._count("cpu", t.numel() * t.element_size())
                    self.stats.bytes_read += sum(self.index[p.key].nbytes for p in src.pieces)
        if cpu_jobs and self.drop_cache:
            # Each read dropped its own whole pages; the pages two neighbours share, and those the kernel read
            # ahead, go now, once per run of tensors stored back to back.
            entries = [self.index[p.key] for _, src, _ in cpu_jobs for p in src.pieces]
            for path, lo, hi in _adjacent_runs([(e.file, e.start, e.end) for e in entries]):
                self.reader.drop_cached(path, lo, hi)
        if gpu_jobs:
            out.update(self._load_gpus(gpu_jobs))
        if to_convert:
            self._serve_from_offload_folder(to_convert, out)
        self.reader.close_files()
        return out

    def _file_order(self, src: TensorSource) -> tuple[str, int]:
        e = self.index[src.pieces[0].key]
        return e.file, e.start

    # -- CPU -----------------------------------------------------------------------------------------------
    def _load_cpu(self, src: TensorSource, dtype: torch.dtype, pin: bool = False, device: str = "cpu") -> torch.Tensor:
        dest = self.copies.host(src.shape, dtype, pin) if self.has_gpu else torch.empty(src.shape, dtype=dtype)
        populate(dest)
        for piece in src.pieces:
            entry = self.index[piece.key]
            view = dest[to_torch_index(piece.index)] if piece.index else dest
            if entry.dtype == dtype and view.is_contiguous():
                self.reader.read_into(entry, view, drop_cache=self.drop_cache)
            else:
                view.copy_(self.reader.read(entry).view(piece_shape(src.shape, piece.index)))
            self.reporter.advance(entry.nbytes, device)
        return dest

    # -- GPU -----------------------------------------------------------------------------------------------
    def _load_gpus(self, jobs: list[tuple[str, TensorSource, torch.dtype, int]]) -> dict[str, torch.Tensor]:
        """One reader thread per GPU, each with its own staging pair and stream, so several GPUs fill at once
        (``preadv`` releases the GIL) instead of one thread reading for each in turn."""
        by_device: dict[int, list[tuple[str, TensorSource, torch.dtype]]] = {}
        for name, src, dtype, dev in sorted(jobs, key=lambda j: self._file_order(j[1])):
            by_device.setdefault(dev, []).append((name, src, dtype))

        def fill(device: int) -> dict[str, torch.Tensor]:
            staging = _PinnedStaging(self.copies, self.staging_chunk, device)
            loaded = {name: self._load_gpu(src, dtype, device, staging) for name, src, dtype in by_device[device]}
            staging.synchronize()  # every copy to this GPU has finished before its staging buffers are dropped
            return loaded

        results: dict[int, Future] = {}
        threads = []
        for device in by_device:  # a thread of its own per GPU (a pool may run two GPUs' work on one thread)
            results[device] = Future()
            threads.append(threading.Thread(target=_run_into, args=(results[device], fill, device), daemon=True))
            threads[-1].name = f"loadmaster-gpu{device}"
            threads[-1].start()
        for thread in threads:
            thread.join()
        out: dict[str, torch.Tensor] = {}
        for device, future in results.items():
            loaded = future.result()  # re-raises a reader thread's error here
            out.update(loaded)
            self._count(torch_device_name(device), sum(t.numel() * t.element_size() for t in loaded.values()))
            self.stats.bytes_read += sum(
                self.index[p.key].nbytes for _, src, _ in by_device[device] for p in src.pieces
            )
        return out

    def _load_gpu(self, src: TensorSource, dtype: torch.dtype, device: int, staging: _PinnedStaging) -> torch.Tensor:
        """Copied into its final memory chunk by chunk. A piece that needs a cast (or lands in a strided slice of a
        fused tensor) goes through a chunk-sized scratch buffer on the GPU, never a full temporary in the stored
        dtype: an fp32 128k x 8k embedding would need 4.2 GB next to its bf16 destination."""
        dest = self.copies.empty(src.shape, dtype, device)
        for piece in src.pieces:
            entry = self.index[piece.key]
            view = dest[to_torch_index(piece.index)] if piece.index else dest
            if entry.dtype == dtype and view.is_contiguous():
                staging.upload(self.reader, entry, view.reshape(-1).view(torch.uint8))
            else:
                staging.upload_converted(self.reader, entry, view)
            self.reporter.advance(entry.nbytes, torch_device_name(device))
        return dest

    # -- disk, converted -----------------------------------------------------------------------------------
    def _serve_from_offload_folder(self, jobs, out: dict[str, torch.Tensor]) -> None:
        folder = OffloadFolder(
            self.offload_folder or default_offload_folder(self.model_path),
            model_path=self.model_path,
            dtype=self.run_dtype,
            sources=self.index.files,
        )
        specs = {name: (src.shape, dtype) for name, src, dtype in jobs}
        self.reporter.set_phase("offloading")
        if not folder.is_valid_for(specs):
            by_name = {name: (src, dtype) for name, src, dtype in jobs}
            written = folder.write(
                specs, lambda name: self._load_cpu(by_name[name][0], by_name[name][1], device="disk")
            )
            self.stats.offload_bytes_written += written
            self.stats.bytes_read += sum(self.index[p.key].nbytes for _, src, _ in jobs for p in src.pieces)
        else:
            log.info("reusing offload folder %s", folder.path)
            for _, src, _ in jobs:
                self.reporter.advance(sum(self.index[p.key].nbytes for p in src.pieces), "disk")
        for name, entry in folder.entries().items():
            if name in specs:
                out[name] = self.reader.mapped(entry)
                self.disk_ranges[name] = (entry.file, entry.start, entry.end)
                self._count("disk", entry.nbytes)


def _adjacent_runs(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte ranges of one file that touch (tensors stored back to back) joined; a gap (another tensor, kept on
    disk) splits them."""
    out: list[tuple[str, int, int]] = []
    for path, lo, hi in sorted(ranges):
        if out and out[-1][0] == path and lo <= out[-1][2]:
            out[-1] = (path, out[-1][1], max(out[-1][2], hi))
        else:
            out.append((path, lo, hi))
    return out


def _run_into(future: Future, fn: Callable[[int], dict[str, torch.Tensor]], arg: int) -> None:
    try:
        future.set_result(fn(arg))
    except BaseException as exc:  # handed to the joining thread, which raises it
        future.set_exception(exc)


class CudaCopies:
    """The CUDA calls a GPU load makes, each naming the GPU it concerns, so that a stand-in backend can record or
    reorder them on a machine without one (``tests/loaders/gpu_standins.py``).

    torch's defaults are per *current device*: ``Event.record()`` with no stream records on the current device's
    stream, while ``copy_`` to ``cuda:k`` runs on GPU k's stream. Every call here therefore takes its stream."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host tensor for a CPU-placed weight; ``pinned`` when it will be copied to a GPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=torch.device("cuda", device))

    def stream(self, device: int) -> Any:
        """GPU ``device``'s current stream: the one its tensors were allocated on and its copies run on."""
        return torch.cuda.current_stream(torch.device("cuda", device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def host_wait(self, event: Any) -> None:
        event.synchronize()


class _PinnedStaging:
    """Two pinned host buffers for one GPU: chunk k+1 is read from disk while chunk k is copied to the GPU. Casts
    go through a GPU scratch buffer of one chunk, converted on the GPU's stream into the destination."""

    def __init__(self, copies: CudaCopies, chunk: int, device: int):
        self.copies = copies
        self.chunk = chunk
        self.device = device
        self.stream = copies.stream(device)
        self.bufs = [copies.pinned(chunk) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.turn = 0
        self._scratch: torch.Tensor | None = None

    def upload(self, reader: ShardReader, entry: ShardEntry, dest_bytes: torch.Tensor, start: int = 0) -> None:
        """Bytes ``[start, start + len(dest_bytes))`` of ``entry`` into ``dest_bytes`` (a flat uint8 GPU view)."""
        total = dest_bytes.numel()
        done = 0
        while done < total:
            n = min(self.chunk, total - done)
            i = self.turn
            if self.events[i] is not None:
                self.copies.host_wait(self.events[i])  # the copy that last used this buffer has finished
            buf = self.bufs[i]
            lo = entry.start + start + done
            reader.read_into(ShardEntry(entry.key, entry.file, torch.uint8, (n,), lo, lo + n), buf[:n])
            self.copies.copy(dest_bytes[done : done + n], buf[:n], self.stream)
            self.events[i] = self.copies.record(self.stream)  # on the stream the copy runs on, not GPU 0's
            self.turn ^= 1
            done += n

    def upload_converted(self, reader: ShardReader, entry: ShardEntry, view: torch.Tensor) -> None:
        """``entry`` into ``view`` (another dtype, or not contiguous), a run of rows at a time through the scratch
        buffer; the conversion runs on the same stream right after each upload, so the next upload into the
        scratch waits for it."""
        rows = view.reshape(-1) if view.is_contiguous() or view.dim() <= 1 else view
        row_shape = tuple(rows.shape[1:])
        row_bytes = entry.dtype.itemsize * max(1, math.prod(row_shape))
        step = max(1, self.chunk // row_bytes)
        if self._scratch is None or self._scratch.numel() < step * row_bytes:
            self._scratch = self.copies.empty((max(self.chunk, row_bytes),), torch.uint8, self.device)
        for r in range(0, rows.shape[0], step):
            k = min(step, rows.shape[0] - r)
            raw = self._scratch[: k * row_bytes]
            self.upload(reader, entry, raw, start=r * row_bytes)
            self.copies.copy(rows[r : r + k], raw.view(entry.dtype).view((k, *row_shape)), self.stream)

    def synchronize(self) -> None:
        for ev in self.events:
            if ev is not None:
                self.copies.host_wait(ev)


__all__ = ["CudaCopies", "Materializer"]
