"""Prometheus metrics through ``prometheus-client``, one registry per app (tests run several apps in one process).

Counters and histograms are updated from the event loop and the engine thread; the client library does its own
locking. Gauges that are read rather than pushed (tokens per second, memory per device) are computed when scraped.
The names are the ones the hand-written exposition used before; ``_created`` series are turned off so each
counter is one sample, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

#: The content type of ``generate_latest``'s text format.
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

prometheus_client.disable_created_metrics()

#: (device, kind) -> bytes; kind is "planned" or "measured".
MemoryReader = Callable[[], dict[tuple[str, str], int]]


class _MemoryCollector(Collector):
    """``loadmaster_memory_bytes{device, kind}``, read from the app's memory report at scrape time."""

    def __init__(self, owner: Metrics):
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "loadmaster_memory_bytes",
            "Memory per device: planned by the plan, measured on the device.",
            labels=["device", "kind"],
        )
        reader = self.owner.memory_reader
        if reader is not None:
            for (device, kind), value in sorted(reader().items()):
                family.add_metric([device, kind], int(value))
        yield family


class Metrics:
    """All the service's metrics. Implements :class:`service.engine.requests.EngineMetrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "loadmaster_requests", "HTTP requests by route and status code.", ["route", "status"], registry=r
        )
        self._request_duration = Histogram(
            "loadmaster_request_duration_seconds",
            "HTTP request duration by route.",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._queue_duration = Histogram(
            "loadmaster_queue_duration_seconds",
            "Time a request waited before its prefill.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._ttft = Histogram(
            "loadmaster_time_to_first_token_seconds",
            "Time from enqueue to the first token.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._prompt_tokens = Counter(
            "loadmaster_prompt_tokens", "Prompt tokens of completed and cancelled requests.", registry=r
        )
        self._generated_tokens = Counter(
            "loadmaster_generated_tokens",
            "Generated tokens of completed requests and of streams cancelled by their client.",
            registry=r,
        )
        self._grammar_lookups = Counter(
            "loadmaster_grammar_lookups",
            "Grammars requests asked for, by result: hit (the compiled-grammar cache, or one being compiled) or miss.",
            ["result"],
            registry=r,
        )
        self._rejected = Counter("loadmaster_rejected_requests", "Requests refused with 429 (overload).", registry=r)
        self._cancelled = Counter(
            "loadmaster_cancelled_requests", "Generation requests whose client left before the end (499).", registry=r
        )
        Gauge(
            "loadmaster_generated_tokens_per_second",
            "Generated tokens per second over the last minute.",
            registry=r,
        ).set_function(self.tokens_per_second)
        self._batch_size = Gauge("loadmaster_batch_size", "Sequences in the running batch.", registry=r)
        self._queue_length = Gauge("loadmaster_queue_length", "Requests waiting for a batch slot.", registry=r)
        self._in_flight = Gauge(
            "loadmaster_requests_in_flight", "Generation requests admitted and not finished.", registry=r
        )
        self._pipeline_runs = Gauge(
            "loadmaster_device_pipeline_runs",
            "Device runs of decoder layers the micro-batch schedule drives in this process (0: not in use).",
            registry=r,
        )
        self._pipeline_micro_batches = Gauge(
            "loadmaster_device_pipeline_micro_batches",
            "Most micro-batches one engine step is split into over the device runs (0: not in use).",
            registry=r,
        )
        # speculative decoding (service/engine/speculation/verification.py): acceptance = accepted / draft tokens
        self._draft_tokens = Counter(
            "loadmaster_speculative_draft_tokens", "Draft tokens proposed for verification.", registry=r
        )
        self._accepted_tokens = Counter(
            "loadmaster_speculative_accepted_tokens",
            "Draft tokens the target model's verify pass accepted.",
            registry=r,
        )
        self._verify_passes = Counter(
            "loadmaster_speculative_verify_passes", "Decode rows that fed drafts for verification.", registry=r
        )
        self._lock = threading.Lock()
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of the last minute, for tokens/s
        self.memory_reader: MemoryReader | None = None
        self.generated_total = 0  # generated tokens, for per-token rates read at scrape time
        r.register(_MemoryCollector(self))

    # -- HTTP side -------------------------------------------------------------------------------------------------
    def request_done(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route=route, status=str(status)).inc()
        self._request_duration.labels(route=route).observe(seconds)

    def grammar_lookup(self, result: str) -> None:
        self._grammar_lookups.labels(result=result).inc()

    def request_rejected(self) -> None:
        self._rejected.inc()

    def set_in_flight(self, n: int) -> None:
        self._in_flight.set(n)

    def cancelled(self, prompt: int, generated: int) -> None:
        """A request whose client left: its tokens were computed, so they count."""
        self._cancelled.inc()
        self.tokens(prompt, generated)

    # -- engine side (EngineMetrics) -------------------------------------------------------------------------------
    def engine_state(self, batch_size: int, queue_length: int) -> None:
        self._batch_size.set(batch_size)
        self._queue_length.set(queue_length)

    def device_pipeline(self, runs: int, micro_batches: int) -> None:
        """The engine's device pipeline, set once it starts."""
        self._pipeline_runs.set(runs)
        self._pipeline_micro_batches.set(micro_batches)

    def queued(self, seconds: float) -> None:
        self._queue_duration.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        now = time.monotonic()
        self._prompt_tokens.inc(prompt)
        self._generated_tokens.inc(generated)
        with self._lock:
            self.generated_total += generated
            self._recent.append((now, generated))
            self._recent = [(t, n) for t, n in self._recent if now - t <= 60.0]

    def speculated(self, proposed: int, accepted: int) -> None:
        """A verify pass of one row: ``proposed`` drafts fed, ``accepted`` of them kept."""
        self._draft_tokens.inc(proposed)
        self._accepted_tokens.inc(accepted)
        self._verify_passes.inc()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if now - t <= 60.0]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)
        return sum(n for _, n in recent) / span

    # -- exposition -----------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
