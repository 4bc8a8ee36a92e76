"""Structured output: JSON schemas, "any JSON object" and regexes compiled to token masks by xgrammar.

A grammar is asked for at validation (a full compiler queue is a 429 at once) and compiled out of the server's
process, in a small pool of compiler processes (:mod:`service.engine.grammar.compile_pool`) with the served
model's tokenizer and its logits' vocabulary size. The route awaits the compilation on the event loop, so waiting
holds no worker thread; one that takes longer than ``--grammar-timeout`` seconds (deeply nested objects can take
minutes) is a 422 naming the field, and its worker process is killed, so it costs no more CPU. Compiled grammars
are kept by the hash of their text (an LRU), so a repeated schema costs nothing. The engine gives each constrained
sequence a :class:`GrammarConstraint`: before every token it fills that row's bitmask (the batched sampler applies
all rows' masks at once), and it advances on every accepted token. When the grammar is complete only the
end-of-sequence tokens stay allowed, so the sequence ends as any other would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from service.engine.grammar.compile_pool import CompilePool, CompileRefused, CompileTimeout
from service.errors import RequestValidationError

GrammarKind = Literal["json_schema", "json_object", "regex", "wrapped_json", "ebnf"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for: the kind, its text (a schema as JSON, or a regex) and the field it came in.

    ``wrapped_json`` (tool calls a ``tool_choice`` requires) is JSON text ``{"prefix", "schema", "suffix"}``: literal
    text, a value of the schema, literal text; or ``{"options": [...]}`` of such, any one of them (harmony's calls,
    whose prefix names the function)."""

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


class PendingGrammar:
    """A grammar being compiled for a request: the route awaits it (:meth:`wait`, on the event loop) before the
    request is submitted, so no thread waits for a compiler."""

    def __init__(self, spec: GrammarSpec, future: Future, timeout: float):
        self.spec, self.future, self.timeout = spec, future, timeout

    def result(self) -> CompiledGrammar:
        """Block until compiled (tests and tools; the server awaits :meth:`wait`)."""
        try:
            return CompiledGrammar(self.spec, self.future.result())
        except Exception as exc:  # noqa: BLE001 - mapped to the request's error
            raise self._error(exc) from None

    async def wait(self) -> CompiledGrammar:
        try:  # shielded: a client that leaves does not cancel a compilation other requests may share
            return CompiledGrammar(self.spec, await asyncio.shield(asyncio.wrap_future(self.future)))
        except Exception as exc:  # noqa: BLE001 - mapped to the request's error
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> Exception:
        spec = self.spec
        if isinstance(exc, CompileTimeout):
            return RequestValidationError(
                f"{spec.field}: the {_what(spec)} took longer than {self.timeout:g}s to compile (--grammar-timeout); "
                "send a simpler one (fewer nested objects, shorter patterns)."
            )
        if isinstance(exc, (CompileRefused, RuntimeError, ValueError, TypeError)):
            return RequestValidationError(
                f"{spec.field}: the {_what(spec)} cannot be used for constrained generation: {exc}. "
                "Send a valid JSON schema (draft 2020-12 subset) or regex."
            )
        return exc


class GrammarCompiler:
    """Compiles request grammars for one tokenizer in a pool of compiler processes
    (:mod:`service.engine.grammar.compile_pool`), and keeps the last ``cache_size`` compiled grammars by the hash
    of their kind and text, so a repeated schema costs nothing. Nothing starts before the first grammar."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        timeout: float = 10.0,
        *,
        workers: int = 1,
        waiting: int = 8,
        cache_size: int = 256,
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._info: Any = None
        self._info_lock = threading.Lock()  # held while the tokenizer's tables are built (a dispatcher's doing)
        self._lock = threading.Lock()  # the cache and the grammars being compiled: held for moments only
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._pending: dict[str, PendingGrammar] = {}
        self.cache_size = cache_size
        self.pool = CompilePool(self._info_json, self._deserialize, workers=workers, waiting=waiting, timeout=timeout)
        #: Called with "hit" or "miss" for each grammar asked for (the server counts them in /metrics).
        self.on_lookup: Callable[[str], None] = lambda _: None

    @property
    def timeout(self) -> float:
        return self.pool.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.pool.timeout = seconds

    def _tokenizer_info(self) -> Any:
        with self._info_lock:
            if self._info is None:
                import xgrammar

                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids or None
                )
            return self._info

    def _info_json(self) -> str:
        return self._tokenizer_info().serialize_json()

    def _deserialize(self, serialized: str) -> Any:
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info())

    def request(self, spec: GrammarSpec) -> CompiledGrammar | PendingGrammar:
        """``spec`` compiled (from the cache) or being compiled; never blocks. A full compiler queue is an
        :class:`~service.errors.OverloadedError` (429) at once."""
        key = hashlib.sha256(f"{spec.kind}\0{spec.value}".encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            pending = self._pending.get(key)
        if hit is not None:
            self.on_lookup("hit")
            return CompiledGrammar(spec, hit.compiled)
        if pending is not None:  # the same grammar is already being compiled: share it
            self.on_lookup("hit")
            return PendingGrammar(spec, pending.future, pending.timeout)
        self.on_lookup("miss")
        pending = PendingGrammar(spec, self.pool.submit(spec.kind, spec.value, spec.field), self.timeout)
        with self._lock:
            self._pending[key] = pending
        pending.future.add_done_callback(lambda f: self._done(key, spec, f))
        return pending

    def _done(self, key: str, spec: GrammarSpec, future: Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self._cache[key] = CompiledGrammar(spec, future.result())
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled, blocking this thread (tests and tools; the server's routes await :meth:`request`)."""
        got = self.request(spec)
        return got if isinstance(got, CompiledGrammar) else got.result()

    def close(self) -> None:
        """Kill the compiler processes (the server is stopping)."""
        self.pool.close()


async def resolve_grammars(requests: list[Any]) -> list[Any]:
    """``requests`` (engine requests) with each grammar still being compiled awaited and put in its place."""
    out = []
    for r in requests:
        if isinstance(r.grammar, PendingGrammar):
            r = replace(r, grammar=await r.grammar.wait())
        out.append(r)
    return out


def _what(spec: GrammarSpec) -> str:
    return "regex" if spec.kind == "regex" else "JSON schema"


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
