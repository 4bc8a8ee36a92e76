"""How many prompt tokens the next step prefills: vLLM's ``max_num_batched_tokens``, adapted to the queue and to
the step times the engine measures.

The most is :data:`planner.types.PREFILL_CHUNK`, the step the plan budgets activations for (one definition: the
planner's :meth:`~planner.types.Workload.step_tokens` covers it). Below that:

- **No stream is decoding, or a wave is waiting** (at least as many prompts still to prefill as streams
  decoding): the whole ceiling. A burst of prompts is then prefilled together, in one or two steps, and every
  prompt of it reaches its first token at about the time one batched prefill of the wave takes, instead of one
  chunk per prompt in turn (the last of 16 prompts waiting out 8 steps while the first streams). The streams
  already decoding wait out that one longer step once; the wave's streams then decode beside them.
- **Streams are decoding and few prompts wait:** as many tokens as fit in :data:`ITL_TARGET_S` beside the decode
  rows, from the measured seconds per prompt token and per decode-only step (moving averages), at least
  :data:`MIN_PREFILL`: a long prompt is spread over steps that keep the streams' inter-token latency bounded.
  On a fast device the ceiling fits and is used; on a contended CPU, fewer tokens.
"""

from __future__ import annotations

#: Step time to keep decoding streams within while a prompt is prefilled beside them (seconds): about the step of
#: the engine's former fixed 256-token chunk of the 100M fp32 Llama on the 2-core test machine (1-2 ms a token).
ITL_TARGET_S = 0.4
#: The fewest prompt tokens a step with decode rows prefills (a prompt always progresses).
MIN_PREFILL = 64
#: Weight of the newest step in the moving averages.
SMOOTHING = 0.3


class PrefillBudget:
    """Measured step costs and the prefill budget they give, at most the ``ceiling`` each call passes (the
    scheduler's :data:`~planner.types.PREFILL_CHUNK`)."""

    def __init__(self, itl_target_s: float = ITL_TARGET_S):
        self.itl_target_s = itl_target_s
        self.per_token_s: float | None = None  # seconds one prompt token adds to a step
        self.decode_s: float | None = None  # seconds of a step of decode rows alone
        self.last: int | None = None  # the budget last given (for /info)

    def tokens(self, ceiling: int, *, decoders: int, prompts: int) -> int:
        """The prefill budget of a step with ``decoders`` decode rows while ``prompts`` sequences still prefill."""
        if decoders == 0 or prompts >= decoders or self.per_token_s is None:
            budget = ceiling
        else:
            room = self.itl_target_s - (self.decode_s or 0.0)
            budget = max(MIN_PREFILL, int(room / self.per_token_s)) if room > 0 else MIN_PREFILL
        self.last = min(ceiling, budget)
        return self.last

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """A step ran ``prefill_tokens`` prompt tokens beside ``decodes`` decode rows in ``seconds``."""
        if prefill_tokens == 0:
            if decodes:
                self.decode_s = _blend(self.decode_s, seconds)
            return
        overhead = (self.decode_s or 0.0) if decodes else 0.0
        per_token = max(seconds - overhead, 0.0) / prefill_tokens
        self.per_token_s = _blend(self.per_token_s, per_token)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
