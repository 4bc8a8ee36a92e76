"""Reasoning apart from the answer: ``<think>…</think>`` (Qwen3, DeepSeek-R1, QwQ) becomes ``reasoning_content``.

A template thinks when it writes ``<think>``. The output may open the block itself (Qwen3), or the prompt already
did (DeepSeek-R1's generation prompt ends in ``<think>\\n``); either way what comes before ``</think>`` is
reasoning and what follows is content. A prompt that closed the block already (Qwen3 with ``enable_thinking:
false``) leaves all of the output content. Streamed pieces are split as they come; a piece that may begin a
marker is held back until the next one settles it.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    return bool(template) and CLOSE in template  # type: ignore[operator]


def _partial(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that begin ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One sequence's output split into (reasoning, content) pieces."""

    def __init__(self, prompt_text: str):
        tail = prompt_text.rstrip()
        self._state = "reasoning" if tail.endswith(OPEN) else "start"
        if tail.endswith(CLOSE):
            self._state = "content"
        self._held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning = content = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self._state, text = "reasoning", stripped[len(OPEN) :]
            elif OPEN.startswith(stripped) and not final:
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = text.find(CLOSE)
            if at >= 0:
                reasoning, text = text[:at], text[at + len(CLOSE) :].lstrip()
                self._state = "content"
            else:
                keep = 0 if final else _partial(text, CLOSE)
                reasoning, self._held = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
        content = text
        return reasoning, content


def split_reasoning(prompt_text: str, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning or ``None``, content)."""
    splitter = ReasoningSplitter(prompt_text)
    reasoning, content = splitter.feed(text, final=True)
    started = prompt_text.rstrip().endswith(OPEN) or text.lstrip().startswith(OPEN)
    return (reasoning if started else None), content
