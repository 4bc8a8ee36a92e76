"""The engine: the one owner of the model and of its KV cache, running continuous batching on a thread of its own.

Requests arrive through :meth:`Engine.submit` into a bounded queue. Each sequence holds one slot of the engine's
preallocated :class:`~service.engine.kv_pool.SlotKVCache` from admission to its end. The engine thread loops, and
each stage of an iteration has a module of its own (the line vLLM v1 draws between engine, scheduler and executor):

1. the scheduler (:mod:`service.engine.scheduler`) admits waiting requests while a slot is free and the KV budget
   has room, and answers which rows the iteration's forward runs (a :class:`~service.engine.scheduler.SchedulerOutput`):
   a decode row for every running sequence and up to the step's prefill budget (at most ``PREFILL_CHUNK``) of
   prompt tokens of the sequences still being prefilled;
2. the executor (:mod:`service.engine.step_executor`) runs that one forward, has each decode row and each sequence
   whose prompt is now complete choose its next token in one batched pass, and hands the tokens to the output
   thread, which sends the events;
3. the scheduler frees the slots of sequences that finished, were cancelled by their client, or failed.

This module holds the loop that wires them, the caller's side (submit, cancel, stop) and the engine's lifecycle.
Events (:class:`~service.engine.requests.TokenEvent`, then a ``FinishEvent`` or ``ErrorEvent``) go to each
request's ``sink``, which the HTTP side turns into responses. An out-of-memory error in a forward fails that
forward's sequences only; an unrecoverable device error stops the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from loaders.native.cpu_threads import ThreadGovernor
from planner.hardware.devices import torch_device_name
from planner.placement.speculative_rate import RESIDENT_DRAFT_TOKENS
from planner.types import PREFILL_CHUNK
from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import require_transformers, supports_slot_cache
from service.engine.requests import EngineMetrics, Event, GenerationRequest, NoMetrics, Sequence
from service.engine.scheduler import Scheduler
from service.engine.speculation.model_drafter import ModelDrafter
from service.engine.speculation.verification import SpeculationMode, Speculator
from service.engine.step_executor import StepExecutor
from service.errors import GenerationError, NotReadyError, ServiceError

log = logging.getLogger(__name__)


class Ticket:
    """The caller's handle on a submitted request: cancel it when the client goes away."""

    def __init__(self, seq: Sequence, wake: Callable[[], None]):
        self._seq = seq
        self._wake = wake

    def cancel(self) -> None:
        if not self._seq.cancelled.is_set():
            self._seq.cancelled.set()
            self._wake()


class Engine:
    """Owns the model and its KV cache; batches the sequences of concurrent requests. Thread-safe ``submit``.

    ``max_batch_size`` is the number of cache slots (sequences decoded together); ``max_total_tokens`` the
    longest sequence (prompt + generated) a slot holds; ``kv_budget_tokens`` the most tokens all admitted
    sequences may reserve together (default: every slot full), which is what admission checks. A model whose
    decoder layers span several GPUs runs each iteration in up to ``micro_batches`` micro-batches over its device
    runs (:mod:`service.engine.multi_gpu_runner`, which also says when it is not used; ``device_pipeline`` reports
    it); ``standin_runs`` is that module's test-only hook. ``prefix_cache=False`` turns prefix reuse off: every
    prompt is prefilled whole, whatever the slots hold (a benchmark of cold prompts; tenants that must not share
    timing). ``threads`` sets and adapts the CPU thread count on the engine thread
    (:class:`~loaders.native.cpu_threads.ThreadGovernor`); None leaves torch's as it is. ``prefill_chunk`` is the
    most prompt tokens one step prefills: the step the plan budgeted activations for (the plan's
    ``workload.prefill_chunk``; a tight box plans a smaller one). ``speculate="ngram"`` has rows draft up to
    ``speculate_tokens`` tokens by prompt lookup and verify them in the same forward
    (:mod:`service.engine.speculation.verification`); ``speculate="int4"``/``"int8"`` drafts with ``draft_model``,
    the target's own weights quantized and resident, and ``speculate="model"`` with a smaller checkpoint's model
    (``--draft-model``), both through :mod:`service.engine.speculation.model_drafter`, which those modes need and
    the others refuse. Greedy output stays the same token for token, sampled output keeps its
    distribution.
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
        threads: ThreadGovernor | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        speculate: SpeculationMode = "off",
        speculate_tokens: int = RESIDENT_DRAFT_TOKENS,
        draft_model: torch.nn.Module | None = None,
    ):
        require_transformers()
        if not supports_slot_cache(model):
            raise GenerationError(
                f"{type(model).__name__} has attention the engine's slot cache does not run (only full and "
                "sliding-window attention through transformers' SDPA or eager attention); serve a causal LM."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens or _position_limit(model) or 4096
        self.kv_budget_tokens = kv_budget_tokens or max_batch_size * self.max_total_tokens
        self.metrics = metrics or NoMetrics()
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
        #: Speculative decoding's policy and counts (:mod:`service.engine.speculation.verification`); mode ``off`` drafts nothing.
        # the copy's own slot cache, one slot per engine slot (grown as sequences lengthen)
        drafter = ModelDrafter(draft_model, max_batch_size, self.max_total_tokens) if draft_model is not None else None
        self.speculator = Speculator(speculate, speculate_tokens, drafter)
        self.scheduler = Scheduler(
            self.cache,
            slots=max_batch_size,
            max_queue=max_queue,
            max_total_tokens=self.max_total_tokens,
            kv_budget_tokens=self.kv_budget_tokens,
            prefix_cache=prefix_cache,
            prefill_chunk=prefill_chunk,
            speculator=self.speculator,
        )
        self.executor = StepExecutor(
            self.runner,
            self.metrics,
            record_forward=self.scheduler.record_forward,
            on_unrecoverable=self._stop_for_good,
            speculator=self.speculator,
            trim=self.scheduler.trim,
        )
        self.threads = threads
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # iterations that decoded at least one row
        self.peak_batch = 0  # most sequences one decode step has served (tests and /info read it)

    # -- caller side -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.executor.output.start()
        self._thread = threading.Thread(target=self._run, name="loadmaster-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Ticket:
        seq = Sequence(request, sink, self.tokenizer, self.eos, self.special)
        self.scheduler.check_fits(seq)
        with self._cv:
            if self._stopping:
                raise NotReadyError(self.dead or "The server is shutting down; send the request to another replica.")
            self.scheduler.add(seq)
            self._cv.notify()
        return Ticket(seq, self._wake)

    @property
    def alive(self) -> bool:
        """Whether the loop is running and accepting work (false after stop or a crash)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def dead(self) -> str | None:
        """Why the engine stopped for good (an unrecoverable CUDA error), or None."""
        return self.executor.dead

    @property
    def active(self) -> int:
        """Sequences admitted and not yet ended."""
        return self.scheduler.active

    @property
    def queue_length(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def reserved_tokens(self) -> int:
        """KV budget tokens the admitted sequences hold."""
        return self.scheduler.reserved_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run through the model (a reused prefix is not counted)."""
        return self.scheduler.prefilled_tokens

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache instead."""
        return self.scheduler.reused_tokens

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
            if self.threads is not None:
                self.threads.start()
            while True:
                with self._cv:
                    while not self._stopping and not self.scheduler.waiting and not self.scheduler.running:
                        self._cv.wait()
                    if self._stopping:
                        break
                    newcomers = self.scheduler.admit()
                if newcomers:
                    now = time.perf_counter()
                    for seq in newcomers:
                        seq.request.queued_s = now - seq.enqueued_at
                        self.metrics.queued(seq.request.queued_s)
                self._step()
                if self.threads is not None:
                    self.threads.after_step()
                self.scheduler.release()
                if self.executor.release_memory:  # here no frame or cache of the failed step is referenced any more
                    self.executor.release_memory = False
                    torch.cuda.empty_cache()
                self.metrics.engine_state(self.active, self.queue_length)
        except Exception:  # pragma: no cover - a bug in the loop itself; never leave clients hanging
            log.exception("engine loop crashed")
        finally:
            with self._cv:
                self._stopping = True  # later submits are refused instead of waiting forever
            self._fail_all(NotReadyError("The server is shutting down; the request was not completed."))
            self.executor.output.close()
            self.runner.close()
            self.metrics.engine_state(0, 0)

    def _step(self) -> None:
        """One iteration: the scheduler's rows in one forward, so offloaded layers are read once per iteration. A
        sequence whose prompt is complete chooses its first token; it decodes from the next iteration on.

        A prompt waiting for an earlier one's shared prefix gets a second round (a prefill-only forward) in the same
        iteration, once that prefix is computed, so identical prompts admitted together also start decoding
        together.
        """
        plan = self.scheduler.schedule()
        if not plan.rows:
            return
        if plan.decodes:
            self.peak_batch = max(self.peak_batch, plan.decodes)
            self.steps += 1
        started = time.perf_counter()
        emitted = self.speculator.stats.emitted
        self.executor.execute(plan.rows)
        elapsed = time.perf_counter() - started
        prompt_tokens = sum(len(r.row.tokens) for r in plan.rows if r.prefill)
        self.scheduler.budget.observe(prompt_tokens, plan.decodes, elapsed)
        verified = sum(1 for r in plan.rows if r.drafts)
        if self.threads is not None:
            if plan.decodes and not prompt_tokens and not verified:
                self.threads.decode_step(plan.decodes, elapsed)
            else:
                self.threads.mixed_step()
        if self.speculator.enabled and plan.decodes and not prompt_tokens:  # a pure decode step: what drafting costs
            tokens = self.speculator.stats.emitted - emitted + plan.decodes - verified
            cost = elapsed + self.speculator.step_draft_seconds  # a draft model's forwards ran in the scheduler
            self.speculator.gate.observe(plan.decodes, cost, tokens, drafted=verified > 0)
        while plan.deferred and plan.prefill_budget > 0:
            plan = self.scheduler.schedule_prefill(plan.prefill_budget)
            if not plan.rows:
                return
            self.executor.execute(plan.rows)

    def _stop_for_good(self, seqs: list[Sequence], error: ServiceError) -> None:
        """The device is unusable: refuse new requests, fail the failed step's sequences (newcomers being prefilled
        are in no group yet), then every other; the loop ends after this step."""
        with self._cv:
            self._stopping = True
        for seq in seqs:
            if not seq.done:
                seq.fail(error)
        self._fail_all(error)

    def _fail_all(self, error: ServiceError) -> None:
        with self._cv:
            waiting = self.scheduler.take_waiting()
        for seq in waiting + self.scheduler.running:
            self.executor.fail(seq, error)
        self.scheduler.release()


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


def _position_limit(model: torch.nn.Module) -> int | None:
    """The model's own longest sequence, from its config (the default length of a cache slot)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
