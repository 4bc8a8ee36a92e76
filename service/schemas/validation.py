"""What every API's request validation shares: the limits, the body models' configuration, the checks.

The pydantic models of each API (:mod:`service.schemas.tgi_requests`, :mod:`service.schemas.openai_requests`) give
the OpenAPI schema and reject wrong types; their validation functions then check, through the :class:`Validator`
held here, what needs the tokenizer and the server's limits (token counts, ``max_new_tokens``, sampling ranges,
grammars), and build the engine's :class:`~service.engine.requests.GenerationRequest`\\ s. Every failure is a
:class:`~service.errors.RequestValidationError`. What is the same for every API lives here once, so TGI's and
OpenAI's routes cannot drift apart in how they count tokens or refuse a parameter.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.engine.requests import GenerationRequest
from service.engine.structured_output import GrammarCompiler
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


def is_set(value: Any) -> bool:
    """Whether a client asked for something: anything but ``None``, ``False`` and empty containers/strings."""
    return value is not None and value is not False and value != [] and value != {} and value != ""


def refuse_unknown(body: BaseModel, where: str = "") -> None:
    """A 422 naming each field this server does not know that the request sets (never accepted and ignored)."""
    extra = {k: v for k, v in (body.model_extra or {}).items() if is_set(v)}
    if extra:
        names = ", ".join(printable(f"{where}{k}")[:200] for k in sorted(extra))
        raise RequestValidationError(f"Unsupported parameter(s): {names}. This server does not implement them; omit.")


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
    """The checks every API shares, against the tokenizer and the server's limits, and the grammar compiler. The
    per-API functions (``validate_tgi``, ``validate_completion``, ``validate_chat``) build on it."""

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
        grammar_workers: int = 1,
        grammar_queue: int = 8,
        grammar_cache: int = 256,
    ):
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.default_max_new_tokens = default_max_new_tokens
        self.vocab_size = int(vocab_size or len(tokenizer))
        self.grammars = GrammarCompiler(
            tokenizer,
            self.vocab_size,
            stop_ids,
            timeout=grammar_timeout,
            workers=grammar_workers,
            waiting=grammar_queue,
            cache_size=grammar_cache,
        )

    # -- prompts and limits -------------------------------------------------------------------------------------------
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
