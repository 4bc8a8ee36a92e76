"""What the routes share at run time: settings, load state, engine, admission control and engine streams.

Admission is counted here, on the event loop: a generation request holds a slot from validation until its
response ends (or its client goes away), and a request beyond ``max_concurrent_requests`` is refused at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from starlette.requests import Request

from loaders.native.cpu_threads import ThreadGovernor
from planner.hardware.cpu_share import CpuShare, cpu_share
from planner.placement.speculative_rate import draft_tokens
from service.engine.engine import Engine, eos_ids
from service.engine.requests import ErrorEvent, Event, FinishEvent, GenerationRequest, TokenEvent
from service.engine.structured_output import resolve_grammars
from service.errors import NotReadyError, OverloadedError
from service.http import access_log
from service.http.metrics import Metrics
from service.model.background_load import (
    LoadedModel,
    ModelHost,
    engine_prefill_chunk,
    engine_slots,
    running_sequences,
)
from service.model.positions import loaded_position_limit, served_positions
from service.model.weights_watch import WeightsWatch, weight_files
from service.schemas.validation import Validator
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a server whose weight files changed keeps answering 503 (and the error to open requests) before it exits.
WEIGHTS_CHANGED_LINGER_S = 1.0


class Runtime:
    """The service's shared state, one per app (``app.state.runtime``)."""

    def __init__(self, settings: ServiceSettings, host: ModelHost, metrics: Metrics):
        self.settings = settings
        self.host = host
        self.metrics = metrics
        #: The CPUs this process may use and the thread count that follows (``--threads``, quota, mask).
        self.cpu_share: CpuShare = cpu_share(settings.threads)
        self.threads: ThreadGovernor | None = None
        self.engine: Engine | None = None
        self.validator: Validator | None = None
        self.draining = False
        self.in_flight = 0
        #: What the server admits, prompt + output: --max-total-tokens capped at the model's positions (where they
        #: can be read before the load: the demo's, a local folder's; then the loaded model's), as /info reports it.
        self.max_total_tokens = _capped(settings.max_total_tokens, served_positions(settings))
        self.weight_bytes: dict[str, int] | None = None
        #: The engine streams whose responses are not over (the end of the grace period ends them).
        self.streams: set[EngineStream] = set()
        self._streams_lock = threading.Lock()  # the loop adds and removes; the grace timer's thread reads
        self.weights_watch: WeightsWatch | None = None
        host.on_ready(self._start_engine)
        host.on_ready(self._watch_weights)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def _start_engine(self, loaded: LoadedModel) -> None:
        s = self.settings
        max_total = _capped(s.max_total_tokens, loaded_position_limit(loaded.model))
        if max_total < s.max_total_tokens:
            log.info(
                "max_total_tokens %d exceeds the model's %d positions; using %d (as /info, /plan and /ui report)",
                s.max_total_tokens,
                max_total,
                max_total,
            )
        self.max_total_tokens = max_total
        self.validator = Validator(
            loaded.tokenizer,
            max_input_tokens=min(s.max_input_tokens, max_total - 1),
            max_total_tokens=max_total,
            default_max_new_tokens=s.default_max_new_tokens,
            vocab_size=_logits_width(loaded.model, loaded.tokenizer),
            stop_ids=eos_ids(loaded.model, loaded.tokenizer),
            grammar_timeout=s.grammar_timeout,
            grammar_workers=s.grammar_workers or grammar_workers(self.cpu_share.usable_cpus),
            grammar_queue=s.grammar_queue,
            grammar_cache=s.grammar_cache,
        )
        self.validator.grammars.on_lookup = self.metrics.grammar_lookup
        share = self.cpu_share
        # below the ceiling the count follows the CPU the engine really gets, unless --threads fixed it
        self.threads = ThreadGovernor(share.threads, adaptive=share.requested is None, reason=share.reason)
        engine = Engine(
            loaded.model,
            loaded.tokenizer,
            max_batch_size=running_sequences(s, loaded),  # the KV budget below holds the plan's slots
            kv_budget_tokens=engine_slots(s, loaded) * max_total,
            max_queue=s.max_concurrent_requests,
            max_total_tokens=max_total,
            metrics=self.metrics,
            # under --pipeline, --micro-batches splits the ring's batches (the model is the ring's rank 0)
            micro_batches=None if s.pipeline else s.micro_batches,
            standin_runs=s.standin_device_runs,
            prefix_cache=s.prefix_cache,
            threads=self.threads,
            prefill_chunk=engine_prefill_chunk(loaded),
            speculate=s.speculation_mode,
            speculate_tokens=draft_tokens(s.speculate_tokens, loaded.plan),
            draft_model=loaded.draft.model if loaded.draft is not None else None,
        )
        self.metrics.device_pipeline(engine.device_pipeline.runs, engine.device_pipeline.micro_batches)
        engine.start()
        self.engine = engine

    def _watch_weights(self, loaded: LoadedModel) -> None:
        interval = self.settings.weights_watch_interval
        if interval > 0 and Path(loaded.path).is_dir():
            self.weights_watch = WeightsWatch(
                weight_files(Path(loaded.path)), interval, self.weights_changed, loaded.model
            ).start()

    def weights_changed(self, reason: str) -> None:
        """The served weight files changed under the server: stop admitting (503 with the reason), end what is in
        flight with that error, stop the engine, and after a moment let the server exit non-zero (restart me)."""
        text = (
            f"The served model's weight files changed on disk ({reason}); this server stops serving and exits so "
            "that it is restarted on the new files. Retry the request shortly."
        )
        state = self.host.state
        state.error, state.error_type, state.phase = text, NotReadyError.error_type, "failed"
        with self._streams_lock:
            streams = list(self.streams)
        error = ErrorEvent.of(NotReadyError(text))
        for stream in streams:
            stream.deliver(error)
        if self.engine is not None:
            threading.Thread(target=self.engine.stop, name="loadmaster-weights-stop", daemon=True).start()
        exit_timer = threading.Timer(WEIGHTS_CHANGED_LINGER_S, self.host.stop_serving, args=(text,))
        exit_timer.daemon = True
        exit_timer.start()

    def shutdown(self) -> None:
        self.draining = True
        if self.weights_watch is not None:
            self.weights_watch.stop()
        if self.engine is not None:
            self.engine.stop()
        if self.validator is not None:
            self.validator.grammars.close()

    def end_grace_period(self) -> None:
        """The grace period after SIGTERM is over: end every open request now, each with a ``not_ready`` error
        (a stream's last event, a plain request's JSON 503), rather than cutting connections without an answer.

        The error goes straight to each open stream (a step in progress may take a while to end); then the engine
        stops. Called from a timer thread."""
        with self._streams_lock:
            streams = list(self.streams)
        if streams:
            log.warning("grace period over; ending %d open request(s) with an error", len(streams))
        error = ErrorEvent.of(NotReadyError("The server is shutting down: its grace period ended before the answer."))
        for stream in streams:
            stream.deliver(error)
        self.shutdown()

    @property
    def loaded(self) -> LoadedModel | None:
        return self.host.loaded

    # -- admission -------------------------------------------------------------------------------------------------
    def require_ready(self) -> tuple[Engine, Validator, LoadedModel]:
        if self.draining:
            raise NotReadyError("The server is shutting down and accepts no new requests.")
        if self.host.state.phase == "failed" and self.engine is not None:  # served, then stopped (weights changed)
            raise NotReadyError(str(self.host.state.error))
        loaded = self.host.loaded
        if self.engine is None or self.validator is None or loaded is None:
            st = self.host.state
            if st.phase == "failed":
                raise NotReadyError(f"The model failed to load: {st.error}")
            raise NotReadyError(
                f"The model is still loading ({st.phase}, {100 * st.to_dict()['progress']:.0f}%); "
                "retry when GET /health/ready answers 200."
            )
        if not self.engine.alive:
            raise NotReadyError(
                self.engine.dead or "The generation engine has stopped; the server must be restarted (see its log)."
            )
        return self.engine, self.validator, loaded

    def acquire(self) -> Slot:
        if self.in_flight >= self.settings.max_concurrent_requests:
            self.metrics.request_rejected()
            raise OverloadedError(
                f"The server is at its limit of {self.settings.max_concurrent_requests} concurrent requests; "
                "retry after the Retry-After delay.",
                retry_after=1,
            )
        self.in_flight += 1
        self.metrics.set_in_flight(self.in_flight)
        return Slot(self)


class Slot:
    """One admitted request. ``release`` is idempotent, so every exit path may call it."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.runtime.in_flight -= 1
            self.runtime.metrics.set_in_flight(self.runtime.in_flight)


class EngineStream:
    """An engine request seen from the event loop: an async iterator of its events, cancellable."""

    def __init__(self, engine: Engine, request: GenerationRequest, slot: Slot, tokens: bool = True):
        #: Whether each token event reaches the loop (a stream's do); a non-streaming response waits for the final
        #: event only, so its tokens are counted on the engine side and never wake the loop.
        self.tokens = tokens
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.slot = slot
        self.request = request
        self.finished = False
        self.record = access_log.current()
        if self.record is not None:
            self.record.add_sequence(request.prompt_ids)
        self.submitted_at = time.perf_counter()
        self.generated = 0
        self.ticket = engine.submit(request, self._sink)
        with slot.runtime._streams_lock:  # noqa: SLF001 - the runtime's own bookkeeping of its streams
            slot.runtime.streams.add(self)

    def _sink(self, event: Event) -> None:
        # Runs on the engine thread: count the tokens (a cancelled stream's count still) and time the first.
        if isinstance(event, TokenEvent):
            self.generated += 1
            if self.record is not None:
                if self.record.ttft_s is None:
                    self.record.ttft_s = time.perf_counter() - self.submitted_at
                    self.record.queue_s = self.request.queued_s
                self.record.generated_tokens += 1  # every sequence of the request counts (n, best_of, prompts)
            if not self.tokens:
                return
        self.deliver(event)

    def deliver(self, event: Event) -> None:
        """Queue ``event`` for the response (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            last = isinstance(event, (FinishEvent, ErrorEvent))
            if last:
                self.finished = True  # before the yield: a caller that returns after the last event ends it
            yield event
            if last:
                return

    def close(self) -> None:
        """End of the response: cancel the sequence if it is still running and free the slot at once."""
        if not self.finished and self.slot.held:
            self.ticket.cancel()
            if self.record is not None:
                self.record.cancelled = True
            self.slot.runtime.metrics.cancelled(len(self.request.prompt_ids), self.generated)
        with self.slot.runtime._streams_lock:  # noqa: SLF001
            self.slot.runtime.streams.discard(self)
        self.slot.release()

    async def wait_final(self, request: Request) -> FinishEvent | ErrorEvent | None:
        """Wait for the last event of a non-streaming request; ``None`` (and cancelled) if the client left."""

        async def final() -> FinishEvent | ErrorEvent:
            while True:
                event = await self.queue.get()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    return event

        async def disconnected() -> None:
            while True:
                message = await request.receive()
                if message.get("type") == "http.disconnect":
                    return

        done_task = asyncio.ensure_future(final())
        gone_task = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (done_task, gone_task):
                if not task.done():
                    task.cancel()
        if done_task.done() and not done_task.cancelled():
            self.finished = True
            return done_task.result()
        log.info("request %s: client disconnected; cancelled", self.request.request_id)
        self.close()
        return None


def _logits_width(model: Any, tokenizer: Any) -> int:
    """The size of the model's logits (its output embeddings), which can exceed the tokenizer's vocabulary."""
    try:
        return int(model.get_output_embeddings().weight.shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return int(size) if isinstance(size, int) else len(tokenizer)


def open_streams(
    runtime: Runtime, engine: Engine, requests: list[GenerationRequest], stream: bool
) -> list[EngineStream]:
    """Submit every sequence of one HTTP request (``n``, ``best_of``, several prompts), each holding a slot of the
    concurrency limit; if one cannot be admitted, those already submitted are cancelled and the error raised.
    ``stream``: the response streams tokens (else only the final events are delivered, see :class:`EngineStream`)."""
    streams: list[EngineStream] = []
    try:
        for gen in requests:
            slot = runtime.acquire()
            try:
                streams.append(EngineStream(engine, gen, slot, tokens=stream))
            except BaseException:
                slot.release()
                raise
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def wait_all(streams: list[EngineStream], request: Request) -> list[FinishEvent | ErrorEvent] | None:
    """The final event of every stream, in order; ``None`` (all cancelled) if the client went away first."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                return

    async def final(stream: EngineStream) -> FinishEvent | ErrorEvent:
        while True:
            event = await stream.queue.get()
            if isinstance(event, (FinishEvent, ErrorEvent)):
                stream.finished = True
                return event

    finals = asyncio.ensure_future(asyncio.gather(*(final(s) for s in streams)))
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({finals, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (finals, gone):
            if not task.done():
                task.cancel()
        for stream in streams:
            stream.close()
    if finals.done() and not finals.cancelled():
        return list(finals.result())
    log.info("request %s: client disconnected; cancelled", streams[0].request.request_id)
    return None


async def merged_events(streams: list[EngineStream]) -> AsyncIterator[tuple[int, Event]]:
    """The events of several streams as they come, each with its stream's index; ends when all have ended."""
    getters: dict[int, asyncio.Future[Event]] = {}
    try:
        for i, stream in enumerate(streams):
            getters[i] = asyncio.ensure_future(stream.queue.get())
        while getters:
            await asyncio.wait(set(getters.values()), return_when=asyncio.FIRST_COMPLETED)
            for i in sorted(i for i, g in getters.items() if g.done()):
                event = getters.pop(i).result()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    streams[i].finished = True
                else:
                    getters[i] = asyncio.ensure_future(streams[i].queue.get())
                yield i, event
    finally:
        for g in getters.values():
            g.cancel()


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a worker thread: tokenizing or chat-templating a large prompt takes long enough to
    stall every other route (health included) if it ran on the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def request_id_of(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id") or getattr(request.state, "request_id", "-"))


def grammar_workers(cpus: int) -> int:
    """The default count of grammar compiler processes on ``cpus`` usable CPUs: 1 on up to 7 (one compilation may
    take a core; the engine needs the rest), else a quarter of them, at most 4."""
    return max(1, min(4, cpus // 4))


async def validated(build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)`` (validation) on a worker thread, then its requests' grammars awaited here, on the loop: a
    compilation never holds a worker thread. ``build`` returns the requests, or a pair (requests, extra)."""
    built = await off_loop(build, *args)
    gens, extra = built if isinstance(built, tuple) else (built, None)
    gens = await resolve_grammars(gens)
    return (gens, extra) if isinstance(built, tuple) else gens


def _capped(max_total_tokens: int, positions: int | None) -> int:
    return min(max_total_tokens, positions) if positions else max_total_tokens
