"""TGI-compatible generation routes, health, info and metrics.

``POST /generate`` and ``POST /generate_stream`` take TGI's body and answer in TGI's shapes, and ``POST /``
dispatches on ``"stream"`` as TGI does, which is where huggingface_hub's ``InferenceClient`` posts.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import ServerSentEvent

from planner.placement.speculative_rate import current_prediction, draft_tokens
from service.engine.requests import ErrorEvent, FinishEvent, PrefillToken, TokenEvent
from service.errors import NOT_READY_RETRY_AFTER_S, NotReadyError, RequestValidationError
from service.http.admission import (
    EngineStream,
    off_loop,
    open_streams,
    request_id_of,
    runtime_of,
    validated,
    wait_all,
)
from service.http.event_stream import event_stream, json_event
from service.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.model.background_load import engine_slots, running_sequences
from service.model.memory_report import memory_report
from service.schemas.openapi_responses import (
    BODY_ERRORS,
    GENERATION_ERRORS,
    errors,
    json_content,
    plain_content,
    schema_ref,
    streamed,
)
from service.schemas.response_models import (
    DetokenizeAnswer,
    ErrorEnvelope,
    HealthResponse,
    InfoResponse,
    LoadState,
    TGIGenerateResponse,
    TGIStreamEvent,
    TokenCount,
    TokenSpan,
    error_body,
)
from service.schemas.tgi_requests import TGIRequest, validate_tgi
from service.schemas.token_requests import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenized,
    tokenize_shape,
    vllm_tokens,
)

log = logging.getLogger(__name__)

router = APIRouter()

VERSION = "0.1.0"
CLIENT_CLOSED = 499


def _token(ev: TokenEvent) -> dict[str, Any]:
    return {"id": ev.id, "text": ev.text, "logprob": ev.logprob, "special": ev.special}


def _error_body(ev: ErrorEvent) -> dict[str, Any]:
    return error_body(ev.message, ev.error_type)


def _prefill(token: PrefillToken) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": token.logprob}


def _sequence_details(final: FinishEvent, body: TGIRequest) -> dict[str, Any]:
    """What TGI's ``details`` (and each of its ``best_of_sequences``) holds."""
    p = body.parameters
    out: dict[str, Any] = {
        "finish_reason": final.reason,
        "generated_tokens": final.generated_tokens,
        "seed": final.seed,
        "prefill": [_prefill(t) for t in final.prefill] if p.decoder_input_details else [],
        "tokens": [_token(t) for t in final.tokens],
    }
    if p.top_n_tokens:
        out["top_tokens"] = [[_token(a) for a in t.top_tokens] for t in final.tokens]
    return out


def _check_tgi(body: TGIRequest, stream: bool) -> None:
    """What TGI itself refuses per route, so that nothing asked for is silently dropped."""
    p = body.parameters
    if stream:
        if p.best_of not in (None, 1):
            raise RequestValidationError("best_of > 1 cannot be streamed; use POST /generate or omit best_of.")
        if p.decoder_input_details:
            raise RequestValidationError("decoder_input_details cannot be streamed; use POST /generate with details.")
    elif not p.details and (p.decoder_input_details or p.top_n_tokens or p.best_of not in (None, 1)):
        raise RequestValidationError(
            "decoder_input_details, top_n_tokens and best_of are answered in 'details': set details=true."
        )


async def _start(request: Request, body: TGIRequest, stream: bool) -> list[EngineStream]:
    """Validate (before anything streams), take a slot per sequence, submit. Raises the service's errors."""
    runtime = runtime_of(request)
    engine, validator, _ = runtime.require_ready()
    _check_tgi(body, stream)
    gens = await validated(validate_tgi, validator, body, request_id_of(request))
    return open_streams(runtime, engine, gens, stream)


@router.post(
    "/generate",
    tags=["TGI"],
    summary="Generate text (TGI shape)",
    response_model=TGIGenerateResponse,
    responses=errors(401, *BODY_ERRORS, *GENERATION_ERRORS, 500, client_closed=True),
)
async def generate(request: Request, body: TGIRequest) -> Response:
    if body.stream:
        raise RequestValidationError("stream=true on POST /generate: use POST /generate_stream (or POST /).")
    streams = await _start(request, body, stream=False)
    finals = await wait_all(streams, request)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    for final in finals:
        if isinstance(final, ErrorEvent):
            log.error("request %s failed: %s", request_id_of(request), final.message)
            return JSONResponse(_error_body(final), status_code=final.status_code)
    done = [f for f in finals if isinstance(f, FinishEvent)]
    best = max(range(len(done)), key=lambda i: done[i].cumulative_logprob)
    final = done[best]
    prefix = body.inputs if body.parameters.return_full_text else ""
    out: dict[str, Any] = {"generated_text": prefix + final.text}
    if body.parameters.details:
        out["details"] = _sequence_details(final, body)
        if len(done) > 1:
            out["details"]["best_of_sequences"] = [
                {"generated_text": prefix + f.text, **_sequence_details(f, body)}
                for i, f in enumerate(done)
                if i != best
            ]
    return JSONResponse(out)


@router.post(
    "/generate_stream",
    tags=["TGI"],
    summary="Generate text as server-sent events (TGI shape)",
    response_class=Response,
    responses={
        **streamed("Token events; the last carries generated_text and details.", TGIStreamEvent, ErrorEnvelope),
        **errors(401, *BODY_ERRORS, *GENERATION_ERRORS),
    },
)
async def generate_stream(request: Request, body: TGIRequest) -> Response:
    (stream,) = await _start(request, body, stream=True)
    rid = request_id_of(request)
    full_prefix = body.inputs if body.parameters.return_full_text else ""
    top_n = bool(body.parameters.top_n_tokens)

    async def events() -> AsyncIterator[ServerSentEvent]:
        index = 0
        try:
            async for ev in stream.events():
                if isinstance(ev, TokenEvent):
                    index += 1
                    data: dict[str, Any] = {
                        "index": index,
                        "token": _token(ev),
                        "generated_text": None,
                        "details": None,
                        "top_tokens": [_token(a) for a in ev.top_tokens] if top_n else None,
                    }
                    if ev.final is not None:
                        stream.finished = True
                        data["generated_text"] = full_prefix + ev.final.text
                        data["details"] = {
                            "finish_reason": ev.final.reason,
                            "generated_tokens": ev.final.generated_tokens,
                            "input_length": ev.final.prompt_tokens,
                            "seed": ev.final.seed,
                        }
                        yield json_event(data)
                        return
                    yield json_event(data)
                elif isinstance(ev, ErrorEvent):
                    log.error("request %s failed: %s", rid, ev.message)
                    yield json_event(_error_body(ev))
                    return
        finally:
            stream.close()

    return event_stream(events(), runtime_of(request).settings)


@router.post(
    "/",
    tags=["TGI"],
    summary="TGI compatibility: /generate or /generate_stream by the 'stream' field",
    response_model=list[TGIGenerateResponse],
    responses={
        **streamed("A list of one result, or (stream: true) token events.", TGIStreamEvent, ErrorEnvelope),
        **errors(401, *BODY_ERRORS, *GENERATION_ERRORS, 500, client_closed=True),
    },
)
async def compat_generate(request: Request, body: TGIRequest) -> Response:
    if body.stream:
        return await generate_stream(request, body)
    response = await generate(request, body)
    if response.status_code == 200 and isinstance(response, JSONResponse):
        # TGI's "/" answers a list of one result
        import json

        return JSONResponse([json.loads(bytes(response.body))])
    return response


@router.post(
    "/tokenize",
    tags=["TGI"],
    summary="Tokenize text: each token's id, text and span (TGI's inputs), or vLLM's {tokens, count, max_model_len}",
    response_model=list[TokenSpan] | TokenCount,
    responses=errors(401, *BODY_ERRORS, 503),
)
async def tokenize(request: Request, body: TokenizeRequest) -> Any:
    runtime = runtime_of(request)
    _, validator, _ = runtime.require_ready()
    if tokenize_shape(body) != "inputs":
        return await off_loop(vllm_tokens, validator.tokenizer, body, validator.max_total_tokens)
    add = True if body.add_special_tokens is None else body.add_special_tokens
    return await off_loop(token_spans, validator.tokenizer, body.inputs, add)


@router.post(
    "/detokenize",
    tags=["TGI"],
    summary="Token ids to text (vLLM's shape)",
    response_model=DetokenizeAnswer,
    responses=errors(401, *BODY_ERRORS, 503),
)
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, str]:
    _, validator, _ = runtime_of(request).require_ready()
    return await off_loop(detokenized, validator.tokenizer, validator.vocab_size, body)


def token_spans(tokenizer: Any, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    """TGI's ``/tokenize`` answer: per token its id, its text (the span of the input it covers) and that span."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    out = []
    for token, (start, stop) in zip(enc["input_ids"], enc["offset_mapping"]):
        out.append({"id": int(token), "text": text[start:stop], "start": int(start), "stop": int(stop)})
    return out


@router.get(
    "/health",
    tags=["health"],
    summary="Liveness: the process answers",
    response_model=HealthResponse,
    responses=errors(*BODY_ERRORS),
)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.head(
    "/health",
    tags=["health"],
    summary="Liveness without a body (load balancers' HEAD probes)",
    response_class=Response,
    responses={200: {"description": "The process answers (no body)."}, **errors(*BODY_ERRORS)},
)
async def health_head() -> Response:
    return Response(status_code=200)


@router.get(
    "/health/ready",
    tags=["health"],
    summary="Readiness: 200 once the model is loaded, else 503 + progress",
    response_model=LoadState,
    responses={
        **errors(*BODY_ERRORS),
        503: {
            "description": "Not ready: loading (with progress), failed, draining or engine stopped; retry later.",
            "content": json_content(schema_ref(LoadState)),
            "headers": errors(503)[503]["headers"],
        },
    },
)
async def ready(request: Request) -> Response:
    runtime = runtime_of(request)
    state = runtime.host.state.to_dict()
    retry = {"Retry-After": str(NOT_READY_RETRY_AFTER_S)}
    if runtime.draining:
        state["status"] = "draining"
        return JSONResponse(state, status_code=NotReadyError.status_code, headers=retry)
    if runtime.engine is None or not runtime.host.state.ready:
        return JSONResponse(state, status_code=NotReadyError.status_code, headers=retry)
    if not runtime.engine.alive:
        state["status"] = "engine stopped"
        if runtime.engine.dead:  # why it stopped for good (a GPU error, weights lost on disk)
            state["error"] = runtime.engine.dead
        return JSONResponse(state, status_code=NotReadyError.status_code, headers=retry)
    return JSONResponse(state)


@router.get(
    "/info",
    tags=["info"],
    summary="Model, dtype, plan in force, device map, memory, limits, version",
    response_model=InfoResponse,
    responses=errors(401, *BODY_ERRORS),
)
async def info(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    s = runtime.settings
    loaded = runtime.loaded
    out: dict[str, Any] = {
        "version": VERSION,
        "status": runtime.host.state.to_dict(),
        "limits": {
            "max_concurrent_requests": s.max_concurrent_requests,
            "max_batch_size": s.max_batch_size,
            "max_input_tokens": min(s.max_input_tokens, runtime.max_total_tokens - 1),
            "max_total_tokens": runtime.max_total_tokens,
            "default_max_new_tokens": s.default_max_new_tokens,
            "max_body_bytes": s.max_body_bytes,
        },
        "model_id": None,
        "prefix_cache": s.prefix_cache,
        "cpu_threads": cpu_threads_report(runtime),
        "speculation": {
            "mode": s.speculation_mode,
            "draft_tokens": draft_tokens(s.speculate_tokens, loaded.plan if loaded is not None else None),
        },
    }
    if loaded is None:
        return out
    slots = engine_slots(s, loaded)  # the KV slots of the full context its plan budgets (reason in the plan)
    out["limits"]["max_batch_size"] = slots
    out["limits"]["kv_pool_tokens"] = slots * runtime.max_total_tokens
    out["limits"]["max_running_sequences"] = running_sequences(s, loaded)
    model = loaded.model
    out.update(
        {
            "model_id": loaded.name,
            "model_path": str(loaded.path),
            "architecture": type(model).__name__,
            "dtype": loaded.dtype,
            "quantization": loaded.quantization,
            "device_map": getattr(model, "hf_device_map", None) or (loaded.plan.device_map if loaded.plan else None),
            "plan": loaded.plan.to_dict() if loaded.plan else None,
            "memory": memory_report(loaded.plan, runtime.weight_bytes),
            "load_stats": _plain(getattr(model, "load_stats", None)),
            "cpu_kernels": kernel_report(s.cpu_kernels),
        }
    )
    if runtime.engine is not None:  # the micro-batch schedule over this host's GPUs: on or off, and why
        out["device_pipeline"] = runtime.engine.device_pipeline.to_dict()
        out["speculation"].update(runtime.engine.speculator.report())
        now = current_prediction(loaded.plan, out["speculation"].get("acceptance_rate")) if loaded.plan else None
        if now is not None:  # the plan's, at the acceptance measured so far
            out["speculation"].update(predicted_tokens_per_s=now.tokens_per_s, predicted_at_acceptance=now.acceptance)
    if loaded.draft is not None:  # --speculate int4|int8's copy or --draft-model's: what it holds and costs
        out["speculation"]["draft_model"] = loaded.draft.to_dict()
    if hasattr(model, "pipeline_report"):  # a pipeline's rank 0: every stage's layers, memory and busy fraction
        out["pipeline"] = model.pipeline_report()
    return out


def cpu_threads_report(runtime: Any) -> dict[str, Any]:
    """The thread ceiling and why (affinity mask, cgroup quota, --threads); with the engine running, the count in
    use now, the contention measured and the prefill budget per step."""
    share = runtime.cpu_share
    out: dict[str, Any] = {
        "threads": share.threads,
        "ceiling": share.threads,
        "bound": share.bound,
        "reason": share.reason,
        "affinity": share.affinity,
        "quota": share.quota,
        "quota_source": share.quota_source,
        "adaptive": share.requested is None,
    }
    if runtime.threads is not None:
        out.update(runtime.threads.to_dict(), reason=share.reason)
    if runtime.engine is not None:
        out["prefill_tokens"] = runtime.engine.scheduler.prefill_tokens
    return out


def kernel_report(choice: str) -> dict[str, Any]:
    """The CPU-kernel choice and, per dtype whose native kernel was looked at, whether it is in use and why."""
    from loaders.native import kernel_build

    kernels = {}
    for dtype in kernel_build.KERNELS:
        st = kernel_build.current(dtype)
        kernels[str(dtype).removeprefix("torch.")] = {"available": st.available, "reason": st.reason} if st else None
    return {"choice": choice, "kernels": kernels}


def _plain(value: Any) -> Any:
    """Load stats as JSON: dataclasses and objects become dicts; anything odd becomes its string."""
    import dataclasses

    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return _plain(vars(value))
    return str(value)


@router.get(
    "/metrics",
    tags=["info"],
    summary="Prometheus metrics",
    response_class=PlainTextResponse,
    responses={**plain_content("text/plain", "Prometheus' text exposition format."), **errors(401, *BODY_ERRORS)},
)
async def metrics(request: Request) -> Response:
    runtime = runtime_of(request)
    return Response(runtime.metrics.render(), media_type=METRICS_CONTENT_TYPE)
