"""OpenAI's request bodies (``/v1/completions``, ``/v1/chat/completions``) and their validation into engine requests.

The models take OpenAI's fields (and vLLM's ``top_k`` and ``repetition_penalty``); a field not listed is refused
when set. :func:`validate_completion` and :func:`validate_chat` check what the models cannot (OpenAI's ranges and
defaults, ``n``/``best_of``, ``response_format``'s grammar, the prompts' tokens against the limits) through the
shared :class:`~service.schemas.validation.Validator`; :func:`render_chat` turns messages into the prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from service.engine.requests import GenerationRequest
from service.engine.sampling import SamplingParams
from service.engine.structured_output import GrammarSpec, schema_text
from service.errors import RequestValidationError
from service.log_text import printable
from service.schemas.validation import (
    MAX_CHOICES,
    MAX_SEED,
    MAX_TOP_TOKENS,
    Validator,
    is_set,
    refuse_unknown,
    request_model_config,
)


class _OpenAIRequest(BaseModel):
    """Fields both OpenAI routes take. A field not listed here is refused when set (see :func:`refuse_unknown`)."""

    model_config = request_model_config()

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = Field(None, description="An end-user id; logged with the request id.")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": {...}}}'
    )
    top_k: int | None = Field(None, description="vLLM's extension: sample among the k likeliest tokens.")
    repetition_penalty: float | None = Field(None, description="vLLM's extension (transformers' semantics).")


class CompletionRequest(_OpenAIRequest):
    """OpenAI ``POST /v1/completions``."""

    model_config = request_model_config(
        {"prompt": "Hello", "max_tokens": 3},
        {"prompt": "The cat", "max_tokens": 2, "logprobs": 2, "echo": True},
        {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    )

    prompt: str | list[int] | list[list[int]] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One chat message. Other message fields (``name``, ``tool_calls``...) are refused when set."""

    model_config = request_model_config()

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI ``POST /v1/chat/completions``."""

    model_config = request_model_config(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2, "stream": True},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}},
    )

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def _response_format(v: Validator, fmt: dict[str, Any] | None) -> Any:
    """OpenAI's ``response_format``, compiled; ``None`` for plain text. TGI's chat shape is taken too:
    ``{"type": "json" | "json_object", "value": <schema>}`` (what huggingface_hub sends for a JSON schema) and
    ``{"type": "regex", "value": "..."}``."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind in ("json", "json_object") and fmt.get("value") is not None:
        field = "response_format.value"
        return v.grammars.compile(GrammarSpec("json_schema", schema_text(fmt["value"], field), field))
    if kind == "regex":
        value = fmt.get("value")
        if not isinstance(value, str) or not value:
            raise RequestValidationError("response_format.value must be a non-empty regex string.")
        return v.grammars.compile(GrammarSpec("regex", value, "response_format.value"))
    if kind == "json_object":
        return v.grammars.compile(GrammarSpec("json_object", field="response_format"))
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise RequestValidationError(
                'response_format.json_schema must be {"name": ..., "schema": {<JSON schema>}}; the schema is missing.'
            )
        field = "response_format.json_schema.schema"
        return v.grammars.compile(GrammarSpec("json_schema", schema_text(inner["schema"], field), field))
    raise RequestValidationError(
        f"response_format.type must be 'text', 'json_object', 'json_schema' or 'regex' (got {kind!r})."
    )


def _openai_common(v: Validator, body: CompletionRequest | ChatCompletionRequest) -> int:
    """Checks both OpenAI routes share; returns ``n``."""
    refuse_unknown(body)
    n = v.check_count(body.n, "n", 1, MAX_CHOICES)
    if body.temperature is not None and body.temperature > 2:
        raise RequestValidationError(f"temperature must be in [0, 2] (got {body.temperature}).")
    v.check_sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        repetition_penalty=body.repetition_penalty,
        allow_zero_temperature=True,
    )
    v.check_penalty(body.frequency_penalty, "frequency_penalty")
    v.check_penalty(body.presence_penalty, "presence_penalty")
    if body.seed is not None and body.seed < 0:
        raise RequestValidationError(f"seed must be >= 0 (got {body.seed}).")
    if body.stream_options is not None:
        if not body.stream:
            raise RequestValidationError("stream_options is only allowed with stream=true.")
        unknown = sorted(k for k, value in body.stream_options.items() if k != "include_usage" and is_set(value))
        if unknown:
            raise RequestValidationError(
                f"Unsupported parameter(s): {', '.join(printable('stream_options.' + k)[:200] for k in unknown)}; omit them."
            )
    return n


def _openai_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """OpenAI's defaults: temperature 1 (sampling) when omitted; 0 is greedy."""
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        do_sample=temperature != 0,
        temperature=temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
    )


def completion_prompts(v: Validator, body: CompletionRequest) -> list[list[int]]:
    """``prompt`` as a string, a list of strings, a list of token ids or a list of lists of token ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [v.tokenize(prompt)]
    if not prompt:
        raise RequestValidationError("prompt is an empty list; send a string, strings, or token ids.")
    if all(isinstance(x, int) for x in prompt):
        return [v.token_ids(prompt)]  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in prompt):
        return [v.token_ids(x, f"prompt[{i}]") for i, x in enumerate(prompt)]  # type: ignore[arg-type]
    return [v.tokenize(x) for x in prompt]  # type: ignore[arg-type]


def validate_completion(v: Validator, body: CompletionRequest, request_id: str) -> list[GenerationRequest]:
    """Prompt-major: for each prompt, ``best_of`` (or ``n``) sequences."""
    n = _openai_common(v, body)
    best_of = v.check_count(body.best_of, "best_of", 1, MAX_CHOICES) if body.best_of is not None else n
    if best_of < n:
        raise RequestValidationError(f"best_of ({best_of}) must be >= n ({n}).")
    if best_of > n and body.stream:
        raise RequestValidationError("best_of > n cannot be streamed; set stream=false or best_of=n.")
    top_n = v.check_count(body.logprobs, "logprobs", 0, 5) if body.logprobs is not None else 0
    prompts = completion_prompts(v, body)
    if len(prompts) * best_of > MAX_CHOICES:
        raise RequestValidationError(
            f"{len(prompts)} prompt(s) x {best_of} sequence(s) each exceeds {MAX_CHOICES} sequences per request; "
            "send fewer prompts or a smaller n/best_of."
        )
    grammar = _response_format(v, body.response_format)
    params = _openai_params(body)
    out: list[GenerationRequest] = []
    for ids in prompts:
        request = GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=v.new_tokens(body.max_tokens, len(ids), "max_tokens"),
            params=params,
            stop=v.stops(body.stop),
            request_id=request_id,
            top_n_tokens=top_n,
            prompt_logprobs=body.echo and body.logprobs is not None,
            grammar=grammar,
        )
        out.extend(v.replicas(request, best_of))
    return out


def validate_chat(v: Validator, body: ChatCompletionRequest, request_id: str) -> list[GenerationRequest]:
    """``n`` sequences of the prompt the messages render to (the tokenizer's chat template, :func:`render_chat`)."""
    n = _openai_common(v, body)
    if not body.messages:
        raise RequestValidationError("messages is empty; send at least one message.")
    for i, message in enumerate(body.messages):
        refuse_unknown(message, f"messages[{i}].")
    top_n = v.check_count(body.top_logprobs, "top_logprobs", 0, MAX_TOP_TOKENS)
    if top_n and not body.logprobs:
        raise RequestValidationError("top_logprobs needs logprobs=true.")
    grammar = _response_format(v, body.response_format)
    prompt = render_chat(v.tokenizer, body.messages)
    ids = v.tokenize(prompt, add_special_tokens=False)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=v.new_tokens(requested, len(ids), "max_tokens"),
        params=_openai_params(body),
        stop=v.stops(body.stop),
        request_id=request_id,
        top_n_tokens=top_n,
        grammar=grammar,
    )
    return v.replicas(request, n)


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise RequestValidationError(f"Only text message parts are supported (got {part.get('type')!r}).")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


#: The documented fallback when a tokenizer has no chat template: one line per message, then the assistant cue.
DEFAULT_CHAT_FORMAT = "{role}: {content}\n"


def render_chat(tokenizer: Any, messages: list[ChatMessage]) -> str:
    """The prompt for a chat: the tokenizer's chat template, or ``role: content`` lines then ``assistant:``."""
    plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
    for m in plain:
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestValidationError(f"Unknown message role {m['role']!r}.")
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages is the client's to fix
            raise RequestValidationError(f"The model's chat template rejected the messages: {exc}") from None
    bos = getattr(tokenizer, "bos_token", None) or ""
    return bos + "".join(DEFAULT_CHAT_FORMAT.format(**m) for m in plain) + "assistant:"
