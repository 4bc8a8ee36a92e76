"""The loader's exceptions.

A checkpoint that does not match the model it claims to hold is the user's to fix (re-save it, point at the right
directory), so every message names the offending keys or file and says what to do.
"""

from __future__ import annotations

from planner.errors import LoadmasterError


class CheckpointError(LoadmasterError):
    """The checkpoint cannot be loaded as the model its config describes.

    Raised for missing keys, unexpected keys, shape mismatches, truncated or corrupt shards, an index naming a
    file that is not there, and an offload folder that belongs to another model or to an interrupted run.
    """

    error_type = "checkpoint"


class WeightsChangedError(CheckpointError):
    """The served weight files changed under a running process (a shard truncated, removed or rewritten), so what
    it computes from them can no longer be trusted: the request fails and the server must be restarted."""


def list_keys(keys, limit: int = 20) -> str:
    """Render a sorted key list for a message, cut to ``limit`` entries so a 70B model's errors stay readable."""
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    if len(keys) > limit:
        shown += f", ... ({len(keys) - limit} more)"
    return shown
