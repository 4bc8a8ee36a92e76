"""Turning chosen tokens into events, off the decode loop: detokenization, stop sequences and the sinks run on a
thread of their own, so the engine thread goes from one forward to the next without waiting on text.

The engine decides what it can from token ids alone (end of sequence, length) and hands each chosen token here
in order. This side detokenizes it (:mod:`service.engine.detokenizer`), looks for stop sequences in the new text
(:mod:`service.engine.stop_matcher`) and sends the events. A stop sequence found here ends the sequence: its ``done`` is
set, so the engine frees its slot at its next iteration; a token the engine chose meanwhile is dropped, never sent.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ChosenToken:
    """One token the engine chose for a sequence; ``reason`` is set when the engine ended the sequence with it."""

    seq: Any
    token: int
    logprob: float
    reason: str | None
    top: Any = None  # the sampler's Choice with this token's alternatives (top_n_tokens / top_logprobs), if asked


@dataclass
class Failure:
    """A sequence the engine failed: the error goes out after every token queued before it."""

    seq: Any
    error: Any


class TokenOutput:
    """A worker thread (or, before :meth:`start`, the caller's thread) that handles :class:`ChosenToken`\\ s and
    :class:`Failure`\\ s in the order they were put."""

    def __init__(self, handle_token: Callable[[ChosenToken], None], handle_failure: Callable[[Failure], None]):
        self._handle_token = handle_token
        self._handle_failure = handle_failure
        self._queue: queue.SimpleQueue[ChosenToken | Failure | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="loadmaster-detokenizer", daemon=True)
        self._thread.start()

    def put(self, item: ChosenToken | Failure) -> None:
        if self._thread is None:
            self._handle(item)
        else:
            self._queue.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Handle everything queued, then end the worker."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def _handle(self, item: ChosenToken | Failure) -> None:
        try:
            if isinstance(item, ChosenToken):
                self._handle_token(item)
            else:
                self._handle_failure(item)
        except Exception:  # noqa: BLE001 - the handlers isolate their own failures; never let the worker die
            log.exception("handling a generated token failed")
