"""Running a pipeline on torch.distributed: one stage per rank, hidden states and control by point-to-point.

Rank 0 holds stage 0 (embeddings, its layers, and the final norm and head) and drives; ranks 1..k-1 run
:func:`serve_stage` until told to stop. One message per micro-batch goes around the ring 0 -> 1 -> ... -> k-1 -> 0:
a header (:class:`Header`: operation, micro-batch, shape), then the attention mask, the position ids and the hidden
states. ``PREFILL`` starts micro-batch ``j``'s KV cache on every stage (each stage keeps the cache of its own
layers), ``DECODE`` extends it, ``RELEASE`` drops it, ``STOP`` ends the ranks' loops.

Sends are asynchronous (``isend``), so within a step stage ``s`` computes micro-batch ``j`` while stage ``s+1``
computes ``j-1``: a step of ``m`` micro-batches over ``k`` stages takes about ``m + k - 1`` stage-times, not ``m*k``.

Before any weight is read, every rank checks that it planned the same pipeline as rank 0 (:func:`check_same_plan`):
the loadmaster version, the checkpoint fingerprint and the plan's digest, each compared by name.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist
from transformers.cache_utils import DynamicCache

from loaders.pipeline_stage import StageModel
from planner.cluster import ClusterPlan

log = logging.getLogger(__name__)

PREFILL, DECODE, RELEASE, STOP = 1, 2, 3, 0
_IDENTITY_BYTES = 4096


class PipelineMismatchError(RuntimeError):
    """A rank planned a different pipeline than rank 0 (another model, plan or version)."""


class PipelineBrokenError(RuntimeError):
    """A rank died or stopped answering within the group's timeout: the whole group must be restarted."""


def loadmaster_version() -> str:
    try:
        return version("loadmaster")
    except PackageNotFoundError:
        return "unknown"


def identity(plan: ClusterPlan) -> dict[str, str]:
    """What must agree across ranks, by name."""
    return {
        "version": loadmaster_version(),
        "model": plan.model,
        "fingerprint": str(plan.fingerprint),
        "plan": plan.digest(),
    }


def check_same_plan(plan: ClusterPlan) -> None:
    """Compare this rank's identity (version, model, fingerprint, plan digest) with every rank's; see
    :func:`check_same_identity`."""
    check_same_identity(identity(plan))


def check_same_identity(mine: dict[str, str]) -> None:
    """Compare this rank's identity with every rank's (JSON in a fixed-size byte tensor, all-gathered: no pickle).

    Every rank raises the same one-line error naming the rank and the fields that differ, so the group stops.
    """
    data = json.dumps(mine, sort_keys=True).encode()
    if len(data) > _IDENTITY_BYTES:
        raise PipelineMismatchError(f"pipeline identity too long to exchange ({len(data)} > {_IDENTITY_BYTES} bytes)")
    buf = torch.zeros(_IDENTITY_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(wire_device())  # NCCL collectives take GPU tensors
    gathered = [torch.zeros_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, buf)
    ranks = [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0")) for t in gathered]
    ref = ranks[0]
    for r, other in enumerate(ranks[1:], start=1):
        diff = [f"{k} {other.get(k)!r} (rank 0: {ref[k]!r})" for k in ref if other.get(k) != ref[k]]
        if diff:
            raise PipelineMismatchError(
                f"rank {r} was started with a different {', '.join(diff)}; start every rank with the same "
                "model, planning flags and loadmaster version"
            )


def share_plan(plan: ClusterPlan | None, error: str | None = None) -> ClusterPlan:
    """Rank 0's plan, broadcast as JSON bytes (no pickle), on every rank. Rank 0 passes its plan, or the error that
    stopped its planning, which every rank then raises (as a :class:`~planner.errors.PlanError`)."""
    from planner.errors import PlanError

    wire = wire_device()
    if dist.get_rank() == 0:
        data = (plan.to_json(indent=None) if plan is not None else str(error)).encode()
        size = torch.tensor([len(data) if plan is not None else -len(data)], dtype=torch.long, device=wire)
        dist.broadcast(size, 0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire), 0)
    else:
        size = torch.zeros(1, dtype=torch.long, device=wire)
        dist.broadcast(size, 0)
        buf = torch.zeros(abs(int(size)), dtype=torch.uint8, device=wire)
        dist.broadcast(buf, 0)
        data = bytes(buf.cpu().tolist())
    if int(size) < 0:
        raise PlanError(f"rank 0 could not plan the pipeline: {data.decode()}")
    return ClusterPlan.from_json(data.decode()) if plan is None else plan


@dataclass(frozen=True)
class Header:
    op: int
    micro_batch: int
    rows: int
    tokens: int
    mask_len: int

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.op, self.micro_batch, self.rows, self.tokens, self.mask_len], dtype=torch.long)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        return cls(*(int(v) for v in t.tolist()))


def wire_device() -> torch.device:
    """Where point-to-point tensors must live for the group's backend: NCCL sends GPU tensors (this rank's current
    GPU), gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Link:
    """Point-to-point sends to the next rank and receives from the previous one; at most a few sends in flight.

    Tensors cross on :func:`wire_device` and are handed back on the CPU: the engine's control data is read there,
    and a stage's execution hooks move hidden states onto the device of the layer that takes them, as in one
    process (with gloo, as on this machine, nothing moves)."""

    def __init__(self, rank: int, world: int):
        self.next = (rank + 1) % world
        self.prev = (rank - 1) % world
        self.pending: list[dist.Work] = []
        self.device = wire_device()

    def send(self, header: Header, *tensors: torch.Tensor) -> None:
        if len(self.pending) > 64:
            self.flush()
        try:
            for t in (header.tensor(), *tensors):
                self.pending.append(dist.isend(t.to(self.device).contiguous(), self.next))
        except RuntimeError as e:  # a peer already gone can fail the send itself, not only its wait
            raise PipelineBrokenError(f"pipeline rank {self.next} stopped receiving ({e}); restart the group") from e

    def flush(self) -> None:
        try:
            for w in self.pending:
                w.wait()
        except RuntimeError as e:
            raise PipelineBrokenError(f"pipeline rank {self.next} stopped receiving ({e}); restart the group") from e
        finally:
            self.pending.clear()

    def recv_header(self) -> Header:
        t = torch.zeros(5, dtype=torch.long, device=self.device)
        self._recv(t)
        return Header.of(t.cpu())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(t)
        return t.cpu()

    def _recv(self, t: torch.Tensor) -> None:
        """A receive that a dead peer (connection closed) or a hung one (the group's timeout) turns into
        :class:`PipelineBrokenError` naming the rank, instead of an endless wait."""
        try:
            dist.recv(t, self.prev)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[-1][:200]
            raise PipelineBrokenError(
                f"pipeline rank {self.prev} stopped answering ({first}); the group must be restarted"
            ) from e


def _run_layers(
    stage: StageModel,
    cache: DynamicCache,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor | None,
) -> torch.Tensor:
    stage.ctx.mode, stage.ctx.incoming, stage.ctx.outgoing = "layers", hidden, None
    stage.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    out = stage.ctx.outgoing
    assert out is not None
    return out


def serve_stage(stage: StageModel, delay_s: float = 0.0) -> None:
    """The loop of ranks 1..k-1: receive a micro-batch, run this stage's layers on it, pass it on, until STOP.

    ``delay_s`` is a test-only hook: every micro-batch takes at least that long here (a stage made slow on purpose).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    link = Link(rank, world)
    caches: dict[int, DynamicCache] = {}
    with torch.inference_mode():
        while True:
            h = link.recv_header()
            if h.op == STOP:
                link.send(h)
                link.flush()
                return
            if h.op == RELEASE:
                caches.pop(h.micro_batch, None)
                link.send(h)
                continue
            mask = link.recv((h.rows, h.mask_len), torch.long)
            positions = link.recv((h.rows, h.tokens), torch.long)
            hidden = link.recv((h.rows, h.tokens, stage.hidden_size), stage.dtype)
            t0 = time.perf_counter()
            if h.op == PREFILL:
                caches[h.micro_batch] = DynamicCache(config=stage.model.config)
            ids = torch.zeros((h.rows, h.tokens), dtype=torch.long)
            out = _run_layers(stage, caches[h.micro_batch], ids, mask, positions, hidden)
            _sleep_rest(t0, delay_s)
            link.send(h, mask, positions, out)


def _sleep_rest(t0: float, delay_s: float) -> None:
    if delay_s > 0:
        left = delay_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


@dataclass
class _MicroBatch:
    rows: list[int]  # indices into the caller's prompts
    mask: torch.Tensor
    positions: torch.Tensor  # of the last tokens fed
    cache: DynamicCache


class PipelineDriver:
    """Rank 0: runs stage 0 and drives the ring. Call :meth:`generate_greedy`, then :meth:`stop`."""

    def __init__(self, stage: StageModel, micro_batches: int, delay_s: float = 0.0):
        if dist.get_rank() != 0:
            raise RuntimeError("PipelineDriver runs on rank 0; other ranks run serve_stage()")
        self.stage = stage
        self.micro_batches = max(1, micro_batches)
        self.link = Link(0, dist.get_world_size())
        self.delay_s = delay_s
        self.busy_s = 0.0

    def _first(self, op: int, j: int, mb: _MicroBatch, ids: torch.Tensor) -> None:
        t0 = time.perf_counter()
        out = _run_layers(self.stage, mb.cache, ids, mb.mask, mb.positions, None)
        _sleep_rest(t0, self.delay_s)
        self.busy_s += time.perf_counter() - t0
        self.link.send(Header(op, j, ids.shape[0], ids.shape[1], mb.mask.shape[1]), mb.mask, mb.positions, out)

    def _last(self) -> tuple[int, torch.Tensor]:
        h = self.link.recv_header()
        self.link.recv((h.rows, h.mask_len), torch.long)
        positions = self.link.recv((h.rows, h.tokens), torch.long)
        hidden = self.link.recv((h.rows, h.tokens, self.stage.hidden_size), self.stage.dtype)
        t0 = time.perf_counter()
        ctx = self.stage.ctx
        ctx.mode, ctx.incoming = "head", hidden[:, -1:, :]
        ids = torch.zeros((h.rows, 1), dtype=torch.long)
        logits = self.stage.model(input_ids=ids, position_ids=positions[:, -1:], use_cache=False).logits[:, -1, :]
        ctx.mode, ctx.incoming = "layers", None
        self.busy_s += time.perf_counter() - t0
        return h.micro_batch, logits

    @torch.inference_mode()
    def step(self, feeds: list[tuple[int, _MicroBatch, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """One pipeline step: every micro-batch's tokens through the ring; logits of its last position by index."""
        for j, mb, ids in feeds:
            op = PREFILL if ids.shape[1] > 1 or mb.cache.get_seq_length() == 0 else DECODE
            self._first(op, j, mb, ids)
        out = dict(self._last() for _ in feeds)
        self.link.flush()
        return out

    @torch.inference_mode()
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt, the batch split into micro-batches that overlap across stages."""
        m = min(self.micro_batches, len(prompts))
        groups = [list(range(len(prompts)))[j::m] for j in range(m)]
        mbs: list[_MicroBatch] = []
        feeds = []
        for j, rows in enumerate(groups):
            width = max(len(prompts[r]) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, width - len(prompts[r]) :] = torch.tensor(prompts[r])
                mask[i, width - len(prompts[r]) :] = 1
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            mb = _MicroBatch(rows, mask, positions, DynamicCache(config=self.stage.model.config))
            mbs.append(mb)
            feeds.append((j, mb, ids))
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            logits = self.step(feeds)
            feeds = []
            for j, mb in enumerate(mbs):
                tokens = logits[j].argmax(dim=-1)
                for i, r in enumerate(mb.rows):
                    out[r].append(int(tokens[i]))
                mb.positions = mb.positions[:, -1:] + 1
                mb.mask = torch.cat([mb.mask, mb.mask.new_ones((mb.mask.shape[0], 1))], dim=1)
                feeds.append((j, mb, tokens.unsqueeze(1)))
        for j in range(len(mbs)):
            self.link.send(Header(RELEASE, j, 0, 0, 0))
            self.link.recv_header()
        return out

    def stop(self) -> None:
        self.link.send(Header(STOP, 0, 0, 0, 0))
        self.link.recv_header()
        self.link.flush()
