"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming or not) and ``/v1/models``.

Responses follow OpenAI's shapes closely enough that the official ``openai`` client works unchanged. Stop
sequences are cut from the text (OpenAI's convention); in streams, text that might begin a stop sequence is held
back until it is known not to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from service.engine.requests import ErrorEvent, FinishEvent, TokenEvent
from service.engine.stop_matcher import StopHoldback
from service.errors import NotFoundError, openai_status
from service.http import access_log
from service.http.admission import (
    EngineStream,
    merged_events,
    open_streams,
    request_id_of,
    runtime_of,
    validated,
    wait_all,
)
from service.http.event_stream import event_stream, json_event, text_event
from service.schemas.openai_requests import CompletionRequest, validate_completion
from service.schemas.openapi_responses import BODY_ERRORS, GENERATION_ERRORS, errors, streamed
from service.schemas.response_models import (
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorEnvelope,
    openai_error_body,
)

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["OpenAI"])

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def openai_error(message: str, error_type: str, code: str | None = None, status: int | None = None) -> dict[str, Any]:
    return openai_error_body(message, error_type, code, status)


def _openai_error_of(message: str, error_type: str, status: int) -> dict[str, Any]:
    return openai_error(message, error_type, status=status)


def _final_text(final: FinishEvent) -> str:
    return final.text[: final.stop_at] if final.stop_at is not None else final.text


def _usage(finals: list[FinishEvent], per_prompt: int) -> dict[str, int]:
    """Token counts: each prompt once (its ``n`` sequences share it), every generated token (best_of's too)."""
    prompt = sum(f.prompt_tokens for f in finals[::per_prompt])
    generated = sum(f.generated_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def cumulative_logprob(final: FinishEvent) -> float:
    return sum(t.logprob for t in final.tokens)


#: The names TGI's clients send for "the one model this endpoint serves".
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})


def _check_model(request: Request, name: str | None) -> str:
    """The served model's name. A request naming another model is a 404 ``model_not_found`` (as in vLLM), unless
    it names one of ``--served-model-name``'s aliases or the model's path, or ``--accept-any-model`` is set. No
    ``model`` at all is the served one, and so are TGI's placeholders (:data:`PLACEHOLDER_MODELS`: huggingface_hub
    sends ``"dummy"`` or ``"tgi"`` to a TGI endpoint, which serves one model whatever is named)."""
    runtime = runtime_of(request)
    loaded = runtime.loaded
    served = loaded.name if loaded else ""
    if not name or name in PLACEHOLDER_MODELS or loaded is None or runtime.settings.accept_any_model:
        return served
    if name not in (served, str(loaded.path), *runtime.settings.served_names()):
        raise NotFoundError(
            f"The model {name!r} does not exist on this server; it serves {served!r} (see GET /v1/models), or "
            "start it with --accept-any-model.",
            code="model_not_found",
        )
    return served


async def _start(request: Request, build, user: str | None, stream: bool) -> tuple[list[EngineStream], Any, Any]:
    """Validate, take a slot per sequence, submit; also returns the validator (for decoding prompts) and what
    ``build`` returned beside the requests (when it returns a pair)."""
    runtime = runtime_of(request)
    engine, validator, _ = runtime.require_ready()
    built = await validated(build, validator, request_id_of(request))
    gens, extra = built if isinstance(built, tuple) else (built, None)
    if user:
        log.info("request %s: user %r", request_id_of(request), user)
        record = access_log.current()
        if record is not None:
            record.user = user
    return open_streams(runtime, engine, gens, stream), validator, extra


async def _finals_or_response(
    streams: list[EngineStream],
    request: Request,
    rid: str,
    error_body: Callable[[str, str, int], dict[str, Any]] | None = None,
) -> tuple[list[FinishEvent], Response | None]:
    """Wait for every sequence of a non-streamed request. When there is nothing to build an answer on (the client
    left, or a sequence failed), the second item is the response to send instead: its body is ``error_body``'s
    (message, error type, status), OpenAI's envelope unless the route has its own."""
    finals = await wait_all(streams, request)
    if finals is None:
        return [], Response(status_code=499)
    for final in finals:
        if isinstance(final, ErrorEvent):
            log.error("request %s failed: %s", rid, final.message)
            status = openai_status(final.status_code, final.error_type)
            body = (error_body or _openai_error_of)(final.message, final.error_type, status)
            return [], JSONResponse(body, status_code=status)
    return [f for f in finals if isinstance(f, FinishEvent)], None


def _running_usage(streams: list[EngineStream], counts: list[int], per_prompt: int) -> dict[str, int]:
    """vLLM's ``continuous_usage_stats``: the request's token counts so far, on every chunk."""
    prompt = sum(len(s.request.prompt_ids) for s in streams[::per_prompt])
    generated = sum(counts)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _stream_response(
    request: Request,
    streams: list[EngineStream],
    rid: str,
    make_chunk: Callable[[int, str, str | None, TokenEvent | None], dict[str, Any] | None],
    first_chunks: list[dict[str, Any]],
    stream_options: dict[str, Any] | None,
    every_token: bool,
    per_prompt: int,
) -> EventSourceResponse:
    """Server-sent chunks for one or more sequences (choice ``i`` is stream ``i``). With ``every_token`` (logprobs
    asked for) each token gets a chunk even while its text is held back; ``make_chunk`` may return ``None`` for a
    token that adds nothing to send yet. ``stream_options``: ``include_usage`` adds a last chunk with the usage,
    ``continuous_usage_stats`` (vLLM's) a ``usage`` on every chunk."""
    include_usage = bool((stream_options or {}).get("include_usage"))
    continuous = bool((stream_options or {}).get("continuous_usage_stats"))

    async def events() -> AsyncIterator[ServerSentEvent]:
        holds = [StopHoldback(s.request.stop) for s in streams]
        counts = [0] * len(streams)
        finals: dict[int, FinishEvent] = {}

        def send(chunk: dict[str, Any]) -> ServerSentEvent:
            if continuous:
                chunk["usage"] = _running_usage(streams, counts, per_prompt)
            return json_event(chunk)

        try:
            for first in first_chunks:
                yield send(first)
            async for i, ev in merged_events(streams):
                if isinstance(ev, ErrorEvent):
                    log.error("request %s failed mid-stream: %s", rid, ev.message)
                    yield json_event(openai_error(ev.message, ev.error_type))
                    return
                if not isinstance(ev, TokenEvent):
                    continue
                counts[i] += 1
                if ev.final is None:
                    piece = holds[i].push(ev.text)
                    chunk = make_chunk(i, piece, None, ev) if piece or every_token else None
                else:
                    finals[i] = ev.final
                    rest = holds[i].finish(_final_text(ev.final))
                    chunk = make_chunk(i, rest, FINISH[ev.final.reason], ev)
                if chunk is not None:
                    yield send(chunk)
            if include_usage:
                last = make_chunk(0, "", None, None) or {}
                last["choices"] = []
                last["usage"] = _usage([finals[i] for i in sorted(finals)], per_prompt)
                yield json_event(last)
            yield text_event("[DONE]")
        finally:
            for stream in streams:
                stream.close()

    return event_stream(events(), runtime_of(request).settings)


def _model_card(request: Request) -> dict[str, Any] | None:
    runtime = runtime_of(request)
    loaded = runtime.loaded
    if loaded is None:
        return None
    return {
        "id": loaded.name,
        "object": "model",
        "created": int(runtime.host.state.ready_at or time.time()),
        "owned_by": "loadmaster",
    }


#: The statuses every ``/v1`` route may answer (the middleware's, in OpenAI's envelope: validation is 400 here).
_V1_ERRORS = (400, 401, *(s for s in BODY_ERRORS if s != 422))


@router.get("/models", summary="The served model", response_model=ModelList, responses=errors(*_V1_ERRORS, openai=True))
async def models(request: Request) -> dict[str, Any]:
    card = _model_card(request)
    return {"object": "list", "data": [card] if card else []}


@router.get(
    "/models/{model_id:path}",
    summary="One model by id (404 unless it is the served one)",
    response_model=ModelCard,
    responses=errors(*_V1_ERRORS, 404, openai=True),
)
async def model(request: Request, model_id: str) -> Response:
    card = _model_card(request)
    if card is None or model_id != card["id"]:
        served = card["id"] if card else "none (still loading)"
        message = f"The model {model_id!r} does not exist on this server; it serves {served!r} (see GET /v1/models)."
        return JSONResponse(openai_error(message, "not_found", "model_not_found", 404), status_code=404)
    return JSONResponse(card)


def _top_with_sampled(t: Any) -> dict[str, float] | None:
    """A position's alternatives with the token itself among them (vLLM's k+1: the sampled token is always
    there, so ``logprobs: 0`` gives ``{token: logprob}``)."""
    if t.logprob is None:
        return None
    top = {a.text: a.logprob for a in t.top_tokens}
    top.setdefault(t.text, t.logprob)
    return top


def _completion_logprobs(tokens: list[Any], top: bool, start: int = 0) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object for completions: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (token text -> logprob, per position) and ``text_offset`` (from ``start``: where the first token's text
    begins in the choice's whole text). ``tokens`` are prompt then generated tokens."""
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [_top_with_sampled(t) for t in tokens] if top else None,
        "text_offset": offsets,
    }


def _echoed(prefill: list[Any]) -> list[Any]:
    """Echoed prompt tokens: special ones (a BOS) add no text, so the tokens spell the echoed text."""
    return [replace(t, text="") if t.special else t for t in prefill]


def _prompt_texts(body: CompletionRequest, validator: Any, gens_prompts: list[list[int]]) -> list[str]:
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and all(isinstance(x, str) for x in body.prompt):
        return list(body.prompt)  # type: ignore[arg-type]
    return [validator.tokenizer.decode(ids, skip_special_tokens=True) for ids in gens_prompts]


@router.post(
    "/completions",
    summary="Text completion (OpenAI shape)",
    response_model=CompletionResponse,
    responses={
        **streamed(
            "The completion, or (stream: true) chunks.", CompletionChunk, OpenAIErrorEnvelope, done_sentinel=True
        ),
        **errors(*_V1_ERRORS, *GENERATION_ERRORS, 500, openai=True, client_closed=True),
    },
)
async def completions(request: Request, body: CompletionRequest) -> Response:
    name = _check_model(request, body.model)
    streams, validator, _ = await _start(
        request, lambda v, rid: validate_completion(v, body, rid), body.user, bool(body.stream)
    )
    rid = request_id_of(request)
    cid, created = f"cmpl-{rid}", int(time.time())
    n = body.n
    per = body.best_of or n
    want_logprobs = body.logprobs is not None
    top = body.logprobs is not None
    prompts = _prompt_texts(body, validator, [s.request.prompt_ids for s in streams[::per]])

    if body.stream:
        offsets = [0] * len(streams)  # characters of each choice's text so far (text_offset is cumulative)
        echoed = [not body.echo] * len(streams)

        def chunk(i: int, text: str, finish: str | None, ev: TokenEvent | None) -> dict[str, Any]:
            tokens = [ev] if ev is not None else []
            if not echoed[i] and ev is not None:  # echo: the prompt first, as vLLM does
                echoed[i] = True
                text = prompts[i // n] + text
                tokens = _echoed(ev.prefill or []) + tokens
            lp = _completion_logprobs(tokens, top, offsets[i]) if want_logprobs and ev is not None else None
            offsets[i] += sum(len(t.text) for t in tokens)
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}],
            }

        return _stream_response(request, streams, rid, chunk, [], body.stream_options, want_logprobs or body.echo, n)

    finals, early = await _finals_or_response(streams, request, rid)
    if early is not None:
        return early
    choices = []
    for p, prompt_text in enumerate(prompts):
        group = finals[p * per : (p + 1) * per]
        if per > n:
            group = sorted(group, key=cumulative_logprob, reverse=True)[:n]
        for j, final in enumerate(group):
            text = _final_text(final)
            logprobs = None
            if want_logprobs:
                prompt = _echoed(final.prefill) if body.echo else []
                logprobs = _completion_logprobs(prompt + list(final.tokens), top)
            if body.echo:
                text = prompt_text + text
            choices.append(
                {"index": p * n + j, "text": text, "logprobs": logprobs, "finish_reason": FINISH[final.reason]}
            )
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": _usage(finals, per),
        }
    )
