"""Request bodies and their validation, before anything is queued or any stream starts.

The pydantic models give the OpenAPI schema and reject wrong types; :class:`Validator` then checks what needs
the tokenizer and the server's limits (token counts, ``max_new_tokens``), and builds the engine's
:class:`~service.engine.GenerationRequest`. Every failure is a :class:`~service.errors.RequestValidationError`.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.engine import GenerationRequest
from service.errors import RequestValidationError
from service.sampling import SamplingParams

MAX_STOP_SEQUENCES = 8


class TGIParameters(BaseModel):
    """TGI's ``parameters``. Unknown keys are ignored; TGI features we do not implement are refused when set."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = Field(None, description="Tokens to generate (default: the server's).")
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool = False
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
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

    model_config = ConfigDict(extra="ignore")

    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class _OpenAIRequest(BaseModel):
    """Fields both OpenAI routes take (the ones we honour; others are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None


class CompletionRequest(_OpenAIRequest):
    """OpenAI ``POST /v1/completions`` (the fields we honour; others are accepted and ignored)."""

    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class Validator:
    """Checks requests against the tokenizer and the limits; builds engine requests."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_input_tokens: int,
        max_total_tokens: int,
        default_max_new_tokens: int,
    ):
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.default_max_new_tokens = default_max_new_tokens

    # -- shared checks -------------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise RequestValidationError("The input is empty; send at least one character of prompt.")
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise RequestValidationError("The input encodes to no tokens; send a non-empty prompt.")
        if len(ids) > self.max_input_tokens:
            raise RequestValidationError(
                f"The input is {len(ids)} tokens long; this server accepts at most {self.max_input_tokens} "
                "(max_input_tokens). Shorten the prompt."
            )
        return list(ids)

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
        if top_p is not None and not 0 < top_p <= 1:
            raise RequestValidationError(f"top_p must be in (0, 1] (got {top_p}).")
        if top_k is not None and top_k < 1:
            raise RequestValidationError(f"top_k must be a positive integer (got {top_k}).")
        if typical_p is not None and not 0 < typical_p <= 1:
            raise RequestValidationError(f"typical_p must be in (0, 1] (got {typical_p}).")
        if repetition_penalty is not None and repetition_penalty <= 0:
            raise RequestValidationError(f"repetition_penalty must be > 0 (got {repetition_penalty}).")

    # -- per API -------------------------------------------------------------------------------------------------
    def tgi(self, body: TGIRequest, request_id: str) -> GenerationRequest:
        p = body.parameters
        if p.best_of not in (None, 1):
            raise RequestValidationError("best_of > 1 is not supported by this server; omit it.")
        if p.grammar is not None:
            raise RequestValidationError("grammar-constrained generation is not supported by this server; omit it.")
        if p.watermark:
            raise RequestValidationError("watermark is not supported by this server; omit it.")
        if p.top_n_tokens:
            raise RequestValidationError("top_n_tokens is not supported by this server; omit it.")
        self.check_sampling(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            typical_p=p.typical_p,
            repetition_penalty=p.repetition_penalty,
        )
        if p.seed is not None and p.seed < 0:
            raise RequestValidationError(f"seed must be >= 0 (got {p.seed}).")
        ids = self.tokenize(body.inputs)
        if p.truncate is not None:
            if p.truncate < 1:
                raise RequestValidationError(f"truncate must be a positive integer (got {p.truncate}).")
            ids = ids[-p.truncate :]
        return GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=self.new_tokens(p.max_new_tokens, len(ids), "max_new_tokens"),
            params=SamplingParams(
                do_sample=p.do_sample,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                typical_p=p.typical_p,
                repetition_penalty=p.repetition_penalty,
                seed=p.seed,
            ),
            stop=self.stops(p.stop),
            request_id=request_id,
        )

    def _openai_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.n != 1:
            raise RequestValidationError("Only n=1 is supported by this server.")
        if body.temperature is not None and body.temperature > 2:
            raise RequestValidationError(f"temperature must be in [0, 2] (got {body.temperature}).")
        self.check_sampling(temperature=body.temperature, top_p=body.top_p, allow_zero_temperature=True)

    @staticmethod
    def _openai_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)

    def completion(self, body: CompletionRequest, request_id: str) -> GenerationRequest:
        self._openai_common(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestValidationError("Send exactly one prompt per request (a string or a list of one).")
            prompt = prompt[0]
        ids = self.tokenize(prompt)
        return GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=self.new_tokens(body.max_tokens, len(ids), "max_tokens"),
            params=self._openai_params(body),
            stop=self.stops(body.stop),
            request_id=request_id,
        )

    def chat(self, body: ChatCompletionRequest, request_id: str) -> GenerationRequest:
        self._openai_common(body)
        if not body.messages:
            raise RequestValidationError("messages is empty; send at least one message.")
        prompt = render_chat(self.tokenizer, body.messages)
        ids = self.tokenize(prompt, add_special_tokens=False)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=self.new_tokens(requested, len(ids), "max_tokens"),
            params=self._openai_params(body),
            stop=self.stops(body.stop),
            request_id=request_id,
        )


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
