"""Log-probabilities of a prompt's own tokens (TGI's ``decoder_input_details``, OpenAI's ``echo`` + ``logprobs``).

The batched prefill keeps only the last position's logits (``logits_to_keep=1``), so a request that asks for its
prompt's logprobs gets one more forward over its prompt, with no cache, on the engine thread. Only such requests pay
for it; the others are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.sampling import Choice, TokenLogprob


@torch.inference_mode()
def prompt_logprobs(
    model: torch.nn.Module, device: torch.device, ids: Sequence[int], top_n: int = 0
) -> list[Choice | None]:
    """For each prompt token, its log-probability given the tokens before it and the ``top_n`` likeliest tokens
    at that position. The first token has nothing before it: ``None``."""
    if len(ids) < 2:
        return [None] * len(ids)
    inputs = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logits = model(input_ids=inputs, use_cache=False).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = inputs[0, 1:].to(logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in chosen]
    top_lps: list[list[float]] = [[] for _ in chosen]
    if top_n:
        values, idx = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
        top_ids, top_lps = idx.tolist(), values.tolist()
    out: list[Choice | None] = [None]
    for token, lp, tids, tlps in zip(targets.tolist(), chosen, top_ids, top_lps):
        out.append(Choice(token=token, logprob=lp, top=tuple(TokenLogprob(i, v) for i, v in zip(tids, tlps))))
    return out
