"""What the offload costs, as ``/metrics`` shows it: the weights each device keeps resident and the weights streamed
from the checkpoint's files each step (from the plan), and the bytes this process really had fetched from storage
(``/proc/self/io``'s ``read_bytes``: reads the page cache served are not counted), per generated token since the
model became ready. A user can so see that an offload runs as planned, and what it costs per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from planner.types import Plan


def process_read_bytes(io_file: Path = Path("/proc/self/io")) -> int | None:
    """Bytes this process (all its threads) caused to be read from storage, or None where the kernel does not say."""
    try:
        for line in io_file.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class StorageCollector(Collector):
    """``loadmaster_weights_bytes{device, placement}``, ``loadmaster_storage_read_bytes`` and
    ``loadmaster_storage_read_bytes_per_token``, read at scrape time."""

    def __init__(self, plan: Callable[[], Plan | None], generated_tokens: Callable[[], int]):
        self.plan = plan
        self.generated_tokens = generated_tokens
        self.baseline: tuple[int, int] | None = None  # (read bytes, generated tokens) when the model became ready

    def ready(self) -> None:
        """Start counting per-token reads here: the load's own reads are not a token's."""
        read = process_read_bytes()
        self.baseline = None if read is None else (read, self.generated_tokens())

    def collect(self) -> Iterator[Metric]:
        weights = GaugeMetricFamily(
            "loadmaster_weights_bytes",
            "Weights per device as planned: resident (read from memory) or streamed (read from the checkpoint's "
            "files each step).",
            labels=["device", "placement"],
        )
        plan = self.plan()
        for budget in plan.budgets if plan is not None else ():
            if budget.weights:
                placement = "streamed" if budget.device == "disk" else "resident"
                weights.add_metric([str(budget.device), placement], int(budget.weights))
        yield weights
        read = process_read_bytes()
        if read is None:
            return
        total = CounterMetricFamily(
            "loadmaster_storage_read_bytes", "Bytes this process had read from storage (page-cache hits excluded)."
        )
        total.add_metric([], read)
        yield total
        per_token = GaugeMetricFamily(
            "loadmaster_storage_read_bytes_per_token",
            "Bytes read from storage per generated token since the model became ready (0 before any token).",
        )
        if self.baseline is not None:
            tokens = self.generated_tokens() - self.baseline[1]
            per_token.add_metric([], (read - self.baseline[0]) / tokens if tokens > 0 else 0.0)
        yield per_token
