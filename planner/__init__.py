"""Device-map planner: where each layer of a model goes, under memory limits, for a given workload.

Public API::

    plan(model, max_memory=None, strategy="auto", dtype=None, quantization=None,
         batch_size=1, context=None, gpus=None, ...) -> Plan

``model`` is a model directory, a ``config.json`` path, a config dict (naming ``model_type`` or ``architectures``)
or a :class:`Skeleton`. ``Plan.to_json()`` / ``Plan.from_json()`` round-trip losslessly.
"""

from planner.api import plan
from planner.errors import HardwareSpecError, HeaderError, LoadmasterError, ModelSourceError, PlanError
from planner.types import (
    Block,
    Device,
    DeviceBudget,
    Hardware,
    KVGeometry,
    Plan,
    Prediction,
    Skeleton,
    TensorSpec,
    Workload,
)

__all__ = [
    "Block",
    "Device",
    "DeviceBudget",
    "Hardware",
    "HardwareSpecError",
    "HeaderError",
    "KVGeometry",
    "LoadmasterError",
    "ModelSourceError",
    "Plan",
    "PlanError",
    "Prediction",
    "Skeleton",
    "TensorSpec",
    "Workload",
    "plan",
]
