"""Prometheus metrics, written in the text exposition format (version 0.0.4) without a client library.

Counters and histograms are updated from the event loop and the engine thread, so each update takes a lock.
Memory gauges are read when scraped, from a callable the app supplies.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{_escape(v)}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Histogram:
    def __init__(self, buckets: tuple[float, ...] = DURATION_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: tuple[tuple[str, str], ...] = ()) -> list[str]:
        out, cum = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cum += n
            out.append(f"{name}_bucket{_labels(labels + (('le', repr(float(bound))),))} {cum}")
        out.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {self.sum}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


#: (device, kind) -> bytes; kind is "planned" or "measured".
MemoryReader = Callable[[], dict[tuple[str, str], int]]


class Metrics:
    """All the service's metrics. Implements :class:`service.engine.EngineMetrics`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.request_duration: dict[str, _Histogram] = {}
        self.queue_duration = _Histogram()
        self.ttft = _Histogram()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.batch_size = 0
        self.queue_length = 0
        self.in_flight = 0
        self.rejected = 0
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of the last minute, for tokens/s
        self.memory_reader: MemoryReader | None = None

    # -- HTTP side -------------------------------------------------------------------------------------------------
    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (route, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            self.request_duration.setdefault(route, _Histogram()).observe(seconds)

    # -- engine side (EngineMetrics) -------------------------------------------------------------------------------
    def engine_state(self, batch_size: int, queue_length: int) -> None:
        self.batch_size, self.queue_length = batch_size, queue_length

    def queued(self, seconds: float) -> None:
        with self._lock:
            self.queue_duration.observe(seconds)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated
            self._recent.append((now, generated))
            self._recent = [(t, n) for t, n in self._recent if now - t <= 60.0]

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if now - t <= 60.0]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)
        return sum(n for _, n in recent) / span

    # -- exposition -----------------------------------------------------------------------------------------------
    def render(self) -> str:
        lines: list[str] = []

        def head(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("loadmaster_requests_total", "counter", "HTTP requests by route and status code.")
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f"loadmaster_requests_total{_labels((('route', route), ('status', status)))} {n}")
            head("loadmaster_request_duration_seconds", "histogram", "HTTP request duration by route.")
            for route, hist in sorted(self.request_duration.items()):
                lines.extend(hist.lines("loadmaster_request_duration_seconds", (("route", route),)))
            head("loadmaster_queue_duration_seconds", "histogram", "Time a request waited before its prefill.")
            lines.extend(self.queue_duration.lines("loadmaster_queue_duration_seconds"))
            head("loadmaster_time_to_first_token_seconds", "histogram", "Time from enqueue to the first token.")
            lines.extend(self.ttft.lines("loadmaster_time_to_first_token_seconds"))
            head("loadmaster_prompt_tokens_total", "counter", "Prompt tokens of completed requests.")
            lines.append(f"loadmaster_prompt_tokens_total {self.prompt_tokens}")
            head("loadmaster_generated_tokens_total", "counter", "Generated tokens of completed requests.")
            lines.append(f"loadmaster_generated_tokens_total {self.generated_tokens}")
            head("loadmaster_rejected_requests_total", "counter", "Requests refused with 429 (overload).")
            lines.append(f"loadmaster_rejected_requests_total {self.rejected}")
        head("loadmaster_generated_tokens_per_second", "gauge", "Generated tokens per second over the last minute.")
        lines.append(f"loadmaster_generated_tokens_per_second {self.tokens_per_second():.3f}")
        head("loadmaster_batch_size", "gauge", "Sequences in the running batch.")
        lines.append(f"loadmaster_batch_size {self.batch_size}")
        head("loadmaster_queue_length", "gauge", "Requests waiting for a batch slot.")
        lines.append(f"loadmaster_queue_length {self.queue_length}")
        head("loadmaster_requests_in_flight", "gauge", "Generation requests admitted and not finished.")
        lines.append(f"loadmaster_requests_in_flight {self.in_flight}")
        head("loadmaster_memory_bytes", "gauge", "Memory per device: planned by the plan, measured on the device.")
        if self.memory_reader is not None:
            for (device, kind), value in sorted(self.memory_reader().items()):
                lines.append(f"loadmaster_memory_bytes{_labels((('device', device), ('kind', kind)))} {int(value)}")
        return "\n".join(lines) + "\n"
