"""TGI's request bodies (``/generate``, ``/generate_stream``, ``/tokenize``) and their validation into engine requests.

The models mirror text-generation-inference's, so its clients and huggingface_hub's work unchanged; a parameter this
server does not implement is refused when set, never accepted and ignored. :func:`validate_tgi` checks what the
models cannot (sampling ranges, ``best_of``, the grammar, the prompt's tokens against the limits) through the shared
:class:`~service.schemas.validation.Validator`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from service.engine.requests import GenerationRequest
from service.engine.sampling import SamplingParams
from service.engine.structured_output import GrammarSpec, schema_text
from service.errors import RequestValidationError
from service.schemas.validation import (
    MAX_CHOICES,
    MAX_SEED,
    MAX_TOP_TOKENS,
    Validator,
    refuse_unknown,
    request_model_config,
)


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


def validate_tgi(v: Validator, body: TGIRequest, request_id: str) -> list[GenerationRequest]:
    """One engine request per sequence: ``best_of`` of them (1 unless asked)."""
    p = body.parameters
    refuse_unknown(body)
    refuse_unknown(p, "parameters.")
    if p.watermark:
        raise RequestValidationError("parameters.watermark is not supported by this server; omit it.")
    if p.adapter_id:
        raise RequestValidationError("parameters.adapter_id is not supported: this server has no adapters; omit it.")
    v.check_sampling(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        typical_p=p.typical_p,
        repetition_penalty=p.repetition_penalty,
    )
    v.check_penalty(p.frequency_penalty, "frequency_penalty")
    if p.seed is not None and p.seed < 0:
        raise RequestValidationError(f"seed must be >= 0 (got {p.seed}).")
    top_n = v.check_count(p.top_n_tokens, "top_n_tokens", 0, MAX_TOP_TOKENS)
    best_of = v.check_count(p.best_of, "best_of", 1, MAX_CHOICES)
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
    ids = v.tokenize(body.inputs, truncate=p.truncate)
    request = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=v.new_tokens(p.max_new_tokens, len(ids), "max_new_tokens"),
        params=params,
        stop=v.stops(p.stop),
        request_id=request_id,
        top_n_tokens=top_n,
        prompt_logprobs=p.decoder_input_details,
        grammar=_tgi_grammar(v, p.grammar),
    )
    return v.replicas(request, best_of)


def _tgi_grammar(v: Validator, grammar: Any) -> Any:
    """TGI's ``{"type": "json" | "regex", "value": ...}``, compiled; ``None`` when not asked for."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
        raise RequestValidationError(
            'parameters.grammar must be {"type": "json", "value": <JSON schema>} or {"type": "regex", "value": "..."}.'
        )
    kind, value = grammar["type"], grammar["value"]
    if kind in ("json", "json_object"):
        spec = GrammarSpec("json_schema", schema_text(value, "parameters.grammar.value"), "parameters.grammar.value")
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise RequestValidationError("parameters.grammar.value must be a non-empty regex string.")
        spec = GrammarSpec("regex", value, "parameters.grammar.value")
    else:
        raise RequestValidationError(f"parameters.grammar.type must be 'json' or 'regex' (got {kind!r}).")
    return v.grammars.request(spec)
