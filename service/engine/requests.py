"""What goes into the engine and what comes out of it, and the engine's record of each sequence in between.

A route hands the engine a :class:`GenerationRequest` (validated: token ids, limits, sampling settled) and a sink;
the sink receives :class:`TokenEvent`\\ s, then one :class:`FinishEvent` or :class:`ErrorEvent`. Between the two
the engine keeps a :class:`Sequence`: its slot and tokens (the scheduler and the executor, on the engine thread)
and its detokenizer, stop matcher and events (the output thread, :mod:`service.engine.token_output`). These are
the records every stage hands on (as vLLM's ``v1/request.py`` and its engine outputs are), kept apart from the
stages so that the HTTP side imports records, not the engine's loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.engine.detokenizer import make_detokenizer
from service.engine.sampling import Choice, SamplingParams, TokenChooser
from service.engine.stop_matcher import StopMatcher
from service.errors import GenerationError, ServiceError


@dataclass
class GenerationRequest:
    """A validated request: token ids in, limits and sampling settled."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = "-"
    top_n_tokens: int = 0  # alternatives to report with each token (TGI top_n_tokens, OpenAI top_logprobs)
    prompt_logprobs: bool = False  # report the prompt tokens' logprobs (TGI decoder_input_details, OpenAI echo)
    #: A service.engine.structured_output.CompiledGrammar the output must follow, or None (a PendingGrammar between
    #: validation and the route's await of its compilation; never one in the engine).
    grammar: Any = None
    ignore_eos: bool = False  # generate max_new_tokens whatever is chosen (fixed-length greedy runs, as in vLLM)
    stop_token_ids: frozenset[int] = frozenset()  # more tokens that end the sequence (vLLM's stop_token_ids)
    skip_special_tokens: bool = True  # leave special tokens' text out of the output (vLLM's default)
    #: Seconds the request waited in the queue; set by the engine when it admits the request (the access log).
    queued_s: float | None = None


@dataclass
class TokenEvent:
    """One generated token. On a sequence's last token, ``final`` carries the finish (also sent on its own)."""

    id: int
    text: str
    logprob: float
    special: bool
    final: FinishEvent | None = None
    top_tokens: list[TokenEvent] = field(default_factory=list)  # the likeliest tokens at this step, best first
    #: On a sequence's first token, the prompt's tokens when the request asked for their logprobs (echo in streams).
    prefill: list[PrefillToken] | None = None


@dataclass
class PrefillToken:
    """A prompt token with its logprob given the tokens before it (``None`` for the first) and alternatives."""

    id: int
    text: str
    logprob: float | None
    special: bool = False
    top_tokens: list[TokenEvent] = field(default_factory=list)


@dataclass
class FinishEvent:
    """The end of a sequence. ``text`` is all generated text, including a matched stop sequence.

    ``stop_at`` is where the matched stop sequence starts in ``text`` (OpenAI routes cut there).
    """

    reason: str  # "length" | "eos_token" | "stop_sequence"
    text: str
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    tokens: list[TokenEvent]
    stop_at: int | None = None
    prefill: list[PrefillToken] = field(default_factory=list)  # only when the request asked for prompt_logprobs

    @property
    def cumulative_logprob(self) -> float:
        """How likely the whole sequence was: the sum of its tokens' logprobs (``best_of`` keeps the highest)."""
        return sum(t.logprob for t in self.tokens)


@dataclass
class ErrorEvent:
    """The end of a sequence that failed: the error's message, its stable ``error_type`` and its HTTP status."""

    message: str
    error_type: str = GenerationError.error_type
    status_code: int = GenerationError.status_code

    @classmethod
    def of(cls, error: ServiceError) -> ErrorEvent:
        return cls(message=str(error), error_type=error.error_type, status_code=error.status_code)


Event = TokenEvent | FinishEvent | ErrorEvent


class EngineMetrics(Protocol):
    """What the engine reports; :class:`service.http.metrics.Metrics` implements it."""

    def engine_state(self, batch_size: int, queue_length: int) -> None: ...
    def queued(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def speculated(self, proposed: int, accepted: int) -> None: ...


class NoMetrics:
    """The metrics of an engine nobody watches (tests, benchmarks)."""

    def engine_state(self, batch_size: int, queue_length: int) -> None:
        pass

    def queued(self, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def tokens(self, prompt: int, generated: int) -> None:
        pass

    def speculated(self, proposed: int, accepted: int) -> None:
        pass


class Sequence:
    """One request's state: its token chooser, slot and tokens (engine thread), and its detokenizer, stop matcher
    and events (output thread, :mod:`service.engine.token_output`)."""

    def __init__(
        self,
        request: GenerationRequest,
        sink: Callable[[Event], None],
        tokenizer: Any,
        eos: set[int],
        special: frozenset[int] = frozenset(),
    ):
        self.request = request
        self.sink = sink
        self.cancelled = threading.Event()
        self.done = False  # no more tokens wanted: the engine frees its slot (set by either side)
        self.finished = False  # its last event is sent (output side only)
        self.tokenizer = tokenizer
        constraint = None
        if request.grammar is not None:
            from service.engine.structured_output import GrammarConstraint

            constraint = GrammarConstraint(request.grammar)
        self.chooser = TokenChooser.create(
            request.params, top_n=request.top_n_tokens, constraint=constraint, prompt_ids=request.prompt_ids
        )
        self.prefill: list[PrefillToken] | None = None
        #: The prompt tokens' scores so far, chunk after chunk (only when the request asked for them); the first
        #: token has nothing before it.
        self.prompt_scores: list[Choice | None] = [None]
        self.generated: list[int] = []
        self.tokens: list[TokenEvent] = []
        self.text = ""
        self.eos = eos
        self.special = special
        self.enqueued_at = time.perf_counter()
        self.detokenizer = make_detokenizer(
            tokenizer, request.prompt_ids, skip_special_tokens=request.skip_special_tokens
        )
        self.stops = StopMatcher(request.stop)
        self.slot: int | None = None  # its KV cache slot, from admission to its end
        self.prefilled = 0  # prompt tokens whose KV is in the slot
        self.admitted_at = 0  # admission order: a later prompt may wait for an earlier one's shared prefix

    @property
    def reserved(self) -> int:
        """KV cache tokens this sequence may come to hold: its prompt and every token it may generate."""
        return len(self.request.prompt_ids) + self.request.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_ids)

    def token_event(self, token: int, logprob: float, top: Choice | None) -> TokenEvent:
        """A token's event with ``top``'s alternatives (each decoded on its own)."""
        alternatives = [
            TokenEvent(id=a.id, text=self.tokenizer.decode([a.id]), logprob=a.logprob, special=a.id in self.special)
            for a in (top.top if top is not None else ())
        ]
        return TokenEvent(id=token, text="", logprob=logprob, special=token in self.special, top_tokens=alternatives)

    def set_prompt_logprobs(self, choices: list[Choice | None]) -> None:
        ids = self.request.prompt_ids
        self.prefill = []
        for token, choice in zip(ids, choices):
            ev = self.token_event(token, 0.0, choice)
            self.prefill.append(
                PrefillToken(
                    id=token,
                    text=self.tokenizer.decode([token]),
                    logprob=None if choice is None else choice.logprob,
                    special=ev.special,
                    top_tokens=ev.top_tokens,
                )
            )

    def record(self, token: int) -> str | None:
        """Engine side: add a chosen token; return why the sequence ends with it ("eos_token", "length"), if it
        does (then it is ``done``: its slot is freed). Stop sequences are found on the output side."""
        self.generated.append(token)
        if not self.chooser.accept(token):
            raise GenerationError(f"The grammar rejected token {token}; the constrained sequence cannot go on.")
        reason = None
        terminated = self.chooser.constraint is not None and self.chooser.constraint.terminated
        if (token in self.eos and not self.request.ignore_eos) or token in self.request.stop_token_ids or terminated:
            reason = "eos_token"
        elif len(self.generated) >= self.request.max_new_tokens:
            reason = "length"
        if reason is not None:
            self.done = True
        return reason

    def alternatives(self, token: int) -> Choice | None:
        """The chooser's record of the choice that gave ``token`` (its alternatives), taken on the engine thread
        before the next choice replaces it."""
        last = self.chooser.last
        return last if last is not None and last.token == token else None

    def emit(self, token: int, logprob: float, reason: str | None, top: Choice | None = None) -> FinishEvent | None:
        """Output side: detokenize ``token``, look for stop sequences, send its event; return the finish event if
        the sequence is complete. A token chosen after the sequence finished (a stop sequence found here while
        the engine ran on) is dropped."""
        if self.finished:
            return None
        delta = self.detokenizer.push(token, reason is not None)
        if reason == "eos_token" and not self.request.skip_special_tokens:
            ending = self.tokenizer.decode([token])  # the token that ends the sequence is not output text
            delta = delta[: -len(ending)] if ending and delta.endswith(ending) else delta
        self.text += delta
        ev = self.token_event(token, logprob, top)
        ev.text = delta
        if not self.tokens and self.prefill is not None:
            ev.prefill = self.prefill
        self.tokens.append(ev)
        finish = None
        match = self.stops.feed(delta)
        if match is not None:
            self.text = self.text[: match.end]
            finish = self._finish("stop_sequence", stop_at=match.at)
        elif reason is not None:
            finish = self._finish(reason)
        ev.final = finish
        self.sink(ev)
        return finish

    def _finish(self, reason: str, stop_at: int | None = None) -> FinishEvent:
        self.done = True
        self.finished = True
        return FinishEvent(
            reason=reason,
            text=self.text,
            generated_tokens=len(self.tokens),
            prompt_tokens=len(self.request.prompt_ids),
            seed=self.chooser.seed,
            tokens=self.tokens,
            stop_at=stop_at,
            prefill=self.prefill or [],
        )

    def fail(self, error: ServiceError) -> None:
        """Output side: send the error, unless the sequence already finished."""
        self.done = True
        if not self.finished:
            self.finished = True
            self.sink(ErrorEvent.of(error))
