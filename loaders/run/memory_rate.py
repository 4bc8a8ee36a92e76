"""How fast this host's cores read RAM: the rate a CPU decode step reads its resident weights at.

``loadmaster env --calibrate`` records it (and the decode kernels' own rates) for the machine. A server with
neither a calibration nor ``--bandwidth cpu=`` that streams weights from disk measures it at start
(:func:`service.model.storage_rate.with_memory_rate`): the built-in figure (80 GB/s, a server socket) made a
2-core VM's resident layers look free, and its one-stream prediction 20-37% too fast.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def typical_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median time of ``fn`` after a warm-up. The median, not the best: decode is judged by its typical step
    (bench.common.time_generation takes the median gap), and on a shared machine the best run is the rare moment
    the neighbours were idle."""
    fn()  # warm-up: first touch, lazy builds
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memory_read(nbytes: int, repeats: int = 7) -> float:
    """Bytes/s of a streaming read of ``nbytes`` of RAM (torch's sum over all of torch's threads), timed by
    :func:`typical_seconds`."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return x.numel() * 4 / typical_seconds(lambda: x.sum(), repeats)
