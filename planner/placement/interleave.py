"""Disk blocks spread among the resident ones on a host without GPUs, so the disk reads while the CPU computes.

The fill gives each device a contiguous run: on a CPU-only host with a disk tier, layers 0..k stay resident and
k+1..n stream from the checkpoint's files. A decode step then computes the resident run while the disk idles (the
readahead of :mod:`loaders.run.readahead` asks for one disk block ahead, and there is none until the disk run
starts), then waits on the disk for the rest. Spread evenly, the start of each disk block is read while the
resident block before it computes (measured on the 1.03B fp32 Llama in a 3 GiB box, 2-core AMD EPYC, one diagnostic
run per tree: one stream 0.798 -> 0.840 tok/s, 16 clients 7.98 -> 8.12, the same bytes on disk; on that machine
reads and products overlap little, so a step stays near their sum).

Only layers that are interchangeable move: same weight, KV and per-token read, none pinned, tied, or anchoring
another block. Swapping two of them between ``cpu`` and ``disk`` leaves every device's load unchanged, so the plan
still fits to the byte and the cost model's prediction is the same. Pure: no torch.
"""

from __future__ import annotations

from collections import defaultdict

from planner.placement.strategies import Problem
from planner.types import DeviceId

#: The two tiers whose blocks are interleaved: both compute on the CPU when there is no GPU.
_RESIDENT: DeviceId = "cpu"
_STREAMED: DeviceId = "disk"


def _movable(problem: Problem) -> list[int]:
    """Items that may trade places: decoder layers not pinned, tied, or anchoring another item."""
    anchors = set(problem.computes_with.values()) | set(problem.computes_with)
    tied = set(problem.follows) | set(problem.follows.values())
    return [
        i
        for i, it in enumerate(problem.items)
        if it.is_layer
        and not it.is_head
        and not it.is_embedding
        and not it.in_place
        and i not in problem.pinned
        and i not in tied
        and i not in anchors
    ]


def spread_positions(count: int, picks: int) -> list[int]:
    """``picks`` of ``count`` positions (0-based), evenly spaced, each at the end of its share (``count=10,
    picks=3`` gives 2, 5, 9): every streamed block then follows resident ones that compute while its read starts."""
    return [((k + 1) * count) // picks - 1 for k in range(picks)]


def interleave_streamed(problem: Problem, assignment: list[DeviceId]) -> list[DeviceId] | None:
    """The assignment with its disk layers spread among its resident ones (see the module docstring), or None
    when nothing would change: GPUs compute, or no group of interchangeable layers has both tiers."""
    if problem.gpus or _STREAMED not in assignment or _RESIDENT not in assignment:
        return None
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in _movable(problem):
        if assignment[i] in (_RESIDENT, _STREAMED):
            it = problem.items[i]
            groups[(it.weight, it.kv, it.read_per_token, it.matrix_rows)].append(i)
    out = list(assignment)
    for members in groups.values():
        streamed = sum(assignment[i] == _STREAMED for i in members)
        if not streamed or streamed == len(members):
            continue
        chosen = {members[p] for p in spread_positions(len(members), streamed)}
        for i in members:
            out[i] = _STREAMED if i in chosen else _RESIDENT
    return out if out != assignment else None
