"""Log-probabilities of a prompt's own tokens (TGI's ``decoder_input_details``, OpenAI's ``echo`` + ``logprobs``),
taken from the prefill's own logits.

A request that asks for them has its prefill rows keep the logits after every prompt token (the other rows keep
only their last token's), so no second forward runs: each prefill chunk's logits score the prompt tokens that follow
them, chunk after chunk. Such a prompt is prefilled whole (no prefix reused from the cache): a reused token has no
logits of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.sampling import Choice, TokenLogprob


def score_prompt_tokens(logits: torch.Tensor, targets: Sequence[int], top_n: int = 0) -> list[Choice]:
    """The log-probability of each of ``targets`` under the logits row before it (``logits[i]`` scores
    ``targets[i]``; rows past the last target are ignored) and the ``top_n`` likeliest tokens at that position."""
    n = len(targets)
    if n == 0:
        return []
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)
    wanted = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in chosen]
    top_lps: list[list[float]] = [[] for _ in chosen]
    if top_n:
        values, idx = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
        top_ids, top_lps = idx.tolist(), values.tolist()
    return [
        Choice(token=token, logprob=lp, top=tuple(TokenLogprob(i, v) for i, v in zip(tids, tlps)))
        for token, lp, tids, tlps in zip(targets, chosen, top_ids, top_lps)
    ]
