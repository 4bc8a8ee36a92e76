"""Stand-ins for several GPUs on a machine without one, keeping the CUDA rules the loader must obey.

:class:`StandInGpus` implements :class:`loaders.checkpoint.materialize.CudaCopies`' calls. Its "GPU" tensors are CPU tensors
remembered by address range, each "GPU" has one stream, and a copy issued on a stream runs only when an event
recorded *after it on that same stream* is waited for (or at :meth:`StandInGpus.flush_all`, the end of the
program). That is as late as CUDA may run it: code that waits on the wrong stream's event (torch's ``record()``
with no stream records on the *current* device's stream, GPU 0) reuses a pinned buffer whose copy has not run,
and the stand-in's late copy then delivers the wrong bytes, just as the GPU would.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StandInStream:
    device: int


@dataclass(frozen=True)
class StandInEvent:
    stream: StandInStream
    position: int  # copies issued on the stream before the event


class StandInGpus:
    """Several "GPUs" with late copies; records every allocation and which threads issued copies per device."""

    def __init__(self) -> None:
        self.current_device = 0  # torch's current device: what a stream-less record() means
        self._lock = threading.RLock()
        self._queues: dict[StandInStream, list[Callable[[], None]]] = defaultdict(list)
        self._ran: dict[StandInStream, int] = defaultdict(int)
        self._ranges: list[tuple[int, int, int]] = []  # (lo, hi, device) of every "GPU" allocation
        self.allocations: list[tuple[int, tuple[int, ...], torch.dtype]] = []  # (device, shape, dtype)
        self.copy_threads: dict[int, set[int]] = defaultdict(set)
        self.host_pinned: dict[int, bool] = {}  # address of each CPU-placed weight -> whether it was pinned

    # -- CudaCopies --------------------------------------------------------------------------------------------
    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host tensor; whether the loader asked for pinned memory is recorded by its address."""
        t = torch.empty(shape, dtype=dtype)
        with self._lock:
            self.host_pinned[t.data_ptr()] = pinned
        return t

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        with self._lock:
            self._ranges.append((t.data_ptr(), t.data_ptr() + max(1, t.numel() * t.element_size()), device))
            self.allocations.append((device, tuple(shape), dtype))
        return t

    def stream(self, device: int) -> StandInStream:
        return StandInStream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: StandInStream) -> None:
        dev = self.device_of(dst)
        assert dev == stream.device, f"a copy to GPU {dev} was issued on GPU {stream.device}'s stream"
        with self._lock:
            self._queues[stream].append(lambda: dst.copy_(src))
            self.copy_threads[dev].add(threading.get_ident())

    def record(self, stream: StandInStream | None = None) -> StandInEvent:
        stream = stream if stream is not None else StandInStream(self.current_device)
        with self._lock:
            return StandInEvent(stream, self._ran[stream] + len(self._queues[stream]))

    def host_wait(self, event: StandInEvent) -> None:
        with self._lock:
            queue = self._queues[event.stream]
            while self._ran[event.stream] < event.position:
                queue.pop(0)()
                self._ran[event.stream] += 1

    # -- inspection --------------------------------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> int:
        ptr = t.data_ptr()
        with self._lock:
            for lo, hi, dev in self._ranges:
                if lo <= ptr < hi:
                    return dev
        raise AssertionError("a copy's destination is not a stand-in GPU allocation")

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def flush_all(self) -> None:
        """Run every copy still queued: the GPU finishes its work eventually, whatever the host waited for."""
        with self._lock:
            for stream, queue in self._queues.items():
                while queue:
                    queue.pop(0)()
                    self._ran[stream] += 1
