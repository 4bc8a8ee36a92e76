"""Stop sequences, found in generated text as it grows, including ones that span several tokens' text.

The matcher sees the text piece by piece and keeps only the last ``longest stop - 1`` characters between pieces:
enough for a stop sequence that began in earlier text and ends in the new piece, and nothing more, so each piece
costs the same however long the sequence has grown. Streams that must not show a stop sequence (OpenAI's) hold the
same number of characters back (:class:`StopHoldback`) until the sequence's end says where the text stops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """A stop sequence found in the text: ``at`` is where it starts, counted from the start of all the text."""

    stop: str
    at: int

    @property
    def end(self) -> int:
        """Where the stop sequence ends: generated text is cut here (the OpenAI routes cut at ``at``)."""
        return self.at + len(self.stop)


def lookback(stops: tuple[str, ...] | list[str]) -> int:
    """Characters of earlier text a stop sequence completed by new text can start in: the longest stop, less one."""
    return max((len(s) for s in stops), default=1) - 1


class StopMatcher:
    """Finds the first of ``stops`` to appear in the text fed to it, piece by piece."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty; drop it from the request's stop list")
        self.stops = tuple(stops)
        self._keep = lookback(self.stops)
        self._tail = ""  # the end of the text seen so far that a stop sequence could still start in
        self._offset = 0  # where _tail starts in all the text

    def feed(self, piece: str) -> StopMatch | None:
        """Add ``piece`` to the text; return the earliest stop sequence now in it, if any.

        Two stops starting at the same place resolve to the shorter one (it completed first).
        """
        if not self.stops or not piece:
            return None
        window = self._tail + piece
        hits = [(i, s) for s in self.stops if (i := window.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            return StopMatch(stop=stop, at=self._offset + at)
        keep = min(self._keep, len(window))
        self._offset += len(window) - keep
        self._tail = window[len(window) - keep :]
        return None


class StopHoldback:
    """Streams text without ever emitting the start of a stop sequence that may still complete.

    Each piece is released once :func:`lookback` characters follow it; the final text (cut where the stop sequence
    starts) releases the rest.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.keep = lookback(stops)
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> str:
        self.text += piece
        safe = max(self.sent, len(self.text) - self.keep)
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self, final_text: str) -> str:
        out = final_text[self.sent :]
        self.sent = len(final_text)
        return out
