"""The engine: the one owner of the model, running continuous batching on a thread of its own.

Requests arrive through :meth:`Engine.submit` into a bounded queue. The engine thread loops:

1. admit waiting requests while the batch has room: prefill those that arrived together in batches of similar
   length, choose each one's first token, merge their caches into the running batch (:mod:`service.batch`);
2. run one decode step for every active sequence together, choose each sequence's next token on its own row;
3. drop sequences that finished, were cancelled by their client, or failed.

Events (:class:`TokenEvent`, then :class:`FinishEvent` or :class:`ErrorEvent`) go to each request's ``sink``,
which the HTTP side turns into responses. An out-of-memory error in a step fails that step's sequences only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicCache

from planner.devices import torch_device_name
from service.batch import DecodeBatch, prefill, prefill_groups, stackable
from service.detokenizer import make_detokenizer
from service.errors import GenerationError, NotReadyError, OverloadedError, ServiceError
from service.prompt_logprobs import prompt_logprobs
from service.sampling import Choice, SamplingParams, TokenChooser, choose_batch
from service.stop_matcher import StopMatcher

log = logging.getLogger(__name__)


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
    grammar: Any = None  # a service.structured_output.CompiledGrammar the output must follow, or None


@dataclass
class TokenEvent:
    """One generated token. On a sequence's last token, ``final`` carries the finish (also sent on its own)."""

    id: int
    text: str
    logprob: float
    special: bool
    final: FinishEvent | None = None
    top_tokens: list[TokenEvent] = field(default_factory=list)  # the likeliest tokens at this step, best first


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
    """What the engine reports; :class:`service.metrics.Metrics` implements it."""

    def engine_state(self, batch_size: int, queue_length: int) -> None: ...
    def queued(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...


class _NoMetrics:
    def engine_state(self, batch_size: int, queue_length: int) -> None:
        pass

    def queued(self, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def tokens(self, prompt: int, generated: int) -> None:
        pass


class Ticket:
    """The caller's handle on a submitted request: cancel it when the client goes away."""

    def __init__(self, engine: Engine, seq: _Sequence):
        self._engine = engine
        self._seq = seq

    def cancel(self) -> None:
        if not self._seq.cancelled.is_set():
            self._seq.cancelled.set()
            self._engine._wake()


class _Sequence:
    """Engine-side state of one request: its token chooser, detokenizer and stop matcher, and what it has made."""

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
        self.done = False
        self.tokenizer = tokenizer
        constraint = None
        if request.grammar is not None:
            from service.structured_output import GrammarConstraint

            constraint = GrammarConstraint(request.grammar)
        self.chooser = TokenChooser.create(
            request.params, top_n=request.top_n_tokens, constraint=constraint, prompt_ids=request.prompt_ids
        )
        self.prefill: list[PrefillToken] | None = None
        self.generated: list[int] = []
        self.tokens: list[TokenEvent] = []
        self.text = ""
        self.eos = eos
        self.special = special
        self.enqueued_at = time.perf_counter()
        self.detokenizer = make_detokenizer(tokenizer, request.prompt_ids)
        self.stops = StopMatcher(request.stop)

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

    def accept(self, token: int, logprob: float) -> FinishEvent | None:
        """Record a chosen token, emit its event, and return the finish event if the sequence is complete."""
        self.generated.append(token)
        last = self.chooser.last if self.chooser.last is not None and self.chooser.last.token == token else None
        if not self.chooser.accept(token):
            raise GenerationError(f"The grammar rejected token {token}; the constrained sequence cannot go on.")
        is_eos = token in self.eos or (self.chooser.constraint is not None and self.chooser.constraint.terminated)
        n = len(self.generated)
        final = is_eos or n >= self.request.max_new_tokens
        delta = self.detokenizer.push(token, final)
        self.text += delta
        ev = self.token_event(token, logprob, last)
        ev.text = delta
        self.tokens.append(ev)
        finish = None
        match = self.stops.feed(delta)
        if match is not None:
            self.text = self.text[: match.end]
            finish = self._finish("stop_sequence", stop_at=match.at)
        if finish is None and is_eos:
            finish = self._finish("eos_token")
        if finish is None and n >= self.request.max_new_tokens:
            finish = self._finish("length")
        ev.final = finish
        self.sink(ev)
        return finish

    def _finish(self, reason: str, stop_at: int | None = None) -> FinishEvent:
        self.done = True
        return FinishEvent(
            reason=reason,
            text=self.text,
            generated_tokens=len(self.generated),
            prompt_tokens=len(self.request.prompt_ids),
            seed=self.chooser.seed,
            tokens=self.tokens,
            stop_at=stop_at,
            prefill=self.prefill or [],
        )

    def fail(self, error: ServiceError) -> None:
        self.done = True
        self.sink(ErrorEvent.of(error))


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, or the CPU allocator refusing (a plain ``RuntimeError`` saying "can't allocate
    memory", with no "out of memory" in it)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory")
    )


#: CUDA errors after which the context is corrupt: every later kernel on the device fails too, so they are the
#: engine's failure, not one request's (CUDA's own messages for cudaErrorIllegalAddress, cudaErrorAssert,
#: cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, cudaErrorECCUncorrectable,
#: cudaErrorHardwareStackError, cudaErrorLaunchTimeout).
UNRECOVERABLE_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "uncorrectable ecc error",
    "hardware stack error",
    "the launch timed out and was terminated",
)


def is_unrecoverable(exc: BaseException) -> bool:
    """A CUDA error that leaves the device unusable until the process restarts."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in UNRECOVERABLE_CUDA_ERRORS)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where compute happens, so token ids start there and logits and sampling stay there: the lowest GPU of the
    device map when it names one (embeddings offloaded to the host look their rows up there and hand them to that
    GPU), otherwise where the input embeddings live."""
    gpus = sorted(d for d in (getattr(model, "hf_device_map", None) or {}).values() if isinstance(d, int))
    if gpus:
        return torch.device(torch_device_name(gpus[0]))
    try:
        weight = model.get_input_embeddings().weight
        if weight.device.type != "meta":
            return weight.device
    except (AttributeError, NotImplementedError):
        pass
    return torch.device("cpu")


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _stacks_caches(model: torch.nn.Module) -> bool:
    """Whether the model's KV caches can be stacked across sequences, so that prompts may be prefilled together
    (a sliding-window or otherwise special cache keeps each sequence in a batch of its own, prefilled alone)."""
    try:
        return stackable(DynamicCache(config=model.config))
    except Exception:  # noqa: BLE001 - a config the cache cannot read: fall back to one prompt at a time
        return False


class Engine:
    """Owns the model; batches the sequences of concurrent requests. Thread-safe ``submit``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int = 32,
        max_queue: int = 128,
        metrics: EngineMetrics | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics or _NoMetrics()
        self.device = input_device(model)
        self.eos = eos_ids(model, tokenizer)
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        self.batch_prefill = _stacks_caches(model)
        self._pending: deque[_Sequence] = deque()
        self._groups: list[DecodeBatch] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.peak_batch = 0  # most sequences one decode step has served (tests and /info read it)
        #: Why the engine stopped for good (an unrecoverable CUDA error), or None.
        self.dead: str | None = None
        self._release_memory = False  # an OOM asked for the allocator's cache back, once the failed step is gone

    # -- caller side -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="loadmaster-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Ticket:
        seq = _Sequence(request, sink, self.tokenizer, self.eos, self.special)
        with self._cv:
            if self._stopping:
                raise NotReadyError(self.dead or "The server is shutting down; send the request to another replica.")
            if len(self._pending) >= self.max_queue:
                raise OverloadedError(f"The queue is full ({self.max_queue} waiting); retry shortly.")
            self._pending.append(seq)
            self._cv.notify()
        return Ticket(self, seq)

    @property
    def alive(self) -> bool:
        """Whether the loop is running and accepting work (false after stop or a crash)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def active(self) -> int:
        return sum(len(g) for g in self._groups)

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still queued or running get a ``not_ready`` error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._fail_all(NotReadyError("The server is shutting down; the request was not completed."))

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._pending and not self._groups:
                        self._cv.wait()
                    if self._stopping:
                        break
                    room = self.max_batch_size - self.active
                    newcomers = []
                    while room > 0 and self._pending:
                        seq = self._pending.popleft()
                        if seq.cancelled.is_set():
                            continue
                        newcomers.append(seq)
                        room -= 1
                if newcomers:
                    self._admit(newcomers)
                self._decode_step()
                if self._release_memory:  # here no frame or cache of the failed step is referenced any more
                    self._release_memory = False
                    torch.cuda.empty_cache()
                self.metrics.engine_state(self.active, len(self._pending))
        except Exception:  # pragma: no cover - a bug in the loop itself; never leave clients hanging
            log.exception("engine loop crashed")
        finally:
            with self._cv:
                self._stopping = True  # later submits are refused instead of waiting forever
            self._fail_all(NotReadyError("The server is shutting down; the request was not completed."))
            self.metrics.engine_state(0, 0)

    def _fail_all(self, error: ServiceError) -> None:
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        for seq in pending + [s for g in self._groups for s in g.items]:
            if not seq.done:
                seq.fail(error)
        self._groups = []

    def _admit(self, seqs: list[_Sequence]) -> None:
        """Prefill newcomers (together where their caches can later be stacked), then merge them into the batch."""
        now = time.perf_counter()
        for seq in seqs:
            self.metrics.queued(now - seq.enqueued_at)
        if self.batch_prefill:
            groups = prefill_groups([len(s.request.prompt_ids) for s in seqs])
        else:
            groups = [[i] for i in range(len(seqs))]
        for group in groups:
            self._prefill([seqs[i] for i in group])

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Prefill ``seqs`` in one forward, emit each one's first token and add the unfinished ones to a batch."""
        try:
            logits, cache, mask = prefill(self.model, self.device, [s.request.prompt_ids for s in seqs])
            choices = self._choose_all(logits, seqs)
        except Exception as exc:  # noqa: BLE001 - reported to the clients, logged with their request ids
            self._step_failed(seqs, exc, "prefill")
            return
        for seq, (token, logprob) in zip(seqs, choices):
            self.metrics.first_token(time.perf_counter() - seq.enqueued_at)
            finish = self._accept(seq, token, logprob)
            if finish is not None:
                self._finished(seq, finish)
        if all(seq.done for seq in seqs):
            return  # rows of finished sequences that do join are dropped before the next decode step
        if stackable(cache) and self._groups and stackable(self._groups[0].cache):
            self._groups[0].add(seqs, cache, mask)
        else:
            group = DecodeBatch(self.model, self.device)
            group.add(seqs, cache, mask)
            if stackable(cache):
                self._groups.insert(0, group)
            else:
                self._groups.append(group)
        log.debug("request(s) %s admitted", ", ".join(s.request.request_id for s in seqs))

    def _decode_step(self) -> None:
        self.peak_batch = max(self.peak_batch, self.active)
        for group in self._groups:
            group.keep([r for r, s in enumerate(group.items) if not s.cancelled.is_set() and not s.done])
            if not len(group):
                continue
            try:
                logits = group.step([s.generated[-1] for s in group.items])
                choices = self._choose_all(logits, group.items)
            except Exception as exc:  # noqa: BLE001
                self._step_failed(list(group.items), exc, "decode step")
                group.keep([])
                continue
            for seq, (token, logprob) in zip(group.items, choices):
                if seq.cancelled.is_set():
                    seq.done = True
                    continue
                finish = self._accept(seq, token, logprob)
                if finish is not None:
                    self._finished(seq, finish)
            group.keep([r for r, s in enumerate(group.items) if not s.done])
        self._groups = [g for g in self._groups if len(g)]
        self.steps += 1

    def _choose_all(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[tuple[int, float]]:
        """Next token of every row, in one batched pass (:func:`service.sampling.choose_batch`); each row's
        alternatives stay on its chooser (``chooser.last``) for ``accept``. A newcomer that asked for its prompt's
        logprobs gets them here, before its first token."""
        for seq in seqs:
            if seq.request.prompt_logprobs and seq.prefill is None:
                ids = seq.request.prompt_ids
                seq.set_prompt_logprobs(prompt_logprobs(self.model, self.device, ids, seq.request.top_n_tokens))
        return [(c.token, c.logprob) for c in choose_batch(logits, [s.chooser for s in seqs])]

    def _accept(self, seq: _Sequence, token: int, logprob: float) -> FinishEvent | None:
        """``seq.accept``, isolated: a failure there (a detokenizer error, a broken sink) ends only that sequence."""
        try:
            return seq.accept(token, logprob)
        except Exception:  # noqa: BLE001
            log.exception(
                "request %s: handling a generated token failed; dropping the sequence", seq.request.request_id
            )
            seq.done = True
            try:
                seq.sink(
                    ErrorEvent.of(
                        GenerationError("Generation failed while decoding a token; the server logged the details.")
                    )
                )
            except Exception:  # noqa: BLE001 - the sink itself is what failed
                pass
            return None

    def _finished(self, seq: _Sequence, finish: FinishEvent) -> None:
        seq.done = True
        self.metrics.tokens(finish.prompt_tokens, finish.generated_tokens)
        seq.sink(finish)

    def _step_failed(self, seqs: list[_Sequence], exc: Exception, where: str) -> None:
        ids = ", ".join(s.request.request_id for s in seqs)
        if is_unrecoverable(exc):
            log.critical("unrecoverable CUDA error in %s; the engine stops", where, exc_info=exc)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.dead = (
                f"The GPU hit an unrecoverable error during the {where} ({first}); the engine has stopped and "
                "readiness answers 503. Restart the server; if it recurs, report it with the server log."
            )
            with self._cv:
                self._stopping = True  # the loop ends after this step; submit refuses with the reason
            for seq in seqs:  # newcomers being prefilled are in no group yet
                if not seq.done:
                    seq.fail(NotReadyError(self.dead))
            self._fail_all(NotReadyError(self.dead))
            return
        if is_out_of_memory(exc):
            log.error("out of memory in %s; failing request(s) %s", where, ids)
            # the allocator's cache is released by the loop, after this step: the failed group's KV cache and the
            # exception's frames still hold device memory here
            self._release_memory = torch.cuda.is_available()
            message = (
                f"Out of memory during the {where} of a batch of {len(seqs)}; the request was dropped. "
                "Retry with fewer tokens, or lower --max-batch-size / --max-total-tokens on the server."
            )
        else:
            log.error("generation failed in %s for request(s) %s", where, ids, exc_info=exc)
            message = f"Generation failed during the {where}: {type(exc).__name__}. The server logged the details."
        for seq in seqs:
            if not seq.done:
                seq.fail(GenerationError(message))
