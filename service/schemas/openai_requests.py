"""OpenAI's request bodies (``/v1/completions``, ``/v1/chat/completions``) and their validation into engine requests.

The models take OpenAI's fields (and vLLM's ``top_k`` and ``repetition_penalty``); a field not listed is refused
when set. :func:`validate_completion` and :func:`validate_chat` check what the models cannot (OpenAI's ranges and
defaults, ``n``/``best_of``, ``response_format``'s grammar, the prompts' tokens against the limits) through the
shared :class:`~service.schemas.validation.Validator`; :func:`render_chat` turns messages into the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

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
from service.tools.harmony_format import HARMONY, writes_harmony
from service.tools.reasoning import thinks
from service.tools.tool_requests import ToolPlan, plan_tools


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
    min_p: float | None = Field(
        None, description="vLLM's extension: when sampling, keep tokens >= min_p x the top one."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit; at most 300 entries."
    )
    stop_token_ids: list[int] | None = Field(None, description="vLLM's extension: token ids that end the sequence.")
    skip_special_tokens: bool = Field(True, description="vLLM's extension: leave special tokens out of the text.")
    ignore_eos: bool = Field(False, description="vLLM's extension: generate max_tokens whatever the model ends with.")
    metadata: dict[str, Any] | None = Field(None, description="Refused when set: this server stores no completions.")
    service_tier: str | None = Field(None, description='"auto" or "default" only: one tier is served.')


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
    """One chat message: an assistant's may carry ``tool_calls`` (and ``reasoning_content``), a ``tool`` message
    answers one by ``tool_call_id``. Other message fields are refused when set."""

    model_config = request_model_config()

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


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
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools: [{"type": "function", "function": {"name", "description", "parameters"}}].'
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}.'
    )
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Extra variables for the chat template, e.g. {"enable_thinking": false}.'
    )
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Passed to the chat template (gpt-oss templates read it)."
    )


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
        return v.grammars.request(GrammarSpec("json_schema", schema_text(fmt["value"], field), field))
    if kind == "regex":
        value = fmt.get("value")
        if not isinstance(value, str) or not value:
            raise RequestValidationError("response_format.value must be a non-empty regex string.")
        return v.grammars.request(GrammarSpec("regex", value, "response_format.value"))
    if kind == "json_object":
        return v.grammars.request(GrammarSpec("json_object", field="response_format"))
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise RequestValidationError(
                'response_format.json_schema must be {"name": ..., "schema": {<JSON schema>}}; the schema is missing.'
            )
        field = "response_format.json_schema.schema"
        return v.grammars.request(GrammarSpec("json_schema", schema_text(inner["schema"], field), field))
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
        known = ("include_usage", "continuous_usage_stats")
        unknown = sorted(k for k, value in body.stream_options.items() if k not in known and is_set(value))
        if unknown:
            raise RequestValidationError(
                f"Unsupported parameter(s): {', '.join(printable('stream_options.' + k)[:200] for k in unknown)}; omit them."
            )
    if body.min_p is not None and not 0 <= body.min_p <= 1:
        raise RequestValidationError(f"min_p must be in [0, 1] (got {body.min_p}).")
    if is_set(body.metadata):
        raise RequestValidationError("metadata is stored with stored completions; this server stores none. Omit it.")
    if body.service_tier not in (None, "auto", "default"):
        raise RequestValidationError(f"service_tier {body.service_tier!r}: one tier is served; send 'auto' or omit.")
    return n


#: OpenAI's limits on ``logit_bias``.
MAX_LOGIT_BIAS = 300


def logit_bias(v: Validator, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to a bias in [-100, 100], at most 300."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestValidationError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed.")
    out = []
    for key, value in bias.items():
        if not key.isdigit() or not 0 <= int(key) < v.vocab_size:
            raise RequestValidationError(
                f"logit_bias key {key!r} is not a token id of this model (0..{v.vocab_size - 1})."
            )
        if not -100 <= value <= 100:
            raise RequestValidationError(f"logit_bias[{key}] must be in [-100, 100] (got {value}).")
        out.append((int(key), float(value)))
    return tuple(out)


def _stop_token_ids(v: Validator, ids: list[int] | None) -> frozenset[int]:
    if not ids:
        return frozenset()
    bad = [i for i in ids if not 0 <= i < v.vocab_size]
    if bad:
        raise RequestValidationError(f"stop_token_ids holds {bad[0]}, outside the vocabulary (0..{v.vocab_size - 1}).")
    return frozenset(ids)


def _openai_params(v: Validator, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """OpenAI's defaults: temperature 1 (sampling) when omitted; 0 is greedy."""
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        min_p=body.min_p or None,
        logit_bias=logit_bias(v, body.logit_bias),
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
    params = _openai_params(v, body)
    stop_ids = _stop_token_ids(v, body.stop_token_ids)
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
            ignore_eos=body.ignore_eos,
            stop_token_ids=stop_ids,
            skip_special_tokens=body.skip_special_tokens,
        )
        out.extend(v.replicas(request, best_of))
    return out


@dataclass(frozen=True)
class ChatShape:
    """What reading a chat's output needs beyond its tokens: the tools it may call, whether it thinks, and whether
    it writes harmony channels (gpt-oss: reasoning, content and calls all in one message stream)."""

    tools: ToolPlan | None
    prompt_text: str
    thinks: bool
    harmony: bool = False


#: Template variables a request's ``chat_template_kwargs`` may not set (the server sets them).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation"})


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise RequestValidationError(f"chat_template_kwargs may not set {', '.join(clash)}; the server sets them.")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def prepare_chat(
    v: Validator, body: ChatCompletionRequest, request_id: str, tool_parser: str | None = None
) -> tuple[list[GenerationRequest], ChatShape]:
    """``n`` sequences of the prompt the messages (and tools) render to, and how to read their output."""
    n = _openai_common(v, body)
    if not body.messages:
        raise RequestValidationError("messages is empty; send at least one message.")
    for i, message in enumerate(body.messages):
        refuse_unknown(message, f"messages[{i}].")
    top_n = v.check_count(body.top_logprobs, "top_logprobs", 0, MAX_TOP_TOKENS)
    if top_n and not body.logprobs:
        raise RequestValidationError("top_logprobs needs logprobs=true.")
    template = getattr(v.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, template, tool_parser)
    if tools is not None and tools.grammar is not None and body.response_format not in (None, {"type": "text"}):
        raise RequestValidationError("response_format cannot be combined with a required or named tool_choice.")
    grammar = v.grammars.request(tools.grammar) if tools is not None and tools.grammar else None
    grammar = grammar or _response_format(v, body.response_format)
    prompt = render_chat(v.tokenizer, body.messages, tools.tools if tools else None, _template_kwargs(body))
    ids = v.tokenize(prompt, add_special_tokens=False)
    harmony = tools.fmt is HARMONY if tools is not None else writes_harmony(template)
    markers = harmony or (tools is not None and tools.fmt.name == "mistral")  # special tokens the reader needs
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=v.new_tokens(requested, len(ids), "max_tokens"),
        params=_openai_params(v, body),
        stop=v.stops(body.stop),
        request_id=request_id,
        top_n_tokens=top_n,
        grammar=grammar,
        ignore_eos=body.ignore_eos,
        stop_token_ids=_stop_token_ids(v, body.stop_token_ids),
        skip_special_tokens=body.skip_special_tokens and not markers,
    )
    shape = ChatShape(tools=tools, prompt_text=prompt, thinks=thinks(template) and not harmony, harmony=harmony)
    return v.replicas(request, n), shape


def validate_chat(v: Validator, body: ChatCompletionRequest, request_id: str) -> list[GenerationRequest]:
    """``n`` sequences of the prompt the messages render to (the tokenizer's chat template, :func:`render_chat`)."""
    return prepare_chat(v, body, request_id)[0]


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


def _tool_calls_for_template(calls: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each call's ``arguments`` as an object (what templates expect;
    OpenAI sends them as JSON text)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestValidationError(f'{where}.tool_calls[{j}] must be {{"function": {{"name", "arguments"}}}}.')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                raise RequestValidationError(f"{where}.tool_calls[{j}].function.arguments is not JSON.") from None
        out.append({**call, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    plain: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestValidationError(f"Unknown message role {m.role!r}.")
        entry: dict[str, Any] = {"role": m.role, "content": _content_text(m.content)}
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestValidationError(f"messages[{i}].tool_calls: only assistant messages carry tool calls.")
            entry["tool_calls"] = _tool_calls_for_template(m.tool_calls, f"messages[{i}]")
        if m.role == "tool":
            if not m.tool_call_id:
                raise RequestValidationError(f"messages[{i}]: a tool message needs the tool_call_id it answers.")
            entry["tool_call_id"] = m.tool_call_id
        if m.name:
            entry["name"] = m.name
        if m.reasoning_content:
            entry["reasoning_content"] = m.reasoning_content
        plain.append(entry)
    return plain


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt for a chat: the tokenizer's chat template (given ``tools`` and ``template_kwargs``), or
    ``role: content`` lines then ``assistant:``."""
    plain = _template_messages(messages)
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        try:
            return tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=True, **extra, **(template_kwargs or {})
            )
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages is the client's to fix
            raise RequestValidationError(f"The model's chat template rejected the messages: {exc}") from None
    if tools or any("tool_calls" in m for m in plain):
        raise RequestValidationError("tools: this model has no chat template, so it cannot be shown tools.")
    bos = getattr(tokenizer, "bos_token", None) or ""
    return bos + "".join(DEFAULT_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in plain) + "assistant:"
