"""``POST /plan``: a dry run of the planner, loading no weights, plus what-if searches.

The model is a directory under the configured model roots, the served model (by name, or when omitted), or an
inline ``config``. The answer is the Plan JSON (``Plan.from_dict`` reads it back); with ``what_if`` it also
carries the largest context or batch that fits on the same hardware.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from planner.advice import largest_batch, largest_context
from planner.api import plan_inputs
from planner.errors import PlanError
from planner.inputs import PlanInputs, resolve_skeleton
from service.errors import RequestValidationError
from service.model_positions import model_position_limit
from service.runtime import runtime_of
from service.security import resolve_under_roots

router = APIRouter(tags=["plan"])


class PlanRequest(BaseModel):
    """The planner's inputs. Sizes are bytes or strings like ``"24GiB"``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Directory under the model roots, or the served model's name.")
    config: dict[str, Any] | None = Field(None, description="An inline config.json (instead of model).")
    max_memory: dict[str, int | str] | None = Field(None, description='e.g. {"0": "20GiB", "cpu": "64GiB"}')
    gpus: str | list[int | str] | None = Field(None, description='Declared GPUs, e.g. "4x24GiB".')
    strategy: str | dict[str, int | str] = "auto"
    dtype: str | None = None
    quantization: str | None = None
    batch_size: int = Field(1, ge=1)
    context: int | None = Field(None, ge=1)
    what_if: Literal["max_context", "max_batch"] | None = Field(
        None, description="Also answer the largest context (or batch) that fits."
    )


def _model_source(request: Request, body: PlanRequest) -> Any:
    runtime = runtime_of(request)
    if body.config is not None:
        if body.model is not None:
            raise RequestValidationError("Give either model or config, not both.")
        return dict(body.config)
    served = runtime.settings.served_model_name or (runtime.loaded.name if runtime.loaded else None)
    if body.model is None or (served is not None and body.model == served):
        if runtime.loaded is not None:
            return str(runtime.loaded.path)
        if runtime.settings.model and not runtime.settings.demo:
            return str(runtime.settings.model)
        if body.model is None:
            raise RequestValidationError("No model named and none served yet; give model (a directory) or config.")
    return str(resolve_under_roots(body.model, runtime.settings.model_root))


@router.post("/plan", summary="Plan a model's device map without loading weights (dry run)")
def plan_route(request: Request, body: PlanRequest) -> dict[str, Any]:
    source = _model_source(request, body)
    skeleton = resolve_skeleton(source)
    inputs = PlanInputs(
        max_memory=body.max_memory,
        gpus=body.gpus,
        strategy=body.strategy,
        dtype=body.dtype,
        quantization=body.quantization,
        batch_size=body.batch_size,
        context=body.context,
    )
    answer: dict[str, Any]
    try:
        answer = plan_inputs(skeleton, inputs).to_dict()
    except PlanError:
        if body.what_if is None:
            raise
        answer = {"plan": None}
    if body.what_if is not None:
        hardware, workload, strategy = inputs.hardware(), inputs.workload(skeleton), inputs.checked_strategy()
        if body.what_if == "max_context":
            limit = model_position_limit(source) or (1 << 22)
            best = largest_context(skeleton, hardware, workload, strategy, limit=limit)
            what = {"question": "max_context", "batch_size": body.batch_size, "max_context": best, "limit": limit}
        else:
            best = largest_batch(skeleton, hardware, workload, strategy)
            what = {"question": "max_batch", "context": workload.context, "max_batch_size": best}
        answer["what_if"] = what
    return answer
