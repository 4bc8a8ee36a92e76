"""A checkpoint's identity, so that a Plan names the checkpoint it was made for and the loader refuses another.

The fingerprint hashes what a plan depends on and what a re-save or a different model changes: each shard's file
name and size, and each tensor's name, dtype and shape, all read from the safetensors headers (no weight is read).
The directory's path is not part of it, so a copied or moved checkpoint keeps its plans. Values are
``"sha256:<hex>"`` strings: plain data that round-trips through a Plan's JSON.
"""

from __future__ import annotations

import hashlib

from planner.errors import PlanError
from planner.model.safetensors_header import CheckpointHeaders

PREFIX = "sha256:"


def checkpoint_fingerprint(headers: CheckpointHeaders) -> str:
    """The fingerprint of a checkpoint whose headers were read by ``read_checkpoint_headers``."""
    digest = hashlib.sha256()
    for shard in sorted(headers.files, key=lambda h: h.path.name):
        digest.update(f"{shard.path.name}\0{shard.file_size}\n".encode())
        for name in sorted(shard.tensors):
            t = shard.tensors[name]
            digest.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\n".encode())
    return PREFIX + digest.hexdigest()[:32]


def check_plan_fingerprint(plan_fingerprint: str | None, fingerprint: str | None, checkpoint: str) -> None:
    """Refuse a plan made for another checkpoint than ``checkpoint`` (whose fingerprint is ``fingerprint``).

    A plan made from a bare config carries no fingerprint and is accepted: it describes an architecture, not files.
    """
    if plan_fingerprint is None or plan_fingerprint == fingerprint:
        return
    raise PlanError(
        f"This plan was made for another checkpoint than {checkpoint}: the plan's checkpoint is {plan_fingerprint}, "
        f"this one is {fingerprint} (the shards' names, sizes or tensors differ). Plan again for this directory "
        f"(`loadmaster plan {checkpoint} --json`, or load with device_map='auto')."
    )


__all__ = ["check_plan_fingerprint", "checkpoint_fingerprint"]
