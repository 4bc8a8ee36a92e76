"""The engine: the one owner of the model and of its KV cache, running continuous batching on a thread of its own.

Requests arrive through :meth:`Engine.submit` into a bounded queue. Each sequence holds one slot of the engine's
preallocated :class:`~service.engine.kv_pool.SlotKVCache` from admission to its end. The engine thread loops:

1. admit waiting requests while a slot is free and the KV budget (tokens: prompt + max new tokens of every
   admitted sequence) has room; a prompt that starts like the tokens a slot still holds reuses them
   (:mod:`service.engine.prefix_index`);
2. one forward for the whole iteration: a decode row for every running sequence (one token each, at each one's own
   position) and up to :data:`PREFILL_CHUNK` prompt tokens in all, taken from the sequences still being prefilled,
   so a long prompt is prefilled over several iterations while the running streams keep decoding, and every weight
   (offloaded ones included) is read once per iteration; each decode row, and each sequence whose prompt is now
   complete, chooses its next token in one batched pass;
3. free the slots of sequences that finished, were cancelled by their client, or failed.

Events (:class:`TokenEvent`, then :class:`FinishEvent` or :class:`ErrorEvent`) go to each request's ``sink``,
which the HTTP side turns into responses. An out-of-memory error in a forward fails that forward's sequences only.
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

from planner.hardware.devices import torch_device_name
from planner.types import PREFILL_CHUNK
from service.engine.detokenizer import make_detokenizer
from service.engine.isolation import isolate_failure
from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import Row, supports_slot_cache
from service.engine.prefix_index import SlotContents, common_prefix
from service.engine.prompt_logprobs import score_prompt_tokens
from service.engine.sampling import Choice, SamplingParams, TokenChooser, choose_batch
from service.engine.stop_matcher import StopMatcher
from service.engine.token_output import ChosenToken, Failure, TokenOutput
from service.errors import GenerationError, NotReadyError, OverloadedError, ServiceError

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
    grammar: Any = None  # a service.engine.structured_output.CompiledGrammar the output must follow, or None
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
    """What the engine reports; :class:`service.http.metrics.Metrics` implements it."""

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
        self.detokenizer = make_detokenizer(tokenizer, request.prompt_ids)
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
        if token in self.eos or (self.chooser.constraint is not None and self.chooser.constraint.terminated):
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
        self.text += delta
        ev = self.token_event(token, logprob, top)
        ev.text = delta
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


#: Shortest shared prefix worth holding a prompt back an iteration for (a whole identical prompt always is).
SHARED_PREFIX_MIN = 16


class Engine:
    """Owns the model and its KV cache; batches the sequences of concurrent requests. Thread-safe ``submit``.

    ``max_batch_size`` is the number of cache slots (sequences decoded together); ``max_total_tokens`` the
    longest sequence (prompt + generated) a slot holds; ``kv_budget_tokens`` the most tokens all admitted
    sequences may reserve together (default: every slot full), which is what admission checks. A model whose
    decoder layers span several GPUs runs each iteration in up to ``micro_batches`` micro-batches over its device
    runs (:mod:`service.engine.multi_gpu_runner`, which also says when it is not used; ``device_pipeline`` reports
    it); ``standin_runs`` is that module's test-only hook. ``prefix_cache=False`` turns prefix reuse off: every
    prompt is prefilled whole, whatever the slots hold (a benchmark of cold prompts; tenants that must not share
    timing).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int = 32,
        max_queue: int = 128,
        max_total_tokens: int | None = None,
        kv_budget_tokens: int | None = None,
        metrics: EngineMetrics | None = None,
        micro_batches: int | None = None,
        standin_runs: int | None = None,
        prefix_cache: bool = True,
    ):
        if not supports_slot_cache(model):
            raise GenerationError(
                f"{type(model).__name__} has attention the engine's slot cache does not run (only full and "
                "sliding-window attention through transformers' SDPA or eager attention); serve a causal LM."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.max_total_tokens = max_total_tokens or _position_limit(model) or 4096
        self.kv_budget_tokens = kv_budget_tokens or max_batch_size * self.max_total_tokens
        self.metrics = metrics or _NoMetrics()
        self.device = input_device(model)
        self.eos = eos_ids(model, tokenizer)
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        # a model that runs elsewhere too (a pipeline's other stages) makes the slot cache, to mirror it there
        make_cache = getattr(model, "make_slot_cache", None) or SlotKVCache
        self.cache = make_cache(max_batch_size, self.max_total_tokens)
        # the device pipeline's runner when the decoder layers span several GPUs, else the plain one; imported
        # here, as the loader is, so that the service starts without it
        from service.engine.multi_gpu_runner import make_runner

        self.runner, self.device_pipeline = make_runner(
            model, self.device, self.cache, micro_batches=micro_batches, standin_runs=standin_runs
        )
        self.contents = SlotContents(max_batch_size)
        self.output = TokenOutput(self._emit, self._emit_failure)
        self._pending: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._admissions = 0
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.peak_batch = 0  # most sequences one decode step has served (tests and /info read it)
        self.prefilled_tokens = 0  # prompt tokens run through the model (a reused prefix is not counted)
        self.reused_tokens = 0  # prompt tokens whose KV came from the prefix cache instead
        #: Why the engine stopped for good (an unrecoverable CUDA error), or None.
        self.dead: str | None = None
        self._release_memory = False  # an OOM asked for the allocator's cache back, once the failed step is gone

    # -- caller side -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.output.start()
        self._thread = threading.Thread(target=self._run, name="loadmaster-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Ticket:
        seq = _Sequence(request, sink, self.tokenizer, self.eos, self.special)
        if seq.reserved - 1 > self.max_total_tokens or seq.reserved > self.kv_budget_tokens:
            raise GenerationError(
                f"The request needs {seq.reserved} tokens of KV cache (prompt + max_new_tokens); the server holds "
                f"{min(self.max_total_tokens, self.kv_budget_tokens)} per sequence. Shorten the prompt or lower "
                "max_new_tokens."
            )
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
        """Sequences admitted and not yet ended (one that just finished counts no more, though its slot is freed
        at the end of the engine's iteration)."""
        return sum(1 for s in self._running if not s.done)

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    @property
    def reserved_tokens(self) -> int:
        """KV budget tokens the admitted sequences hold."""
        return sum(s.reserved for s in self._running)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still queued or running get a ``not_ready`` error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._fail_all(NotReadyError("The server is shutting down; the request was not completed."))
            self.runner.close()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._pending and not self._running:
                        self._cv.wait()
                    if self._stopping:
                        break
                    newcomers = self._admit()
                if newcomers:
                    now = time.perf_counter()
                    for seq in newcomers:
                        seq.request.queued_s = now - seq.enqueued_at
                        self.metrics.queued(seq.request.queued_s)
                self._step()
                self._release()
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
            self.output.close()
            self.runner.close()
            self.metrics.engine_state(0, 0)

    def _fail_all(self, error: ServiceError) -> None:
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        for seq in pending + self._running:
            self._fail(seq, error)
        self._release()

    def _admit(self) -> list[_Sequence]:
        """Move waiting requests into slots, first come first served, while a slot is free and the KV budget holds
        their tokens (caller holds the lock). A slot that still holds the prompt's prefix is preferred."""
        newcomers = []
        reserved = self.reserved_tokens
        while self._pending and self.contents.free:
            seq = self._pending[0]
            if seq.cancelled.is_set():
                self._pending.popleft()
                continue
            if reserved + seq.reserved > self.kv_budget_tokens:
                break
            self._pending.popleft()
            prompt = seq.request.prompt_ids
            usable = len(prompt) - 1 if self._may_reuse(seq) else 0
            seq.slot, seq.prefilled = self.contents.take(prompt, usable)
            self.reused_tokens += seq.prefilled
            self._admissions += 1
            seq.admitted_at = self._admissions
            reserved += seq.reserved
            self._running.append(seq)
            newcomers.append(seq)
        return newcomers

    def _step(self) -> None:
        """One iteration's forward: a decode row (one token) for every running sequence and up to
        :data:`PREFILL_CHUNK` prompt tokens of the sequences still prefilling, oldest first, all in one forward, so
        offloaded layers are read once per iteration. A sequence whose prompt is complete chooses its first token;
        it decodes from the next iteration on.

        A prompt waiting for an earlier one's shared prefix gets a second round (a prefill-only forward) in the same
        iteration, once that prefix is computed, so identical prompts admitted together also start decoding
        together.
        """
        for seq in self._running:
            if seq.cancelled.is_set():
                seq.done = True
        decoders = sorted(
            (s for s in self._running if not s.done and not s.prefilling and s.generated), key=lambda s: s.slot
        )
        work = [
            _Work(s, Row(s.slot, len(s.request.prompt_ids) + len(s.generated) - 1, s.generated[-1:]), prefill=False)
            for s in decoders
        ]
        budget = PREFILL_CHUNK
        chunks, deferred = self._prefill_chunks(budget)
        work += chunks
        if not work:
            return
        if decoders:
            self.peak_batch = max(self.peak_batch, len(decoders))
            self.steps += 1
        self._forward(work)
        budget -= sum(len(w.row.tokens) for w in chunks)
        while deferred and budget > 0:
            chunks, deferred = self._prefill_chunks(budget)
            if not chunks:
                return
            self._forward(chunks)
            budget -= sum(len(w.row.tokens) for w in chunks)

    def _prefill_chunks(self, budget: int) -> tuple[list[_Work], bool]:
        """The next prompt chunks, oldest sequence first, up to ``budget`` tokens in all; and whether a sequence was
        held back for an earlier one's shared prefix."""
        chunks: list[_Work] = []
        deferred = False
        for seq in sorted(self._running, key=lambda s: s.admitted_at):
            if budget <= 0:
                break
            if not seq.prefilling or seq.done or seq.cancelled.is_set():
                continue
            if self._waits_for_shared_prefix(seq):
                deferred = True
                continue
            self._reuse_prefix(seq)
            take = min(len(seq.request.prompt_ids) - seq.prefilled, budget)
            tokens = seq.request.prompt_ids[seq.prefilled : seq.prefilled + take]
            chunks.append(
                _Work(seq, Row(seq.slot, seq.prefilled, tokens, every_logits=seq.request.prompt_logprobs), prefill=True)
            )
            budget -= take
        return chunks, deferred

    def _may_reuse(self, seq: _Sequence) -> bool:
        """Whether ``seq``'s prompt may take KV another sequence computed: not with the prefix cache off, nor for a
        prompt whose own logprobs were asked for (a reused token has no logits)."""
        return self.prefix_cache and not seq.request.prompt_logprobs

    def _waits_for_shared_prefix(self, seq: _Sequence) -> bool:
        """Whether an earlier sequence still prefilling shares more of this prompt than any slot holds now: then
        this one waits and copies that prefix once computed (identical prompts admitted together prefill once).
        A prompt whose own logprobs were asked for never waits: it is prefilled whole."""
        if not self._may_reuse(seq):
            return False
        prompt = seq.request.prompt_ids
        usable = len(prompt) - 1
        held = max(seq.prefilled, self._best_source_tokens(seq))
        for other in self._running:
            if other is seq or other.done or other.admitted_at > seq.admitted_at or not other.prefilling:
                continue
            shared = min(common_prefix(prompt, other.request.prompt_ids), usable)
            if shared > held and shared >= min(SHARED_PREFIX_MIN, usable):
                return True
        return False

    def _best_source_tokens(self, seq: _Sequence) -> int:
        prompt = seq.request.prompt_ids
        hit = self.contents.best_source(prompt, len(prompt) - 1, exclude=seq.slot)
        return hit.tokens if hit is not None else 0

    def _reuse_prefix(self, seq: _Sequence) -> None:
        """Copy the longest prefix of the prompt another slot holds into this sequence's slot, if it is longer
        than what the slot holds already (not for a prompt whose own logprobs were asked for, nor with the prefix
        cache off)."""
        if not self._may_reuse(seq):
            return
        prompt = seq.request.prompt_ids
        hit = self.contents.best_source(prompt, len(prompt) - 1, exclude=seq.slot)
        if hit is None or hit.tokens <= seq.prefilled:
            return
        self.cache.copy_prefix(hit.slot, seq.slot, seq.prefilled, hit.tokens)
        self.contents.tokens[seq.slot][seq.prefilled :] = prompt[seq.prefilled : hit.tokens]
        self.reused_tokens += hit.tokens - seq.prefilled
        seq.prefilled = hit.tokens

    def _forward(self, work: list[_Work]) -> None:
        """One forward over decode rows and prompt chunks; then every decode row, and every sequence whose prompt
        is now complete, chooses its next token in one batched pass."""
        try:
            out = self.runner.run([w.row for w in work])
        except Exception as exc:  # noqa: BLE001 - reported to the clients, logged with their request ids
            seqs = [w.seq for w in work]
            self._step_failed(seqs, exc, _where(work), retry=lambda part: self._forward(_only(work, part)))
            return
        choosing: list[int] = []
        for r, w in enumerate(work):
            seq, row = w.seq, w.row
            self.contents.tokens[seq.slot].extend(row.tokens)
            if not w.prefill:
                if seq.cancelled.is_set() or seq.done:
                    seq.done = True
                    continue
                choosing.append(r)
                continue
            if row.every_logits:
                prompt = seq.request.prompt_ids
                targets = prompt[row.start + 1 : row.start + len(row.tokens) + 1]
                seq.prompt_scores += score_prompt_tokens(out.every[r], targets, seq.request.top_n_tokens)
            seq.prefilled += len(row.tokens)
            self.prefilled_tokens += len(row.tokens)
            if not seq.prefilling:
                if seq.request.prompt_logprobs:
                    seq.set_prompt_logprobs(seq.prompt_scores)
                choosing.append(r)
        if not choosing:
            return
        chosen = [work[r] for r in choosing]
        self._choose(out.last[choosing] if len(choosing) < len(work) else out.last, chosen)

    def _choose(self, logits: torch.Tensor, work: list[_Work]) -> None:
        """Choose the next token of each row of ``logits`` (one per item of ``work``), in one batched pass
        (:func:`service.engine.sampling.choose_batch`); each row's alternatives stay on its chooser (``chooser.last``)."""
        seqs = [w.seq for w in work]
        try:
            choices = choose_batch(logits, [s.chooser for s in seqs])
        except Exception as exc:  # noqa: BLE001
            self._step_failed(
                seqs, exc, _where(work), retry=lambda part: self._choose(logits[_rows(seqs, part)], _only(work, part))
            )
            return
        now = time.perf_counter()
        first = []
        for w, choice in zip(work, choices):
            if w.prefill:
                self.metrics.first_token(now - w.seq.enqueued_at)
                first.append(w.seq.request.request_id)
            self._chosen(w.seq, choice.token, choice.logprob)
        if first:
            log.debug("request(s) %s prefilled", ", ".join(first))

    def _chosen(self, seq: _Sequence, token: int, logprob: float) -> None:
        """Record ``token`` for ``seq`` (engine side) and queue it, with its alternatives, for the output thread.
        A token the grammar refuses ends only that sequence."""
        top = seq.alternatives(token)
        try:
            reason = seq.record(token)
        except GenerationError as exc:
            self._fail(seq, exc)
            return
        self.output.put(ChosenToken(seq, token, logprob, reason, top))

    def _release(self) -> None:
        """Free the slots of sequences that ended; what they hold stays as a cached prefix."""
        keep = []
        for seq in self._running:
            if seq.done or seq.cancelled.is_set():
                seq.done = True
                if seq.slot is not None:
                    self.contents.release(seq.slot)
            else:
                keep.append(seq)
        self._running = keep

    def _fail(self, seq: _Sequence, error: ServiceError) -> None:
        """End ``seq`` now (its slot is freed) and send ``error`` after the tokens already queued for it."""
        if not seq.done or not seq.finished:
            seq.done = True
            self.output.put(Failure(seq, error))

    # -- output thread -----------------------------------------------------------------------------------------
    def _emit(self, chosen: ChosenToken) -> None:
        """``seq.emit``, isolated: a failure there (a detokenizer error, a broken sink) ends only that sequence."""
        seq = chosen.seq
        try:
            finish = seq.emit(chosen.token, chosen.logprob, chosen.reason, chosen.top)
        except Exception:  # noqa: BLE001
            log.exception(
                "request %s: handling a generated token failed; dropping the sequence", seq.request.request_id
            )
            try:
                seq.fail(GenerationError("Generation failed while decoding a token; the server logged the details."))
            except Exception:  # noqa: BLE001 - the sink itself is what failed
                seq.finished = True
            return
        if finish is not None:
            self.metrics.tokens(finish.prompt_tokens, finish.generated_tokens)
            seq.sink(finish)

    @staticmethod
    def _emit_failure(failure: Failure) -> None:
        failure.seq.fail(failure.error)

    def _step_failed(
        self,
        seqs: list[_Sequence],
        exc: Exception,
        where: str,
        retry: Callable[[list[_Sequence]], None] | None = None,
    ) -> None:
        """A batched step failed: an unrecoverable device error stops the engine; otherwise the batch is retried in
        halves (``retry``, :func:`service.engine.isolation.isolate_failure`) so only the culprit fails; a batch of one, or
        out of memory (the batch's size is at fault), fails its requests with the reason."""
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
        if retry is not None and not is_out_of_memory(exc):
            if isolate_failure(seqs, where, lambda part: None if self.dead else retry(part)):
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
                self._fail(seq, GenerationError(message))


@dataclass
class _Work:
    """One row of an iteration's forward: a decode row (the sequence's last token) or a prompt chunk."""

    seq: _Sequence
    row: Row
    prefill: bool  # the row feeds prompt tokens (its sequence has chosen no token yet)


def _where(work: list[_Work]) -> str:
    """What a failed step was, for its error message."""
    kinds = {w.prefill for w in work}
    return "prefill and decode step" if len(kinds) == 2 else ("prefill" if True in kinds else "decode step")


def _only(work: list[_Work], part: list[_Sequence]) -> list[_Work]:
    """The rows of the sequences in ``part`` (by identity), in their order."""
    keep = {id(seq) for seq in part}
    return [w for w in work if id(w.seq) in keep]


def _rows(seqs: list[_Sequence], part: list[_Sequence]) -> list[int]:
    """The row indices in ``seqs`` of the sequences in ``part`` (by identity)."""
    index = {id(seq): r for r, seq in enumerate(seqs)}
    return [index[id(seq)] for seq in part]


def _position_limit(model: torch.nn.Module) -> int | None:
    """The model's own longest sequence, from its config (the default length of a cache slot)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
