"""``POST /plan``: a dry run of the planner, loading no weights, plus what-if searches.

The model is a directory under the configured model roots, the served model (by name, or when omitted), an
inline ``config``, or (when the server runs with ``--allow-hub-plan``) a Hub id ``org/name[@revision]``. The
answer is the Plan JSON (``Plan.from_dict`` reads it back); with ``what_if`` it also carries the largest context
or batch that fits on the same hardware.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from planner.api import plan_inputs
from planner.errors import LoadmasterError, PlanError
from planner.placement.advice import largest_batch, largest_context
from planner.placement.inputs import DEFAULT_CONTEXT, PlanInputs, resolve_skeleton
from planner.types import PREFILL_CHUNK
from service.errors import RequestValidationError
from service.http.access_log import CLIENT_CLOSED
from service.http.admission import request_id_of, runtime_of
from service.http.cluster_plan_routes import MAX_HOSTS, HostSpec, check_cluster_request, cluster_answer
from service.http.plan_limits import PlanAbandoned, PlanWorkers, check_config, check_model_dir, check_skeleton
from service.model.background_load import ALLOWED_ROOT_OPTION, hub_ref, serve_roots
from service.model.model_paths import (
    check_path_text,
    confine_model_files,
    path_error_reason,
    real_roots,
    resolve_under_roots,
)
from service.model.positions import model_position_limit, planned_context
from service.schemas.openapi_responses import BODY_ERRORS, errors
from service.schemas.response_models import ClusterPlanResponse, NoPlanResponse, PlanResponse

log = logging.getLogger(__name__)

router = APIRouter(tags=["plan"])


class PlanRequest(BaseModel):
    """The planner's inputs. Sizes are bytes or strings like ``"24GiB"``."""

    # strict: see service.schemas.validation.request_model_config
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"max_memory": {"cpu": "8GiB"}},
                {"what_if": "max_context", "max_memory": {"cpu": "2GiB"}},
                {
                    "config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000},
                    "gpus": "2x1GiB",
                    "dtype": "float16",
                },
            ]
        },
    )

    model: str | None = Field(
        None,
        description="Directory under the model roots, the served model's name, or a "
        "Hub id org/name[@revision] (with --allow-hub-plan).",
    )
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
    hosts: list[HostSpec] | None = Field(
        None,
        min_length=1,
        max_length=MAX_HOSTS,
        description="A cluster: one stage per host (its own max_memory/gpus); the answer is the ClusterPlan JSON.",
    )
    micro_batches: int | None = Field(None, ge=1, description="With hosts: groups a batch is split into.")
    inter_host_bandwidth: str | float | None = Field(
        None, description='With hosts: the link between hosts, e.g. "100Gb" (bits) or "12.5GB" (bytes/s).'
    )


def _model_source(request: Request, body: PlanRequest) -> Any:
    runtime = runtime_of(request)
    if body.config is not None:
        if body.model is not None:
            raise RequestValidationError("Give either model or config, not both.")
        return dict(body.config)
    if _names_served(request, body):
        if runtime.loaded is not None:
            return str(runtime.loaded.path)
        if runtime.settings.model and not runtime.settings.demo:
            path = Path(runtime.settings.model).expanduser()
            if hub_ref(runtime.settings) is None and path.is_dir():  # confined as the load is
                confine_model_files(path, serve_roots(runtime.settings, path), ALLOWED_ROOT_OPTION)
            return str(runtime.settings.model)
        if body.model is None:
            raise RequestValidationError("No model named and none served yet; give model (a directory) or config.")
    check_path_text(body.model)
    hub = _hub_source(runtime.settings, body.model)
    if hub is not None:
        return hub
    settings = runtime.settings
    directory = resolve_under_roots(body.model, settings.model_root)
    confine_model_files(directory, real_roots([*settings.model_root, *settings.allowed_root]), PLAN_ROOT_OPTIONS)
    return str(directory)


#: How the settings that widen the roots /plan reads files under are spelled in refusals.
PLAN_ROOT_OPTIONS = "--model-root or --allowed-root"


class HubPlanDisabledError(RequestValidationError):
    """A Hub id sent to a server that was not started with ``--allow-hub-plan``."""

    status_code = 403


def _hub_source(settings: Any, name: str) -> str | None:
    """``hf://org/name[@rev]`` when ``name`` is a Hub id (and no directory of that name is under the model roots).

    Planning a Hub id makes outbound requests (config.json and the shard headers), so it is off unless the server
    was started with ``--allow-hub-plan``; the skeleton it yields then goes through the same checks as an inline
    config's.
    """
    from pathlib import Path

    from planner.model.model_ref import HUB_PREFIX, looks_like_hub_id

    if not looks_like_hub_id(name):
        return None
    if not name.startswith(HUB_PREFIX) and any((Path(r).expanduser() / name).exists() for r in settings.model_root):
        return None  # local directories keep priority
    if not settings.allow_hub_plan:
        raise HubPlanDisabledError(
            f"{name!r} looks like a Hub id, and this server does not plan Hub models (it would make outbound "
            "requests); start it with --allow-hub-plan (LOADMASTER_ALLOW_HUB_PLAN=1), or send an inline config"
        )
    return name if name.startswith(HUB_PREFIX) else HUB_PREFIX + name


@router.post(
    "/plan",
    summary="Plan a model's device map without loading weights (dry run)",
    response_model=PlanResponse | NoPlanResponse | ClusterPlanResponse,
    responses=errors(401, 403, 404, *BODY_ERRORS, 429, client_closed=True),
)
async def plan_route(request: Request, body: PlanRequest) -> Response:
    runtime = runtime_of(request)
    settings = runtime.settings
    check_cluster_request(body)
    source = _model_source(request, body)
    default_context = _default_context(request, body)
    try:
        if isinstance(source, dict):
            check_config(source, settings)
        elif not str(source).startswith("hf://"):
            check_model_dir(Path(source), settings)
        answer = await _workers(request).run(
            lambda: _plan(source, body, settings, default_context),
            timeout=settings.plan_timeout,
            request=request,
            abandon=lambda: runtime.draining,
        )
    except PlanAbandoned:
        log.info("request %s: /plan abandoned (client gone or server draining)", request_id_of(request))
        return Response(status_code=CLIENT_CLOSED)
    except LoadmasterError as exc:
        if isinstance(source, str) and exc.args and isinstance(exc.args[0], str):
            log.info("request %s: /plan of %s refused: %s", request_id_of(request), source, exc)
            exc.args = (_without_server_paths(exc.args[0], source, body.model, settings), *exc.args[1:])
        raise
    return JSONResponse(answer)


def _names_served(request: Request, body: PlanRequest) -> bool:
    """Whether the request plans the served model (no model named, or the served model's name)."""
    runtime = runtime_of(request)
    names = runtime.settings.served_names()
    served = names[0] if names else (runtime.loaded.name if runtime.loaded else None)
    return body.config is None and (body.model is None or (served is not None and body.model == served))


def _default_context(request: Request, body: PlanRequest) -> int:
    """The context a plan is made for when the request names none: for the served model, what the server plans
    for and admits (``--context``, else ``--max-total-tokens``; the model's positions then cap it, as they cap
    ``/info``'s limits and the page's form); for another model, the planner's default (capped the same way)."""
    if not _names_served(request, body):
        return DEFAULT_CONTEXT
    runtime = runtime_of(request)
    plan = runtime.loaded.plan if runtime.loaded is not None else None
    return plan.workload.context if plan is not None else runtime.settings.planned_context()


def _without_server_paths(message: str, source: str, named: str | None, settings: Any) -> str:
    """A refusal as the client may read it: the model directory as the client named it, the roots unnamed (the log
    keeps the real paths)."""
    message = message.replace(source, named or "<served model>")
    for root in sorted({str(r) for r in real_roots([*settings.model_root, *settings.allowed_root])}, key=len)[::-1]:
        message = message.replace(root, "<model root>")
    return message


def _workers(request: Request) -> PlanWorkers:
    state = request.app.state
    workers = getattr(state, "plan_workers", None)
    if workers is None:
        workers = state.plan_workers = PlanWorkers(runtime_of(request).settings.plan_workers)
    return workers


#: Errors a model description that is not a model raises inside transformers' config and model classes.
_NOT_A_MODEL = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RuntimeError)


def _plan(source: Any, body: PlanRequest, settings: Any, default_context: int) -> dict[str, Any]:
    """The dry run itself (on a plan worker thread): skeleton, limits, plan, what-if. The context is the request's
    (refused beyond the model's positions, naming both), else ``default_context`` capped at the positions."""
    try:
        skeleton = resolve_skeleton(source)
    except LoadmasterError:
        raise
    except RecursionError:
        raise RequestValidationError("The config nests too deeply to be a model config.") from None
    except OSError as exc:  # a file of the model that cannot be opened: a link loop, a directory, no permission
        raise RequestValidationError(
            f"A file of that model cannot be read: {path_error_reason(exc)}; fix the model directory."
        ) from None
    except _NOT_A_MODEL as exc:
        raise RequestValidationError(
            f"This is not a model the planner can read: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        ) from None
    check_skeleton(skeleton, settings)
    if body.hosts is not None:
        return cluster_answer(skeleton, body)
    positions = model_position_limit(source)
    inputs = PlanInputs(
        max_memory=body.max_memory,
        gpus=body.gpus,
        strategy=body.strategy,
        dtype=body.dtype,
        quantization=body.quantization,
        batch_size=body.batch_size,
        context=planned_context(body.context, default_context, positions),
        prefill_chunk=PREFILL_CHUNK,
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
            limit = positions or (1 << 22)
            best = largest_context(skeleton, hardware, workload, strategy, limit=limit)
            what = {"question": "max_context", "batch_size": body.batch_size, "max_context": best, "limit": limit}
        else:
            best = largest_batch(skeleton, hardware, workload, strategy)
            what = {"question": "max_batch", "context": workload.context, "max_batch_size": best}
        answer["what_if"] = what
    return answer
