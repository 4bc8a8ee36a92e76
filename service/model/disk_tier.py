"""The disk tier of a local checkpoint, there whether or not a folder was named.

Why: a checkpoint's own safetensors shards are a disk tier already: a layer planned on disk is read from them in
place (:mod:`loaders.checkpoint.materialize`), and only a tensor that must be cast or quantized is written, to a
per-model folder under the cache. So a box smaller than the model needs no ``--offload-folder`` to be served, and
``loadmaster plan --max-memory cpu=3GiB`` plans what ``serve`` in a 3 GiB box plans. A ``max_memory`` that names
a disk budget, or a folder given, is the user's and is left as it is.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from planner.hardware.devices import parse_device
from planner.placement.inputs import PlanInputs
from planner.user_cache import default_offload_folder


def with_checkpoint_disk(inputs: PlanInputs, path: Path) -> PlanInputs:
    """``inputs`` with the per-model offload folder where ``path`` is a local safetensors checkpoint and neither a
    folder nor a disk budget was given."""
    if inputs.offload_folder is not None or not path.is_dir() or not any(path.glob("*.safetensors")):
        return inputs
    if inputs.max_memory is not None and any(parse_device(k) == "disk" for k in inputs.max_memory):
        return inputs
    return replace(inputs, offload_folder=str(default_offload_folder(path)))
