"""The pipeline's one wire protocol on torch.distributed: a ring of ranks, one stage each, point-to-point.

Rank 0 holds stage 0 (embeddings, its layers, the final norm and the head) behind the engine
(:class:`~service.pipeline.stage_model.PipelineModel`); ranks 1..k-1 run :func:`~service.pipeline.stage_loop.serve_stage`
until told to stop. Every message goes round the ring 0 -> 1 -> ... -> k-1 -> 0 and starts with one :class:`Header`
(:data:`HEADER_LEN` longs: the operation, then its whole-number arguments):

==========  ===========================================  =========================================================
operation   arguments                                    tensors after the header
==========  ===========================================  =========================================================
``FORWARD`` rows, width, span, mask encoding, cached     [slots, starts if cached], the mask(s) (:func:`send_masks`),
                                                         positions ``[rows, width]``, hidden states
                                                         ``[rows, width, hidden]``, the stats table (:data:`STAT_FIELDS`)
``SETUP``   slots, slot length                           none: every stage sets up a slot cache of that shape
``COPY``    source, target, start, end                   none: every stage copies a prefix between two slots
``PING``    none                                         the stats table (the heartbeat)
``STOP``    none                                         none: every stage ends its loop
==========  ===========================================  =========================================================

Sends are asynchronous (``isend``), so stage ``s`` computes one micro-batch while stage ``s+1`` computes the one
before: a step of ``m`` micro-batches over ``k`` stages takes about ``m + k - 1`` stage-times, not ``m*k``. A dead
or hung peer turns a receive or a send into :class:`PipelineBrokenError` naming the rank.

Before any weight is read, every rank checks that it planned the same pipeline as rank 0 (:func:`check_same_plan`,
:func:`check_same_identity`: JSON in a fixed-size tensor, all-gathered; no pickle), and rank 0's plan can be
broadcast to the others (:func:`share_plan`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist

from planner.cluster import ClusterPlan

log = logging.getLogger(__name__)

#: The operations of a message (its header's first long).
STOP, FORWARD, SETUP, COPY, PING = 0, 1, 2, 3, 4
#: Longs in a header: the operation and up to seven arguments.
HEADER_LEN = 8
#: Mask encodings of a FORWARD: none (no cache: causal from the positions), one additive mask, one boolean mask,
#: or hybrid models' pair (full attention, sliding window) in either encoding.
MASK_NONE, MASK_FLOAT, MASK_BOOL, MASK_PAIR_FLOAT, MASK_PAIR_BOOL = 0, 1, 2, 3, 4
MASK_KEYS = ("full_attention", "sliding_attention")
#: Per-stage figures carried by every FORWARD and PING: busy seconds, seconds serving, resident weight bytes, KV bytes.
STAT_FIELDS = ("busy_s", "serving_s", "resident_bytes", "kv_cache_bytes")
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
    """A message's header: the operation and up to ``HEADER_LEN - 1`` whole-number arguments (see the table above)."""

    op: int
    args: tuple[int, ...] = ()

    def tensor(self) -> torch.Tensor:
        if len(self.args) > HEADER_LEN - 1:
            raise ValueError(f"a pipeline header holds at most {HEADER_LEN - 1} arguments, not {len(self.args)}")
        values = [self.op, *self.args] + [0] * (HEADER_LEN - 1 - len(self.args))
        return torch.tensor(values, dtype=torch.long)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        values = [int(v) for v in t.tolist()]
        return cls(values[0], tuple(values[1:]))


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
        self.rank, self.world = rank, world
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
        t = torch.zeros(HEADER_LEN, dtype=torch.long, device=self.device)
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


def send_masks(mask: Any) -> tuple[int, list[torch.Tensor]]:
    """A FORWARD's mask encoding and the tensors to send (booleans as bytes: gloo sends numbers)."""
    if mask is None:
        return MASK_NONE, []
    pair = isinstance(mask, dict)
    masks = [mask[k] for k in MASK_KEYS] if pair else [mask]
    boolean = masks[0].dtype == torch.bool
    kind = (MASK_PAIR_BOOL if boolean else MASK_PAIR_FLOAT) if pair else (MASK_BOOL if boolean else MASK_FLOAT)
    return kind, [m.to(torch.uint8) if boolean else m for m in masks]


def recv_masks(link: Link, kind: int, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The mask(s) :func:`send_masks` sent as ``kind``: None, one mask, or the hybrid pair by attention type."""
    if kind == MASK_NONE:
        return None
    boolean = kind in (MASK_BOOL, MASK_PAIR_BOOL)
    count = 2 if kind in (MASK_PAIR_FLOAT, MASK_PAIR_BOOL) else 1
    masks = [link.recv(shape, torch.uint8 if boolean else dtype) for _ in range(count)]
    masks = [m.bool() if boolean else m for m in masks]
    return dict(zip(MASK_KEYS, masks)) if count == 2 else masks[0]
