"""Prompt lookup decoding: draft tokens for a sequence from its own text, with no model and no extra weights.

Text that repeats itself (code, quoted passages, lists, a summary of the prompt) continues the way an earlier
occurrence of its last few tokens continued. So the drafter finds the most recent earlier occurrence of the
sequence's last ``n`` tokens (``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`: a longer match is a better
predictor) in the prompt and the output so far, and proposes the up to ``k`` tokens that followed it. When nothing
matches it proposes nothing, and the row decodes one token as it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Longest and shortest suffix the drafter looks up (prompt lookup decoding's usual 3..1).
MAX_NGRAM = 3
MIN_NGRAM = 1

#: Only the most recent tokens are searched, so drafting stays cheap on a long context (a linear scan per step).
SEARCH_WINDOW = 4096


def propose(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of ``tokens``
    (``max_ngram`` .. ``min_ngram`` tokens long) found earlier in ``tokens``; empty when none is found."""
    if k <= 0:
        return []
    total = len(tokens)
    lo = max(0, total - SEARCH_WINDOW)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = list(tokens[total - n :])
        # latest start first: the nearest repetition is the likeliest continuation; the suffix itself is excluded
        for start in range(total - n - 1, lo - 1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []
