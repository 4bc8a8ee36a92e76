"""Prompt lookup decoding: draft tokens for a sequence from its own text, with no model and no extra weights.

Text that repeats itself (code, quoted passages, lists, a summary of the prompt) continues the way an earlier
occurrence of its last few tokens continued. So the drafter finds the most recent earlier occurrence of the
sequence's last ``n`` tokens (``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`: a longer match is a better
predictor) in the prompt and the output so far, and proposes the up to ``k`` tokens that followed it. When nothing
matches it proposes nothing, and the row decodes one token as it would without speculation.

A scan of the whole context per step would cost a running row O(context) Python work every decode step, drafts or
not; :class:`NgramIndex` keeps, per sequence, where each n-gram last ended, updated as tokens are appended, so a
step's lookup is a few dictionary reads.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Longest and shortest suffix the drafter looks up (prompt lookup decoding's usual 3..1).
MAX_NGRAM = 3
MIN_NGRAM = 1


class NgramIndex:
    """One sequence's n-grams (``min_ngram`` .. ``max_ngram`` tokens) and where the latest occurrence of each was
    followed. Its sequence only grows: :meth:`propose` indexes the tokens appended since the last call."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        self._indexed = 0  # n-grams ending before this position are in ``_follows``

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of ``tokens``
        (``max_ngram`` .. ``min_ngram`` tokens long); empty when none occurred before."""
        total = len(tokens)
        # every n-gram ending before the last token: the suffix itself is not an earlier occurrence
        for end in range(self._indexed, total - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._follows[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, total - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            at = self._follows.get(tuple(tokens[total - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []


def propose(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """:meth:`NgramIndex.propose` on ``tokens`` at once (no state kept)."""
    return NgramIndex(max_ngram, min_ngram).propose(tokens, k)
