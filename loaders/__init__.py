"""Loader: sharded safetensors checkpoints onto planned devices, with zero-copy disk offload and streaming.

Public API::

    load_model(path, device_map="auto", max_memory=None, dtype=None, quantization=None, offload_folder=None,
               *, progress=None, **workload) -> torch.nn.Module
    load_model_and_tokenizer(path, ...) -> (model, tokenizer)
    load_checkpoint(path_or_described, ...) -> LoadResult   (typed: model, device_map, plan, stats, skeleton)
    load_stage(path, cluster_plan, index, ...) -> StageModel   (load_checkpoint restricted to one pipeline stage)

Placement (``loaders.checkpoint.placement``) and execution (``loaders.run.execution``) are separate rooms;
``load_checkpoint`` (in ``loaders.load``) is the one place that runs them in order. ``device_map`` is a strategy
name ("auto", "balanced", "balanced_low_0", "sequential"), a dict in transformers' hf_device_map format, the
:class:`planner.placement.inputs.PlanInputs` to plan with, or a :class:`planner.Plan` (obeyed exactly; refused
when made for another checkpoint). The model carries ``hf_device_map`` and ``load_stats`` (:class:`LoadStats`);
``progress`` receives :class:`LoadProgress` updates.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loaders.checkpoint.load_progress import LoadProgress, LoadStats
    from loaders.errors import CheckpointError
    from loaders.load import (
        LoadResult,
        load_checkpoint,
        load_model,
        load_model_and_tokenizer,
        load_stage,
        load_tokenizer,
    )

#: Where each public name lives. Resolved on first use (PEP 562), so importing one room of the loader (the server
#: imports ``loaders.native.cpu_threads`` before it listens) does not pull in the whole load path and the
#: transformers model code behind it.
_HOMES = {
    "CheckpointError": "loaders.errors",
    "LoadProgress": "loaders.checkpoint.load_progress",
    "LoadStats": "loaders.checkpoint.load_progress",
    "LoadResult": "loaders.load",
    "load_checkpoint": "loaders.load",
    "load_model": "loaders.load",
    "load_model_and_tokenizer": "loaders.load",
    "load_stage": "loaders.load",
    "load_tokenizer": "loaders.load",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointError",
    "LoadProgress",
    "LoadResult",
    "LoadStats",
    "load_checkpoint",
    "load_model",
    "load_model_and_tokenizer",
    "load_stage",
    "load_tokenizer",
]
