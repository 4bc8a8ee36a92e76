"""Structured output: JSON schemas, "any JSON object" and regexes compiled to token masks by xgrammar.

A grammar is compiled once per request, at validation (so a bad schema is a 422 before anything is queued), with
the served model's tokenizer and its logits' vocabulary size. Validation runs on a worker thread, never on the
event loop; the compilation itself runs on a thread of its own, waited for at most ``--grammar-timeout`` seconds: a
schema that takes longer (deeply nested objects can take minutes) is a 422 naming the field. The abandoned
compilation cannot be killed (xgrammar has no cancel); it holds one of a few compiler slots until it ends, so
requests cannot pile up unbounded work behind it (429 while every slot is taken). The engine gives each constrained sequence a
:class:`GrammarConstraint`: before every token it fills that row's bitmask (the batched sampler applies all rows'
masks at once), and it advances on every accepted token. When the grammar is complete only the end-of-sequence
tokens stay allowed, so the sequence ends as any other would.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal

import torch

from service.errors import OverloadedError, RequestValidationError

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "regex", "wrapped_json"]

#: Grammar compilations that may run at once (abandoned ones included); more wait, then get a 429.
COMPILE_SLOTS = 2


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for: the kind, its text (a schema as JSON, or a regex) and the field it came in.

    ``wrapped_json`` (tool calls a ``tool_choice`` requires) is JSON text ``{"prefix", "schema", "suffix"}``: literal
    text, a value of the schema, literal text."""

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

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], timeout: float = 10.0):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(COMPILE_SLOTS)

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
        """Compile ``spec`` within ``timeout`` seconds. A schema or regex xgrammar cannot use, or one that takes
        longer to compile, is a 422 naming the field. Blocks its (worker) thread; never call it on the event loop."""
        compiler = self._get()  # once per server: building the tokenizer's tables is not the request's doing
        if not self._slots.acquire(timeout=self.timeout):
            raise OverloadedError(
                f"{spec.field}: all {COMPILE_SLOTS} grammar compilers are busy with schemas that take long to "
                "compile; retry later, or send a simpler schema.",
                retry_after=max(1, round(self.timeout)),
            )
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(_compile_now(compiler, spec))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                done.set_exception(exc)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="loadmaster-grammar", daemon=True).start()
        try:
            compiled = done.result(timeout=self.timeout)
        except FutureTimeout:
            log.warning("%s: grammar compilation abandoned after %.1fs", spec.field, self.timeout)
            raise RequestValidationError(
                f"{spec.field}: the {_what(spec)} took longer than {self.timeout:g}s to compile (--grammar-timeout); "
                "send a simpler one (fewer nested objects, shorter patterns)."
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RequestValidationError(
                f"{spec.field}: the {_what(spec)} cannot be used for constrained generation: {reason}. "
                "Send a valid JSON schema (draft 2020-12 subset) or regex."
            ) from None
        return CompiledGrammar(spec=spec, compiled=compiled)


def _what(spec: GrammarSpec) -> str:
    return "regex" if spec.kind == "regex" else "JSON schema"


def _compile_now(compiler: Any, spec: GrammarSpec) -> Any:
    """xgrammar's compilation of ``spec`` (it releases the GIL while it works)."""
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.value, any_whitespace=False)
    if spec.kind == "wrapped_json":
        import xgrammar

        parts = json.loads(spec.value)
        pieces = [xgrammar.Grammar.from_json_schema(json.dumps(parts["schema"]), any_whitespace=False)]
        if parts.get("prefix"):
            pieces.insert(0, xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['prefix'])}"))
        if parts.get("suffix"):
            pieces.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['suffix'])}"))
        grammar = pieces[0] if len(pieces) == 1 else xgrammar.Grammar.concat(*pieces)
        return compiler.compile_grammar(grammar)
    return compiler.compile_regex(spec.value)


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
