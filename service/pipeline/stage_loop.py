"""A stage's work on the ring: its layers over one micro-batch, its figures, and the loop of ranks 1..k-1.

Every rank but 0 runs :func:`serve_stage`: it keeps a slot cache of the engine's shape for its own layers (set up by
``SETUP``, prefix copies mirrored by ``COPY``), runs the rows of each ``FORWARD`` on it with the slots, start
positions, mask and positions that came with them, fills its row of the stats table and passes everything on, until
``STOP``. Rank 0 runs the same :func:`run_stage_layers` for stage 0 inside
:class:`~service.pipeline.stage_model.PipelineModel`. The messages are those of :mod:`service.pipeline.wire`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from loaders.pipeline_stage import StageModel
from service.engine.kv_pool import BoundSlotCache, SlotKVCache
from service.pipeline.wire import COPY, FORWARD, PING, SETUP, STAT_FIELDS, STOP, Header, Link, recv_masks, send_masks

#: Sends a rank lets pile up before it waits for them to complete.
MAX_PENDING = 32


def run_stage_layers(
    stage: StageModel,
    cache: BoundSlotCache | None,
    rows: int,
    width: int,
    mask: Any,
    positions: torch.Tensor,
    hidden: torch.Tensor | None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """This stage's layers over one micro-batch (``cache``: the slot cache bound to its rows; ``hidden``: what the
    previous stage produced, or None on stage 0, which embeds ``ids``); the hidden states they produce."""
    stage.ctx.mode, stage.ctx.incoming, stage.ctx.outgoing = "layers", hidden, None
    if ids is None:
        ids = torch.zeros((rows, width), dtype=torch.long)
    if cache is None:
        stage.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    else:
        stage.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
    out = stage.ctx.outgoing
    stage.ctx.incoming, stage.ctx.outgoing = None, None
    if out is None:
        raise RuntimeError("the stage's layers ran but recorded no output; the stage model is not wired as expected")
    return out


class StageClock:
    """Busy seconds of this stage, how long it has been serving, and what it holds: its row of the stats table.

    ``delay_s`` is a test-only hook: every micro-batch takes at least that long here (a stage made slow on purpose).
    """

    def __init__(self, stage: StageModel, delay_s: float = 0.0) -> None:
        self.started = time.perf_counter()
        self.busy_s = 0.0
        self.delay_s = delay_s
        self.resident = stage.resident_bytes  # the weights do not change while serving: counted once

    def row(self, cache: SlotKVCache | None) -> torch.Tensor:
        kv = cache.bytes_allocated() if cache is not None else 0
        serving = time.perf_counter() - self.started
        return torch.tensor([self.busy_s, serving, float(self.resident), float(kv)], dtype=torch.float64)

    def busy_since(self, t0: float) -> None:
        """Count the work started at ``t0`` as busy, after sleeping out the rest of ``delay_s`` (tests only)."""
        left = self.delay_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        self.busy_s += time.perf_counter() - t0


def serve_stage(stage: StageModel, delay_s: float = 0.0) -> None:
    """The loop of ranks 1..k-1: run this stage for every message until STOP (``delay_s``: see :class:`StageClock`).

    Raises :class:`~service.pipeline.wire.PipelineBrokenError` when rank 0 or a neighbour disappears."""
    rank, world = dist.get_rank(), dist.get_world_size()
    link = Link(rank, world)
    cache: SlotKVCache | None = None
    clock = StageClock(stage, delay_s)
    with torch.inference_mode():
        while True:
            h = link.recv_header()
            if h.op == STOP:
                link.send(h)
                link.flush()
                return
            if h.op == FORWARD:
                _forward_here(link, stage, cache, clock, h)
            elif h.op == PING:  # the heartbeat: fill this stage's row of the stats table and pass it on
                stats = link.recv((world, len(STAT_FIELDS)), torch.float64)
                stats[rank] = clock.row(cache)
                link.send(h, stats)
            elif h.op == SETUP:
                cache = SlotKVCache(h.args[0], h.args[1])
                link.send(h)
            elif h.op == COPY:
                if cache is None:
                    raise RuntimeError("a prefix copy arrived before the cache was set up")
                cache.copy_prefix(*h.args[:4])
                link.send(h)
            else:
                raise RuntimeError(f"pipeline message with unknown operation {h.op}; is every rank the same version?")
            if len(link.pending) > MAX_PENDING:
                link.flush()


def _forward_here(link: Link, stage: StageModel, cache: SlotKVCache | None, clock: StageClock, h: Header) -> None:
    """One FORWARD on this rank: receive its rows, run this stage's layers on them, pass the result on."""
    rank, world = link.rank, link.world
    rows, width, span, kind, cached = h.args[:5]
    slots = starts = None
    if cached:
        slots = link.recv((rows,), torch.long)
        starts = link.recv((rows,), torch.long)
    mask = recv_masks(link, kind, (rows, 1, width, span), stage.dtype)
    positions = link.recv((rows, width), torch.long)
    hidden = link.recv((rows, width, stage.hidden_size), stage.dtype)
    stats = link.recv((world, len(STAT_FIELDS)), torch.float64)
    t0 = time.perf_counter()
    bound = None
    if cached:
        if cache is None:
            raise RuntimeError("a cached forward arrived before the cache was set up")
        bound = cache.bound(slots.tolist(), starts.tolist(), width, span)
    out = run_stage_layers(stage, bound, rows, width, mask, positions, hidden)
    clock.busy_since(t0)
    stats[rank] = clock.row(cache)
    _, mask_tensors = send_masks(mask)
    extra = [slots, starts] if cached else []
    link.send(h, *extra, *mask_tensors, positions, out, stats)
