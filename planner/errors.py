"""The planner's exceptions. Each message says what was wrong and what to do about it.

``error_type`` is the stable tag the service puts in its JSON error envelope.
"""

from __future__ import annotations


class LoadmasterError(Exception):
    """Base of every error this project raises on purpose."""

    error_type = "error"


class PlanError(LoadmasterError):
    """A plan cannot be made: nothing fits, an unknown strategy, a custom map that names unknown modules..."""

    error_type = "plan"


class HardwareSpecError(PlanError, ValueError):
    """A ``max_memory`` entry, a size string, a device key or a ``--gpus`` declaration that cannot be read."""


class ModelSourceError(PlanError):
    """The model to plan for cannot be read: no config, no weights, an unknown architecture."""


class HeaderError(ModelSourceError):
    """A safetensors file whose header is truncated or corrupt (bad length, bad JSON, offsets outside the file)."""
