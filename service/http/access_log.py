"""One structured access-log line per HTTP request, on the ``loadmaster.access`` logger.

The guard middleware opens an :class:`AccessRecord` for each request and makes it current (a context variable, so
the route and its stream, which run in tasks of the same request, see the same record); the engine stream fills in
the token counts and timings; the middleware writes the line when the response is over. A stream whose client left
before its end is logged (and counted) as 499, with the tokens it had generated.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("loadmaster.access")

#: The status logged for a request whose client went away before the answer was complete (nginx's convention).
CLIENT_CLOSED = 499


@dataclass
class AccessRecord:
    """What the access log says about one request."""

    request_id: str
    method: str
    path: str
    route: str | None = None
    status: int = 500
    prompt_tokens: int | None = None
    generated_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    cancelled: bool = False
    user: str | None = None  # the OpenAI ``user`` field: the end user the client says the request is for
    started: float = field(default_factory=time.perf_counter)
    _prompts: set[int] = field(default_factory=set, repr=False)

    def add_sequence(self, prompt_ids: list[int]) -> None:
        """One more sequence of this request: its prompt counts once however many sequences share it (``n``,
        ``best_of``), as the answer's usage counts it; its generated tokens are added as they come."""
        if id(prompt_ids) not in self._prompts:
            self._prompts.add(id(prompt_ids))
            self.prompt_tokens = (self.prompt_tokens or 0) + len(prompt_ids)

    def final_status(self, sent: int) -> int:
        """The status to log and count: 499 for an answer cut short because its client left."""
        return CLIENT_CLOSED if self.cancelled else sent

    def line(self) -> str:
        """The log line: one JSON object, keys in a fixed order."""

        def seconds(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        return json.dumps(
            {
                "id": self.request_id,
                "method": self.method,
                "route": self.route or self.path,
                "status": self.status,
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "queue_s": seconds(self.queue_s),
                "ttft_s": seconds(self.ttft_s),
                "total_s": seconds(self.total_s),
                **({"user": self.user} if self.user is not None else {}),
            },
            separators=(",", ":"),
            ensure_ascii=True,
        )


_current: ContextVar[AccessRecord | None] = ContextVar("loadmaster_access_record", default=None)


def begin(record: AccessRecord) -> None:
    _current.set(record)


def current() -> AccessRecord | None:
    return _current.get()


#: Routes that orchestrators poll every few seconds: logged at DEBUG, so that INFO shows the requests that matter.
#: Their answers change with the server's state, which is logged once where it changes (loading, ready, a failed
#: load, shutting down), not once per probe: a readiness probe's 503 during a long load is expected, not news.
PROBE_ROUTES = frozenset({"/health", "/health/ready", "/metrics"})


def emit(record: AccessRecord) -> None:
    level = logging.DEBUG if (record.route or record.path) in PROBE_ROUTES else logging.INFO
    log.log(level, "%s", record.line())
