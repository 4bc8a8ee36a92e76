"""Request bodies and their validation, before anything is queued or any stream starts.

The pydantic models give the OpenAPI schema and reject wrong types; :class:`Validator` then checks what needs
the tokenizer and the server's limits (token counts, ``max_new_tokens``), and builds the engine's
:class:`~service.engine.engine.GenerationRequest`. Every failure is a :class:`~service.errors.RequestValidationError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.engine.engine import GenerationRequest
from service.engine.sampling import SamplingParams
from service.engine.structured_output import GrammarCompiler, GrammarSpec, schema_text
from service.errors import RequestValidationError
from service.log_text import printable

MAX_STOP_SEQUENCES = 8
#: Most alternatives per token (TGI ``top_n_tokens``, OpenAI ``top_logprobs``; OpenAI's own limit is 20).
MAX_TOP_TOKENS = 20
#: Most sequences one request may ask for (``n``, ``best_of``, or prompts x n for a list of prompts).
MAX_CHOICES = 16
#: Seeds are unsigned 64-bit, as in TGI; larger ones cannot seed a torch generator.
MAX_SEED = 2**64 - 1
#: Smallest usable temperature and repetition penalty: logits are divided by them, and a denormal divisor turns
#: them into infinities (NaN probabilities). 0 (greedy) stays allowed where the API allows it.
MIN_DIVISOR = 1e-4
#: Largest top_k taken (no vocabulary comes near; a bigger number is a mistake, not a wish).
MAX_TOP_K = 1 << 24


#: What /openapi.json says of a key a request model does not declare: it is taken only when it asks for nothing
#: (null, false, "", [], {}: what :func:`refuse_unknown` lets through, as clients send unset fields that way);
#: any other value is refused with a 422 naming it.
UNSET_VALUE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"const": ""},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
    ]
}


def request_model_config(*examples: dict[str, Any]) -> ConfigDict:
    """How every request body is read. ``strict``: a value must have the JSON type the schema documents (``true``
    is not the integer 1, ``"5"`` is not 5), so that what /openapi.json calls invalid is refused, never coerced.
    ``extra="allow"``: unknown keys reach :func:`refuse_unknown`, which names them in its 422. ``examples`` go in
    the document (the docs page shows them; schemathesis sends them first)."""
    extra: dict[str, Any] = {"additionalProperties": UNSET_VALUE_SCHEMA}
    if examples:
        extra["examples"] = list(examples)
    return ConfigDict(extra="allow", allow_inf_nan=False, strict=True, json_schema_extra=extra)


def _is_set(value: Any) -> bool:
    """Whether a client asked for something: anything but ``None``, ``False`` and empty containers/strings."""
    return value is not None and value is not False and value != [] and value != {} and value != ""


def refuse_unknown(body: BaseModel, where: str = "") -> None:
    """A 422 naming each field this server does not know that the request sets (never accepted and ignored)."""
    extra = {k: v for k, v in (body.model_extra or {}).items() if _is_set(v)}
    if extra:
        names = ", ".join(printable(f"{where}{k}")[:200] for k in sorted(extra))
        raise RequestValidationError(f"Unsupported parameter(s): {names}. This server does not implement them; omit.")


class TGIParameters(BaseModel):
    """TGI's ``parameters``. Keys this server does not implement (``watermark``, ``adapter_id``, unknown keys)
    are refused when set."""

    model_config = request_model_config()

    max_new_tokens: int | None = Field(None, description="Tokens to generate (default: the server's).")
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool = False
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] | None = Field(default_factory=list, description="Stop sequences (null: none).")
    return_full_text: bool | None = False
    details: bool = False
    decoder_input_details: bool = False
    best_of: int | None = None
    watermark: bool | None = False
    grammar: Any = None
    top_n_tokens: int | None = None
    truncate: int | None = None
    frequency_penalty: float | None = None
    adapter_id: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return [] if v is None else v


class TGIRequest(BaseModel):
    """``POST /generate`` and ``/generate_stream``: ``{"inputs": "...", "parameters": {...}}``."""

    model_config = request_model_config(
        {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
        {
            "inputs": "The cat",
            "parameters": {"max_new_tokens": 2, "details": True, "decoder_input_details": True, "top_n_tokens": 2},
        },
        {
            "inputs": "Once",
            "parameters": {"max_new_tokens": 2, "do_sample": True, "seed": 1, "best_of": 2, "details": True},
        },
        {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 2, "top_n_tokens": 1}},
    )

    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: the text, and whether to add the tokenizer's special tokens (as generation does)."""

    model_config = request_model_config({"inputs": "Hello world"})

    inputs: str
    add_special_tokens: bool = True


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


def token_chars_bound(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer`` can stand for (its longest vocabulary or added entry), or
    ``None`` when the vocabulary cannot be read."""
    try:
        pieces = list(tokenizer.get_vocab()) + [str(t) for t in getattr(tokenizer, "all_special_tokens", ())]
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: always tokenize
        return None
    return max((len(p) for p in pieces), default=0) or None


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class Validator:
    """Checks requests against the tokenizer and the limits; builds engine requests (one per sequence asked for)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_input_tokens: int,
        max_total_tokens: int,
        default_max_new_tokens: int,
        vocab_size: int | None = None,
        stop_ids: Iterable[int] = (),
        grammar_timeout: float = 10.0,
    ):
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.default_max_new_tokens = default_max_new_tokens
        self.vocab_size = int(vocab_size or len(tokenizer))
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, stop_ids, timeout=grammar_timeout)

    # -- shared checks -------------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
        """``text``'s token ids, within ``max_input_tokens``. ``truncate`` (TGI's): keep the last ``truncate`` tokens
        first, then check the limit, so a long input with a small ``truncate`` is served (the body size bounds the
        tokenizing)."""
        if not text:
            raise RequestValidationError("The input is empty; send at least one character of prompt.")
        if truncate is None:
            self.refuse_surely_too_long(text)
        elif not 1 <= truncate <= self.max_input_tokens:
            raise RequestValidationError(
                f"truncate must be strictly positive and at most {self.max_input_tokens} (max_input_tokens); "
                f"got {truncate}."
            )
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise RequestValidationError("The input encodes to no tokens; send a non-empty prompt.")
        if truncate is not None:
            ids = ids[-truncate:]
        return self._fits(list(ids))

    def token_ids(self, ids: list[int], name: str = "prompt") -> list[int]:
        """A prompt given as token ids: non-empty, every id in the vocabulary, within the input limit."""
        if not ids:
            raise RequestValidationError(f"{name} is an empty list of token ids; send at least one token.")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestValidationError(
                f"{name} holds token id {bad[0]}, outside this model's vocabulary (0..{self.vocab_size - 1})."
            )
        return self._fits(list(ids))

    def _fits(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_input_tokens:
            raise RequestValidationError(
                f"The input is {len(ids)} tokens long; this server accepts at most {self.max_input_tokens} "
                "(max_input_tokens). Shorten the prompt."
            )
        return ids

    def refuse_surely_too_long(self, text: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit in ``max_input_tokens`` whatever its tokens: no
        token covers more characters than the longest vocabulary entry, so a text longer than twice that many
        characters per allowed token cannot fit. Tokenizing a megabyte takes seconds; this takes nothing."""
        if not hasattr(self, "_token_chars"):
            self._token_chars = token_chars_bound(self.tokenizer)
        bound = self._token_chars
        if bound is not None and len(text) > 2 * bound * self.max_input_tokens:
            raise RequestValidationError(
                f"The input is {len(text)} characters long, more than {self.max_input_tokens} tokens "
                f"(max_input_tokens) can hold with this tokenizer. Shorten the prompt."
            )

    def new_tokens(self, requested: int | None, prompt_len: int, name: str) -> int:
        room = self.max_total_tokens - prompt_len
        if requested is None:
            return max(1, min(self.default_max_new_tokens, room))
        if requested < 1:
            raise RequestValidationError(f"{name} must be at least 1 (got {requested}).")
        if requested > room:
            raise RequestValidationError(
                f"{name}={requested} plus the {prompt_len} input tokens exceeds max_total_tokens="
                f"{self.max_total_tokens}; ask for at most {room} new tokens."
            )
        return requested

    @staticmethod
    def stops(stop: str | list[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else list(stop)
        if len(items) > MAX_STOP_SEQUENCES:
            raise RequestValidationError(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed (got {len(items)}).")
        if any(not s for s in items):
            raise RequestValidationError("stop sequences must be non-empty strings.")
        return tuple(items)

    @staticmethod
    def check_sampling(
        *,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None = None,
        typical_p: float | None = None,
        repetition_penalty: float | None = None,
        allow_zero_temperature: bool = False,
    ) -> None:
        if temperature is not None:
            if temperature < 0 or (temperature == 0 and not allow_zero_temperature):
                raise RequestValidationError(
                    f"temperature must be {'>= 0' if allow_zero_temperature else '> 0'} (got {temperature})."
                )
            if 0 < temperature < MIN_DIVISOR:
                zero = " or 0 for greedy decoding" if allow_zero_temperature else ""
                raise RequestValidationError(
                    f"temperature must be at least {MIN_DIVISOR}{zero} (got {temperature}): smaller values overflow."
                )
        if top_p is not None and not 0 < top_p <= 1:
            raise RequestValidationError(f"top_p must be in (0, 1] (got {top_p}).")
        if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
            raise RequestValidationError(f"top_k must be an integer in [1, {MAX_TOP_K}] (got {top_k}).")
        if typical_p is not None and not 0 < typical_p <= 1:
            raise RequestValidationError(f"typical_p must be in (0, 1] (got {typical_p}).")
        if repetition_penalty is not None and repetition_penalty < MIN_DIVISOR:
            raise RequestValidationError(
                f"repetition_penalty must be at least {MIN_DIVISOR} (got {repetition_penalty}): 1 means no penalty."
            )

    @staticmethod
    def check_penalty(value: float | None, name: str) -> None:
        if value is not None and not -2.0 <= value <= 2.0:
            raise RequestValidationError(f"{name} must be in [-2, 2] (got {value}).")

    @staticmethod
    def check_count(value: int | None, name: str, low: int, high: int) -> int:
        if value is None:
            return low
        if not low <= value <= high:
            raise RequestValidationError(f"{name} must be in [{low}, {high}] (got {value}).")
        return value

    @staticmethod
    def replicas(request: GenerationRequest, count: int) -> list[GenerationRequest]:
        """``count`` sequences of one prompt. A seeded request's i-th copy uses seed + i, so copies differ and each
        is reproducible."""
        seed = request.params.seed
        if count == 1:
            return [request]
        out = []
        for i in range(count):
            params = request.params if seed is None else replace(request.params, seed=(seed + i) % 2**64)
            out.append(replace(request, params=params))
        return out

    # -- per API -------------------------------------------------------------------------------------------------
    def tgi(self, body: TGIRequest, request_id: str) -> list[GenerationRequest]:
        """One request per sequence: ``best_of`` of them (1 unless asked)."""
        p = body.parameters
        refuse_unknown(body)
        refuse_unknown(p, "parameters.")
        if p.watermark:
            raise RequestValidationError("parameters.watermark is not supported by this server; omit it.")
        if p.adapter_id:
            raise RequestValidationError(
                "parameters.adapter_id is not supported: this server has no adapters; omit it."
            )
        self.check_sampling(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            typical_p=p.typical_p,
            repetition_penalty=p.repetition_penalty,
        )
        self.check_penalty(p.frequency_penalty, "frequency_penalty")
        if p.seed is not None and p.seed < 0:
            raise RequestValidationError(f"seed must be >= 0 (got {p.seed}).")
        top_n = self.check_count(p.top_n_tokens, "top_n_tokens", 0, MAX_TOP_TOKENS)
        best_of = self.check_count(p.best_of, "best_of", 1, MAX_CHOICES)
        params = SamplingParams(
            do_sample=p.do_sample,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            typical_p=p.typical_p,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed,
        )
        if best_of > 1 and not params.sampling:
            raise RequestValidationError(
                "best_of > 1 needs sampling: set do_sample=true (or a temperature, top_k, top_p or typical_p)."
            )
        ids = self.tokenize(body.inputs, truncate=p.truncate)
        request = GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=self.new_tokens(p.max_new_tokens, len(ids), "max_new_tokens"),
            params=params,
            stop=self.stops(p.stop),
            request_id=request_id,
            top_n_tokens=top_n,
            prompt_logprobs=p.decoder_input_details,
            grammar=self._tgi_grammar(p.grammar),
        )
        return self.replicas(request, best_of)

    def _tgi_grammar(self, grammar: Any) -> Any:
        """TGI's ``{"type": "json" | "regex", "value": ...}``, compiled; ``None`` when not asked for."""
        if grammar is None:
            return None
        if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
            raise RequestValidationError(
                'parameters.grammar must be {"type": "json", "value": <JSON schema>} or {"type": "regex", "value": "..."}.'
            )
        kind, value = grammar["type"], grammar["value"]
        if kind in ("json", "json_object"):
            spec = GrammarSpec(
                "json_schema", schema_text(value, "parameters.grammar.value"), "parameters.grammar.value"
            )
        elif kind == "regex":
            if not isinstance(value, str) or not value:
                raise RequestValidationError("parameters.grammar.value must be a non-empty regex string.")
            spec = GrammarSpec("regex", value, "parameters.grammar.value")
        else:
            raise RequestValidationError(f"parameters.grammar.type must be 'json' or 'regex' (got {kind!r}).")
        return self.grammars.compile(spec)

    def _response_format(self, fmt: dict[str, Any] | None) -> Any:
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
            return self.grammars.compile(GrammarSpec("json_schema", schema_text(fmt["value"], field), field))
        if kind == "regex":
            value = fmt.get("value")
            if not isinstance(value, str) or not value:
                raise RequestValidationError("response_format.value must be a non-empty regex string.")
            return self.grammars.compile(GrammarSpec("regex", value, "response_format.value"))
        if kind == "json_object":
            return self.grammars.compile(GrammarSpec("json_object", field="response_format"))
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise RequestValidationError(
                    'response_format.json_schema must be {"name": ..., "schema": {<JSON schema>}}; the schema is missing.'
                )
            field = "response_format.json_schema.schema"
            return self.grammars.compile(GrammarSpec("json_schema", schema_text(inner["schema"], field), field))
        raise RequestValidationError(
            f"response_format.type must be 'text', 'json_object', 'json_schema' or 'regex' (got {kind!r})."
        )

    def _openai_common(self, body: CompletionRequest | ChatCompletionRequest) -> int:
        """Checks both OpenAI routes share; returns ``n``."""
        refuse_unknown(body)
        n = self.check_count(body.n, "n", 1, MAX_CHOICES)
        if body.temperature is not None and body.temperature > 2:
            raise RequestValidationError(f"temperature must be in [0, 2] (got {body.temperature}).")
        self.check_sampling(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            repetition_penalty=body.repetition_penalty,
            allow_zero_temperature=True,
        )
        self.check_penalty(body.frequency_penalty, "frequency_penalty")
        self.check_penalty(body.presence_penalty, "presence_penalty")
        if body.seed is not None and body.seed < 0:
            raise RequestValidationError(f"seed must be >= 0 (got {body.seed}).")
        if body.stream_options is not None:
            if not body.stream:
                raise RequestValidationError("stream_options is only allowed with stream=true.")
            unknown = sorted(k for k, v in body.stream_options.items() if k != "include_usage" and _is_set(v))
            if unknown:
                raise RequestValidationError(
                    f"Unsupported parameter(s): {', '.join(printable('stream_options.' + k)[:200] for k in unknown)}; omit them."
                )
        return n

    @staticmethod
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

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """``prompt`` as a string, a list of strings, a list of token ids or a list of lists of token ids."""
        prompt = body.prompt
        if isinstance(prompt, str):
            return [self.tokenize(prompt)]
        if not prompt:
            raise RequestValidationError("prompt is an empty list; send a string, strings, or token ids.")
        if all(isinstance(x, int) for x in prompt):
            return [self.token_ids(prompt)]  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in prompt):
            return [self.token_ids(x, f"prompt[{i}]") for i, x in enumerate(prompt)]  # type: ignore[arg-type]
        return [self.tokenize(x) for x in prompt]  # type: ignore[arg-type]

    def completion(self, body: CompletionRequest, request_id: str) -> list[GenerationRequest]:
        """Prompt-major: for each prompt, ``best_of`` (or ``n``) sequences."""
        n = self._openai_common(body)
        best_of = self.check_count(body.best_of, "best_of", 1, MAX_CHOICES) if body.best_of is not None else n
        if best_of < n:
            raise RequestValidationError(f"best_of ({best_of}) must be >= n ({n}).")
        if best_of > n and body.stream:
            raise RequestValidationError("best_of > n cannot be streamed; set stream=false or best_of=n.")
        top_n = self.check_count(body.logprobs, "logprobs", 0, 5) if body.logprobs is not None else 0
        prompts = self.completion_prompts(body)
        if len(prompts) * best_of > MAX_CHOICES:
            raise RequestValidationError(
                f"{len(prompts)} prompt(s) x {best_of} sequence(s) each exceeds {MAX_CHOICES} sequences per request; "
                "send fewer prompts or a smaller n/best_of."
            )
        grammar = self._response_format(body.response_format)
        params = self._openai_params(body)
        out: list[GenerationRequest] = []
        for ids in prompts:
            request = GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=self.new_tokens(body.max_tokens, len(ids), "max_tokens"),
                params=params,
                stop=self.stops(body.stop),
                request_id=request_id,
                top_n_tokens=top_n,
                prompt_logprobs=body.echo and body.logprobs is not None,
                grammar=grammar,
            )
            out.extend(self.replicas(request, best_of))
        return out

    def chat(self, body: ChatCompletionRequest, request_id: str) -> list[GenerationRequest]:
        n = self._openai_common(body)
        if not body.messages:
            raise RequestValidationError("messages is empty; send at least one message.")
        for i, message in enumerate(body.messages):
            refuse_unknown(message, f"messages[{i}].")
        top_n = self.check_count(body.top_logprobs, "top_logprobs", 0, MAX_TOP_TOKENS)
        if top_n and not body.logprobs:
            raise RequestValidationError("top_logprobs needs logprobs=true.")
        grammar = self._response_format(body.response_format)
        prompt = render_chat(self.tokenizer, body.messages)
        ids = self.tokenize(prompt, add_special_tokens=False)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=self.new_tokens(requested, len(ids), "max_tokens"),
            params=self._openai_params(body),
            stop=self.stops(body.stop),
            request_id=request_id,
            top_n_tokens=top_n,
            grammar=grammar,
        )
        return self.replicas(request, n)


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
