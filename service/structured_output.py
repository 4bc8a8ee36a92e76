"""Structured output: JSON schemas, "any JSON object" and regexes compiled to token masks by xgrammar.

A grammar is compiled once per request, at validation (so a bad schema is a 422 before anything is queued), with
the served model's tokenizer and its logits' vocabulary size. The engine gives each constrained sequence a
:class:`GrammarConstraint`: before every token it fills that row's bitmask (the batched sampler applies all rows'
masks at once), and it advances on every accepted token. When the grammar is complete only the end-of-sequence
tokens stay allowed, so the sequence ends as any other would.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from service.errors import RequestValidationError

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "regex"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for: the kind, its text (a schema as JSON, or a regex) and the field it came in."""

    kind: GrammarKind
    value: str = ""
    field: str = "grammar"


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar, ready to start matchers from (one per sequence); ``spec`` says what it came from."""

    spec: GrammarSpec
    compiled: Any  # xgrammar.CompiledGrammar


class GrammarConstraint:
    """One sequence's grammar state (an xgrammar ``GrammarMatcher``)."""

    def __init__(self, grammar: CompiledGrammar):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar.compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab)


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` that their grammar forbids."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(scores, bitmask.to(scores.device), indices=rows)


class GrammarCompiler:
    """Compiles request grammars for one tokenizer; built on first use (importing xgrammar takes a moment)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; a schema or regex xgrammar cannot use is a 422 naming the field."""
        compiler = self._get()
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False)
            else:
                compiled = compiler.compile_regex(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = "regex" if spec.kind == "regex" else "JSON schema"
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RequestValidationError(
                f"{spec.field}: the {what} cannot be used for constrained generation: {reason}. "
                "Send a valid JSON schema (draft 2020-12 subset) or regex."
            ) from None
        return CompiledGrammar(spec=spec, compiled=compiled)


def schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text; anything else is a 422 naming ``field``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestValidationError(f"{field} is not valid JSON: {exc.msg} (at {exc.pos}).") from None
    if not isinstance(value, dict):
        raise RequestValidationError(f"{field} must be a JSON schema object (got {type(value).__name__}).")
    return json.dumps(value)
