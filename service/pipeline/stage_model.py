"""The pipeline behind the engine: rank 0's model is a :class:`PipelineModel` whose forward runs the ring.

The engine (:mod:`service.engine.engine`) and its model runner call a model with token ids, a prepared 4D attention mask,
position ids and their slot cache, and read ``.logits``. :class:`PipelineModel` takes exactly that call: it runs
stage 0's layers on rank 0 (with the engine's own :class:`~service.engine.kv_pool.SlotKVCache`, which then holds only
stage 0's layers), passes the hidden states with the rows' slots, positions and mask to rank 1, and so on around
the ring; when they come back it computes the final norm and the head for the positions the runner asked for. So
continuous batching, prefix reuse, sampling, stopping and every route work unchanged over a pipeline.

Each other rank (:func:`~service.pipeline.stage_loop.serve_stage`) keeps a slot cache of the same shape for its own layers; the engine's
batch composition reaches it as the rows' slots and start positions in every message, and a prefix copy between
slots (:meth:`RingSlotCache.copy_prefix`) goes round as a control message, so every stage copies its own layers.

A batch of rows is split into micro-batches (contiguous groups of rows) sent one after another with non-blocking
sends, so stage ``s`` computes micro-batch ``j`` while stage ``s+1`` computes ``j-1``.

Every message also carries a small table of per-stage figures (busy seconds, seconds serving, resident weight bytes,
KV cache bytes) that each stage fills in its row on the way: rank 0 learns every stage's state with every step,
for ``/info`` and ``/metrics``. When the engine is idle, rank 0 sends a heartbeat round the ring every few
seconds, so a dead or hung rank is noticed without a request. Any failure of the ring is reported once to the
``on_broken`` callbacks (the server then fails its requests, answers 503 and exits) and every later call raises
:class:`~service.pipeline.wire.PipelineBrokenError` at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers.modeling_outputs import CausalLMOutputWithPast

from loaders.pipeline_stage import StageModel
from planner.cluster import ClusterPlan
from service.engine.kv_pool import BatchedBinding, BoundSlotCache, SlotKVCache
from service.pipeline.stage_loop import StageClock, run_stage_layers
from service.pipeline.wire import (
    COPY,
    FORWARD,
    PING,
    SETUP,
    STAT_FIELDS,
    STOP,
    Header,
    Link,
    PipelineBrokenError,
    recv_masks,
    send_masks,
)

log = logging.getLogger(__name__)


@dataclass
class StageStats:
    """One stage's figures as last reported to rank 0."""

    busy_s: float = 0.0
    serving_s: float = 0.0
    resident_bytes: int = 0
    kv_cache_bytes: int = 0

    @property
    def busy_fraction(self) -> float:
        """Share of the time since the stage started serving that it spent computing."""
        return min(1.0, self.busy_s / self.serving_s) if self.serving_s > 0 else 0.0


class RingSlotCache(SlotKVCache):
    """Rank 0's slot cache: its own layers' KV, and prefix copies mirrored to every other stage."""

    def __init__(self, pipeline: PipelineModel, slots: int, max_len: int):
        super().__init__(slots, max_len)
        self.pipeline = pipeline
        pipeline.control(Header(SETUP, (slots, max_len)))
        pipeline.cache = self

    def copy_prefix(self, source: int, target: int, start: int, end: int) -> None:
        super().copy_prefix(source, target, start, end)
        if end > start:
            self.pipeline.control(Header(COPY, (source, target, start, end)))


class PipelineModel:
    """Rank 0's stand-in for the model: the engine calls it like a causal LM; its forward runs the ring.

    ``micro_batches``: how many groups a batch of rows is split into (at most one per row). ``heartbeat_s``: the
    idle heartbeat's period (see :meth:`start_heartbeat`). ``delay_s``: a test-only slow stage 0
    (:class:`~service.pipeline.stage_loop.StageClock`).
    """

    #: The ring ships the batched cache binding (slots, starts) to the other ranks, not the packed one, so the
    #: engine's model runner gives it rows of one width per forward (:mod:`service.engine.model_runner`).
    runs_packed_rows = False

    def __init__(
        self, stage: StageModel, plan: ClusterPlan, micro_batches: int, heartbeat_s: float = 2.0, delay_s: float = 0.0
    ):
        if dist.get_rank() != 0:
            raise RuntimeError("PipelineModel runs on rank 0; other ranks run serve_stage()")
        self.stage = stage
        self.plan = plan
        self.config = stage.model.config
        self.generation_config = getattr(stage.model, "generation_config", None)
        self.dtype = stage.dtype
        self.micro_batches = max(1, micro_batches)
        self.world = dist.get_world_size()
        self.link = Link(0, self.world)
        self.cache: SlotKVCache | None = None
        self.clock = StageClock(stage, delay_s)
        self.stats = [StageStats() for _ in range(self.world)]
        self.steps = 0
        self.broken: str | None = None
        self._on_broken: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._heartbeat_s = heartbeat_s
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- what the engine and the service read of a model --------------------------------------------------------
    def get_input_embeddings(self) -> torch.nn.Module:
        return self.stage.model.get_input_embeddings().real

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.stage.model.get_output_embeddings().real

    def make_slot_cache(self, slots: int, max_len: int) -> SlotKVCache:
        """The engine's slot cache (see :class:`RingSlotCache`): every stage sets up one of the same shape."""
        return RingSlotCache(self, slots, max_len)

    def on_broken(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once when the ring breaks (a rank died or stopped answering)."""
        self._on_broken.append(callback)

    def start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="loadmaster-pipeline-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- the ring ---------------------------------------------------------------------------------------------------
    def __call__(self, **kwargs: Any) -> CausalLMOutputWithPast:
        return self.forward(**kwargs)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        cache: BoundSlotCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        """Logits for ``input_ids`` as the whole model would give them, computed around the ring."""
        rows, width = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(rows, width)
        cached = cache is not None and use_cache
        with self._lock:
            self._check()
            try:
                hidden, positions = self._ring(input_ids, attention_mask, position_ids, cache if cached else None)
            except PipelineBrokenError as exc:
                self._break(str(exc))
                raise
        return CausalLMOutputWithPast(logits=self._head(hidden, positions, logits_to_keep))

    def control(self, header: Header) -> None:
        """Send a control message round the ring and wait for it to come back (every stage has applied it)."""
        with self._lock:
            self._check()
            try:
                self.link.send(header)
                back = self.link.recv_header()
                self.link.flush()
            except PipelineBrokenError as exc:
                self._break(str(exc))
                raise
            if back.op != header.op:
                self._break(f"pipeline message out of order: sent operation {header.op}, got {back.op} back")
                raise PipelineBrokenError(self.broken)

    def ping(self) -> None:
        """A heartbeat round the ring; it also brings back every stage's figures (so an idle server's are fresh)."""
        with self._lock:
            self._check()
            try:
                stats = torch.zeros((self.world, len(STAT_FIELDS)), dtype=torch.float64)
                self.link.send(Header(PING), stats)
                back = self.link.recv_header()
                if back.op != PING:
                    raise PipelineBrokenError(f"pipeline message out of order: sent a heartbeat, got {back.op} back")
                self._record(self.link.recv((self.world, len(STAT_FIELDS)), torch.float64))
                self.link.flush()
            except PipelineBrokenError as exc:
                self._break(str(exc))
                raise

    def stop(self) -> None:
        """Tell every stage to end its loop (the server is shutting down cleanly)."""
        self._stopped.set()
        if self.broken is None:
            try:
                self.control(Header(STOP))
            except PipelineBrokenError:
                log.warning("the pipeline broke while stopping")

    def _ring(
        self, ids: torch.Tensor, mask: Any, positions: torch.Tensor, cache: BoundSlotCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = ids.shape
        binding = cache.binding if cache is not None else None
        if binding is not None and not isinstance(binding, BatchedBinding):
            raise TypeError("the ring ships batched bindings only (runs_packed_rows is False)")
        span = binding.span if binding is not None else width
        m = min(self.micro_batches, rows) if cache is not None else 1
        bounds = [(rows * j // m, rows * (j + 1) // m) for j in range(m)]
        for lo, hi in bounds:
            t0 = time.perf_counter()
            part_mask = _rows_of(mask, lo, hi)
            part = None
            if cache is not None:
                slots, starts = binding.slots[lo:hi], binding.starts[lo:hi]
                part = cache.store.bound(slots.tolist(), starts.tolist(), width, span)
            out = run_stage_layers(self.stage, part, hi - lo, width, part_mask, positions[lo:hi], None, ids=ids[lo:hi])
            self.clock.busy_since(t0)
            stats = torch.zeros((self.world, len(STAT_FIELDS)), dtype=torch.float64)
            stats[0] = self.clock.row(self.cache)
            kind, mask_tensors = send_masks(part_mask)
            header = Header(FORWARD, (hi - lo, width, span, kind, int(cache is not None)))
            extra = [slots, starts] if cache is not None else []
            self.link.send(header, *extra, *mask_tensors, positions[lo:hi], out, stats)
        hidden_parts, position_parts = [], []
        for _ in bounds:
            h = self.link.recv_header()
            if h.op != FORWARD:
                raise PipelineBrokenError(f"pipeline message out of order: sent a forward, got operation {h.op} back")
            part_rows, part_width, part_span, kind, cached = h.args[:5]
            if cached:
                self.link.recv((part_rows,), torch.long)
                self.link.recv((part_rows,), torch.long)
            recv_masks(self.link, kind, (part_rows, 1, part_width, part_span), self.dtype)
            position_parts.append(self.link.recv((part_rows, part_width), torch.long))
            hidden_parts.append(self.link.recv((part_rows, part_width, self.stage.hidden_size), self.dtype))
            stats = self.link.recv((self.world, len(STAT_FIELDS)), torch.float64)
            self._record(stats)
        self.link.flush()
        self.steps += 1
        return torch.cat(hidden_parts), torch.cat(position_parts)

    def _head(self, hidden: torch.Tensor, positions: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
        """The final norm and head on rank 0, for the positions the caller keeps (``logits_to_keep``)."""
        t0 = time.perf_counter()
        if isinstance(keep, torch.Tensor):
            hidden, positions = hidden[:, keep], positions[:, keep]
        elif keep:
            hidden, positions = hidden[:, -keep:], positions[:, -keep:]
        ctx = self.stage.ctx
        ctx.mode, ctx.incoming = "head", hidden
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long)
            logits = self.stage.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        finally:
            ctx.mode, ctx.incoming = "layers", None
        self.clock.busy_s += time.perf_counter() - t0
        return logits

    def _record(self, stats: torch.Tensor) -> None:
        for r in range(1, self.world):
            busy, serving, resident, kv = stats[r].tolist()
            self.stats[r] = StageStats(busy, serving, int(resident), int(kv))
        row = self.clock.row(self.cache).tolist()
        self.stats[0] = StageStats(row[0], row[1], int(row[2]), int(row[3]))

    def _check(self) -> None:
        if self.broken is not None:
            raise PipelineBrokenError(self.broken)

    def _break(self, message: str) -> None:
        if self.broken is not None:
            return
        self.broken = message
        log.error("the pipeline is broken: %s", message)
        for callback in self._on_broken:
            try:
                callback(message)
            except Exception:  # noqa: BLE001 - every callback must run
                log.exception("a pipeline-broken callback failed")

    def _beat(self) -> None:
        """Every ``heartbeat_s`` while nothing else uses the ring, a PING round it (a request's step counts too)."""
        while not self._stopped.wait(self._heartbeat_s):
            if self.broken is not None:
                return
            if not self._lock.acquire(blocking=False):
                continue  # a step is running: that is proof of life, and its failure is reported by it
            self._lock.release()
            try:
                self.ping()
            except PipelineBrokenError:
                return

    # -- reports ---------------------------------------------------------------------------------------------------
    def pipeline_report(self) -> dict[str, Any]:
        """Per stage: its rank, layers, memory planned and measured, and busy fraction (for ``/info``)."""
        stages = []
        for st, stats in zip(self.plan.stages, self.stats):
            planned = {  # weights held in memory (RAM or GPU); those the stage plan leaves on disk apart
                "weights": sum(b.weights for b in st.plan.budgets if b.device != "disk"),
                "disk": sum(b.weights for b in st.plan.budgets if b.device == "disk"),
                "kv_cache": sum(b.kv_cache for b in st.plan.budgets),
                "total": sum(b.total for b in st.plan.budgets),
            }
            stages.append(
                {
                    "stage": st.index,
                    "rank": st.host,
                    "layers": [st.first_layer, st.last_layer],
                    "num_layers": st.num_layers,
                    "memory": {
                        "planned": planned,
                        "measured": {"weights": stats.resident_bytes, "kv_cache": stats.kv_cache_bytes},
                    },
                    "busy_s": round(stats.busy_s, 6),
                    "serving_s": round(stats.serving_s, 3),
                    "busy_fraction": round(stats.busy_fraction, 6),
                    "predicted_seconds_per_micro_batch": st.seconds_per_micro_batch,
                }
            )
        return {
            "ranks": self.world,
            "micro_batches": self.micro_batches,
            "steps": self.steps,
            "broken": self.broken,
            "stages": stages,
            "prediction": {
                "decode_tokens_per_s": self.plan.prediction.decode_tokens_per_s,
                "bottleneck": self.plan.prediction.bottleneck,
            },
        }


def _rows_of(mask: Any, lo: int, hi: int) -> Any:
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {k: v[lo:hi] for k, v in mask.items()}
    return mask[lo:hi]
