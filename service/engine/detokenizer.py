"""Incremental detokenization: the text each newly generated token adds, never half a character.

Decoding one token alone is wrong in two ways: a character can span tokens (UTF-8 bytes split by a byte-level BPE,
byte-fallback pieces), and some decoders drop or add a leading space depending on what comes before (SentencePiece's
"▁"). So a detokenizer decodes each token in the context of a few tokens before it, and holds text back while it ends
in an incomplete character.

Where the tokenizer is a ``tokenizers`` one, that work is ``tokenizers.decoders.DecodeStream`` (the same algorithm,
in Rust, one call per token). Otherwise (a Python tokenizer, a tokenizer that cleans up spaces after decoding, a
``tokenizers`` too old to be seeded with context) the same algorithm runs here on ``tokenizer.decode``. Either way the
last token of a sequence flushes whatever is held back, so a sequence that ends mid-character still reports its bytes
(as U+FFFD), exactly as decoding the whole sequence would.
"""

from __future__ import annotations

from typing import Any, Protocol

#: Tokens of the prompt kept as context for the first generated tokens (keeps their leading spaces right).
PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    """Turns generated token ids, one at a time, into the text each adds."""

    def push(self, token: int, final: bool = False) -> str:
        """The new text ``token`` completes (may be empty); with ``final``, also everything still held back."""
        ...


def make_detokenizer(
    tokenizer: Any, prompt_ids: list[int], *, streaming: bool = True, skip_special_tokens: bool = True
) -> Detokenizer:
    """The detokenizer for one sequence: ``tokenizers``' DecodeStream where the tokenizer allows, else the fallback.

    ``streaming=False`` forces the fallback (tests compare the two on the same tokens). ``skip_special_tokens=False``
    keeps special tokens' text (tool-call markers that are special tokens, vLLM's option).
    """
    context = list(prompt_ids[-PROMPT_CONTEXT:])
    if streaming and stream_decodable(tokenizer):
        return StreamDetokenizer(tokenizer, context, skip_special_tokens)
    return OffsetDetokenizer(tokenizer, context, skip_special_tokens)


def stream_decodable(tokenizer: Any) -> bool:
    """Whether DecodeStream gives this tokenizer's ``decode`` output: a ``tokenizers`` backend and no clean-up pass."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - tokenizers is a dependency; DecodeStream needs >= 0.21
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        DecodeStream(ids=[], skip_special_tokens=True)
    except TypeError:  # tokenizers < 0.22 cannot seed the stream with the prompt's context
        return False
    return True


class OffsetDetokenizer:
    """The fallback: decode the tokens after a prefix offset, and emit what they add beyond the read offset.

    ``ids[prefix:read]`` is text already emitted (kept as context); ``ids[prefix:]`` decodes to it plus the new text.
    When the new text ends in an incomplete character nothing is emitted and the offsets stay, so the next token is
    decoded together with the incomplete one.
    """

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context)
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token: int, final: bool = False) -> str:
        self._ids.append(token)
        return self._advance(final)

    def _advance(self, final: bool) -> str:
        before = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(after) > len(before) and (final or not after.endswith(_REPLACEMENT)):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""


class StreamDetokenizer:
    """``tokenizers.decoders.DecodeStream`` seeded with the prompt's context, one Rust call per token.

    DecodeStream holds back an incomplete character by returning None. The tokens it holds are tracked here, so the
    final token can flush them the way decoding the whole sequence would (incomplete bytes become U+FFFD).
    """

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self._emitted = list(context)[-PROMPT_CONTEXT:]  # the last tokens whose text is out: context for a flush
        self._held: list[int] = []  # tokens whose text DecodeStream still holds back

    def push(self, token: int, final: bool = False) -> str:
        piece = self._stream.step(self._backend, token)
        self._held.append(token)
        if piece is not None:
            self._emitted = (self._emitted + self._held)[-PROMPT_CONTEXT:]
            self._held = []
            return piece
        if not final:
            return ""
        before = self._tokenizer.decode(self._emitted, skip_special_tokens=self._skip)
        after = self._tokenizer.decode(self._emitted + self._held, skip_special_tokens=self._skip)
        self._emitted, self._held = (self._emitted + self._held)[-PROMPT_CONTEXT:], []
        return after[len(before) :] if len(after) > len(before) else ""
