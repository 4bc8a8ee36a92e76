"""Greedy generation over the pipeline without a server: rank 0's engine over a :class:`PipelineModel`.

:class:`PipelineDriver` is what ``python -m service.cli.pipeline_command`` and ``bench/pipeline.py`` run on rank 0
while ranks 1..k-1 run :func:`~service.pipeline.stage_loop.serve_stage`: the engine (slot cache, batching, greedy
choice) and the ring of ``loadmaster serve --pipeline``, fed token ids and giving token ids back. Each prompt gets
exactly ``max_new_tokens`` tokens, each the argmax of its logits (an end-of-sequence token does not stop it); the
prompts of a call are admitted together and each is prefilled whole (no prefix reuse), so a step's rows go round
the ring split into the plan's micro-batches.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from loaders.pipeline_stage import StageModel
from planner.cluster import ClusterPlan
from service.engine.engine import Engine, ErrorEvent, Event, FinishEvent, GenerationRequest
from service.errors import GenerationError
from service.pipeline.stage_model import PipelineModel
from service.pipeline.wire import PipelineBrokenError


class _TokenIdsOnly:
    """The engine's tokenizer here: token ids in and out, no text (the caller decodes), no special ids."""

    eos_token_id = None
    all_special_ids: tuple[int, ...] = ()

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return ""


class _Outcome:
    """One prompt's generated ids, or the error that ended it, once its last event has arrived."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()

    def take(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            self.tokens = [t.id for t in event.tokens]
            self.done.set()
        elif isinstance(event, ErrorEvent):
            self.error = event.message
            self.done.set()


class PipelineDriver:
    """Rank 0: greedy generation through the engine and the ring. Call :meth:`generate_greedy`, then :meth:`stop`.

    ``micro_batches``: the ring's split of a step's rows (default: the plan's). ``delay_s``: a test-only slow
    stage 0 (:class:`~service.pipeline.stage_loop.StageClock`).
    """

    def __init__(self, stage: StageModel, plan: ClusterPlan, micro_batches: int | None = None, delay_s: float = 0.0):
        self.model = PipelineModel(stage, plan, micro_batches or plan.micro_batches, delay_s=delay_s)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """``max_new_tokens`` greedy token ids after each prompt (token ids).

        Raises :class:`~service.pipeline.wire.PipelineBrokenError` when the ring broke (the group must be restarted),
        :class:`~service.errors.GenerationError` when a prompt's generation failed otherwise."""
        if not prompts:
            return []
        if max_new_tokens < 1 or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token, and max_new_tokens must be at least 1")
        engine = Engine(
            self.model,
            _TokenIdsOnly(),
            max_batch_size=len(prompts),
            max_queue=len(prompts),
            max_total_tokens=max(len(p) for p in prompts) + max_new_tokens,
            prefix_cache=False,
        )
        outcomes = [_Outcome() for _ in prompts]
        for i, (prompt, outcome) in enumerate(zip(prompts, outcomes)):
            ids = [int(t) for t in prompt]
            request = GenerationRequest(ids, max_new_tokens, request_id=f"greedy-{i}", ignore_eos=True)
            engine.submit(request, outcome.take)
        engine.start()  # after every submit: the prompts are admitted together and prefilled in one step
        try:
            for outcome in outcomes:
                outcome.done.wait()
        finally:
            engine.stop()
        if self.model.broken is not None:
            raise PipelineBrokenError(self.model.broken)
        for i, outcome in enumerate(outcomes):
            if outcome.error is not None:
                raise GenerationError(f"prompt {i}: {outcome.error}")
        return [outcome.tokens for outcome in outcomes]

    def stop(self) -> None:
        """Tell every other rank to end its stage loop."""
        self.model.stop()
