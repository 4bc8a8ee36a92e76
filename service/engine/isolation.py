"""One request never fails its batch-mates: when a batched step fails, find the culprit by bisection.

A prefill or decode forward (or the batched choice after it) that raises for several sequences is retried as two
halves. With the slot KV cache this is a plain re-run: each row reads its slot's cache up to its own start and
writes its positions from there, so a subset of rows fed the same tokens at the same positions overwrites whatever
the failed step half-wrote and resumes exactly where it was. A half that fails again is split again, so a single
poisoned sequence costs about ``2 log2(n)`` extra forwards and ends alone with the error, while the others go on.
A batch of one has nobody to spare: it fails as before. Not every failure is retried: out of memory is the batch's
size at fault, and an unrecoverable device error is the engine's; this module holds the splitting and the tests
that tell those apart (:func:`is_out_of_memory`, :func:`is_unrecoverable`), so the executor's step stays readable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: CUDA errors after which the context is corrupt: every later kernel on the device fails too, so they are the
#: engine's failure, not one request's (CUDA's own messages for cudaErrorIllegalAddress, cudaErrorAssert,
#: cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, cudaErrorECCUncorrectable,
#: cudaErrorHardwareStackError, cudaErrorLaunchTimeout).
UNRECOVERABLE_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "uncorrectable ecc error",
    "hardware stack error",
    "the launch timed out and was terminated",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, or the CPU allocator refusing (a plain ``RuntimeError`` saying "can't allocate
    memory", with no "out of memory" in it)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory")
    )


def is_unrecoverable(exc: BaseException) -> bool:
    """A CUDA error that leaves the device unusable until the process restarts."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in UNRECOVERABLE_CUDA_ERRORS)


def isolate_failure(seqs: list[Any], where: str, retry: Callable[[list[Any]], None]) -> bool:
    """Retry ``seqs`` (whose batched ``where`` just failed) as two halves through ``retry`` (the engine's own step
    for a sub-batch, which calls back here if a half fails again). ``False`` when there is nothing to split: the
    caller then fails the one sequence left. Sequences cancelled meanwhile are dropped, not retried."""
    for s in seqs:
        if s.cancelled.is_set() and not s.done:
            s.done = True
    alive = [s for s in seqs if not s.done]
    if len(alive) <= 1:
        return False
    half = len(alive) // 2
    log.warning(
        "%s failed for a batch of %d; retrying it as %d + %d to isolate the request at fault",
        where,
        len(alive),
        half,
        len(alive) - half,
    )
    for part in (alive[:half], alive[half:]):
        retry(part)
    return True
