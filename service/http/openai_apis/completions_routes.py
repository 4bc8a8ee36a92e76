"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming or not) and ``/v1/models``.

Responses follow OpenAI's shapes closely enough that the official ``openai`` client works unchanged. Stop
sequences are cut from the text (OpenAI's convention); in streams, text that might begin a stop sequence is held
back until it is known not to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.engine.requests import TokenEvent
from service.http.admission import (
    request_id_of,
    runtime_of,
)
from service.http.openai_apis.v1_common import (
    FINISH,
    V1_ERRORS,
    check_model,
    final_text,
    finals_or_response,
    openai_error,
    start_request,
    stream_response,
    usage_of,
)
from service.schemas.openai_requests import CompletionRequest, validate_completion
from service.schemas.openapi_responses import GENERATION_ERRORS, errors, streamed
from service.schemas.response_models import (
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorEnvelope,
)

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["OpenAI"])


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


@router.get("/models", summary="The served model", response_model=ModelList, responses=errors(*V1_ERRORS, openai=True))
async def models(request: Request) -> dict[str, Any]:
    card = _model_card(request)
    return {"object": "list", "data": [card] if card else []}


@router.get(
    "/models/{model_id:path}",
    summary="One model by id (404 unless it is the served one)",
    response_model=ModelCard,
    responses=errors(*V1_ERRORS, 404, openai=True),
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
        **errors(*V1_ERRORS, *GENERATION_ERRORS, 500, openai=True, client_closed=True),
    },
)
async def completions(request: Request, body: CompletionRequest) -> Response:
    name = check_model(request, body.model)
    streams, validator, _ = await start_request(
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

        return stream_response(request, streams, rid, chunk, [], body.stream_options, want_logprobs or body.echo, n)

    finals, early = await finals_or_response(streams, request, rid)
    if early is not None:
        return early
    choices = []
    for p, prompt_text in enumerate(prompts):
        group = finals[p * per : (p + 1) * per]
        if per > n:
            group = sorted(group, key=lambda f: f.cumulative_logprob, reverse=True)[:n]
        for j, final in enumerate(group):
            text = final_text(final)
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
            "usage": usage_of(finals, per),
        }
    )
