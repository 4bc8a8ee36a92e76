"""The executor: runs what the scheduler chose for one forward, chooses the next tokens and hands them on.

Given a :class:`~service.engine.scheduler.SchedulerOutput`'s rows it makes one call to the model runner
(:mod:`service.engine.model_runner`), tells the scheduler the rows' tokens are now in their slots, scores the prompt
tokens of requests that asked for their logprobs (from the prefill's own logits), and has every decode row and every
sequence whose prompt is now complete choose its next token in one batched pass
(:func:`service.engine.sampling.choose_batch`). Chosen tokens go to the output thread
(:class:`~service.engine.token_output.TokenOutput`), which detokenizes them, matches stop sequences and sends the
events; this module also holds that thread's handlers, so all event emission lives in one place.

A step that raises fails only the requests at fault: the batch is retried in halves
(:mod:`service.engine.isolation`); out of memory fails the step's requests (the batch's size is at fault); an
unrecoverable device error stops the engine (``on_unrecoverable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from loaders.errors import WeightsChangedError
from service.engine.isolation import is_out_of_memory, is_unrecoverable, isolate_failure
from service.engine.prompt_logprobs import score_prompt_tokens
from service.engine.requests import EngineMetrics, Sequence
from service.engine.sampling import choose_batch, target_distributions
from service.engine.scheduler import ScheduledRow
from service.engine.speculation.verification import Speculator, Verdict, accepted, sampled
from service.engine.token_output import ChosenToken, Failure, TokenOutput
from service.errors import GenerationError, NotReadyError, ServiceError

if TYPE_CHECKING:  # the multi-GPU runner is imported only by an engine that makes one (see Engine.__init__)
    from service.engine.multi_gpu_runner import Runner

log = logging.getLogger(__name__)


class StepExecutor:
    """Runs forwards and choices for the engine thread, and emits events on the output thread.

    ``record_forward`` is the scheduler's (:meth:`~service.engine.scheduler.Scheduler.record_forward`), called after
    every forward that succeeded, retries of a half included. ``on_unrecoverable(seqs, error)`` is the engine's: it
    stops the loop and fails every request, after this step's own sequences.
    """

    def __init__(
        self,
        runner: Runner,
        metrics: EngineMetrics,
        *,
        record_forward: Callable[[list[ScheduledRow]], None],
        on_unrecoverable: Callable[[list[Sequence], ServiceError], None],
        speculator: Speculator | None = None,
        trim: Callable[[Sequence], None] | None = None,
    ):
        self.runner = runner
        self.speculator = speculator or Speculator()
        self._trim = trim or (lambda seq: None)
        self.metrics = metrics
        self._record_forward = record_forward
        self._on_unrecoverable = on_unrecoverable
        self.output = TokenOutput(self._emit, self._emit_failure)
        #: Why the engine stopped for good (an unrecoverable CUDA error), or None.
        self.dead: str | None = None
        #: An OOM asked for the allocator's cache back, once the failed step is gone (the engine's loop does it).
        self.release_memory = False

    # -- engine thread -------------------------------------------------------------------------------------------
    def execute(self, rows: list[ScheduledRow]) -> None:
        """One forward over decode rows and prompt chunks; then every decode row, and every sequence whose prompt
        is now complete, chooses its next token in one batched pass."""
        try:
            out = self.runner.run([s.row for s in rows])
        except Exception as exc:  # noqa: BLE001 - reported to the clients, logged with their request ids
            seqs = [s.seq for s in rows]
            self._step_failed(seqs, exc, _where(rows), retry=lambda part: self.execute(_only(rows, part)))
            return
        self._record_forward(rows)
        choosing: list[int] = []
        verifying: list[int] = []
        for r, scheduled in enumerate(rows):
            seq, row = scheduled.seq, scheduled.row
            if not scheduled.prefill:
                if seq.cancelled.is_set() or seq.done:
                    seq.done = True
                    continue
                (verifying if scheduled.drafts else choosing).append(r)
                continue
            if row.every_logits:
                prompt = seq.request.prompt_ids
                targets = prompt[row.start + 1 : row.start + len(row.tokens) + 1]
                seq.prompt_scores += score_prompt_tokens(out.every[r], targets, seq.request.top_n_tokens)
            if not seq.prefilling:
                if seq.request.prompt_logprobs:
                    seq.set_prompt_logprobs(seq.prompt_scores)
                choosing.append(r)
        if verifying:
            self._verify([rows[r] for r in verifying], [out.every[r] for r in verifying])
        if not choosing:
            return
        chosen = [rows[r] for r in choosing]
        self._choose(out.last[choosing] if len(choosing) < len(rows) else out.last, chosen)

    def _verify(self, rows: list[ScheduledRow], logits: list[torch.Tensor]) -> None:
        """Speculative rows (:mod:`service.engine.speculation.verification`): the greedy rows' choices after each fed token in one
        batched pass (without penalties or grammar a choice depends on its logits alone), the sampled rows' by the
        accept/resample rule; then each row keeps its accepted drafts and the target's next token, recorded one by
        one so that an end of sequence or the length limit stops it where plain decoding would; the slot's record is
        cut back to them."""
        seqs = [s.seq for s in rows]
        try:
            verdicts = self._verdicts(rows, logits)
        except Exception as exc:  # noqa: BLE001
            self._step_failed(seqs, exc, "verify step")
            return
        for scheduled, verdict in zip(rows, verdicts):
            seq = scheduled.seq
            emitted = 0
            for choice in verdict.choices:
                self._chosen(seq, choice.token, choice.logprob)
                emitted += 1
                if seq.done:
                    break
            self.speculator.observe(seq, len(scheduled.drafts), verdict.accepted, emitted)
            self.metrics.speculated(len(scheduled.drafts), verdict.accepted)
            self._trim(seq)

    @staticmethod
    def _verdicts(rows: list[ScheduledRow], logits: list[torch.Tensor]) -> list[Verdict]:
        """Each speculative row's :class:`~service.engine.speculation.verification.Verdict`, greedy rows batched in one pass."""
        verdicts: list[Verdict | None] = [None] * len(rows)
        greedy = [i for i, s in enumerate(rows) if not s.seq.chooser.params.sampling]
        if greedy:
            choosers = [rows[i].seq.chooser for i in greedy for _ in range(logits[i].shape[0])]
            choices = choose_batch(torch.cat([logits[i] for i in greedy]), choosers)
            at = 0
            for i in greedy:
                n = logits[i].shape[0]
                verdicts[i] = accepted(rows[i].drafts, choices[at : at + n])
                at += n
        for i, scheduled in enumerate(rows):
            if verdicts[i] is None:
                chooser = scheduled.seq.chooser
                logprobs, probs = target_distributions(logits[i], [chooser] * logits[i].shape[0])
                verdicts[i] = sampled(scheduled.drafts, probs, logprobs, chooser.generator)
        return verdicts  # type: ignore[return-value]

    def _choose(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> None:
        """Choose the next token of each row of ``logits`` (one per item of ``rows``), in one batched pass; each
        row's alternatives stay on its chooser (``chooser.last``)."""
        seqs = [s.seq for s in rows]
        try:
            choices = choose_batch(logits, [s.chooser for s in seqs])
        except Exception as exc:  # noqa: BLE001
            self._step_failed(
                seqs, exc, _where(rows), retry=lambda part: self._choose(logits[_rows(seqs, part)], _only(rows, part))
            )
            return
        now = time.perf_counter()
        first = []
        for scheduled, choice in zip(rows, choices):
            if scheduled.prefill:
                self.metrics.first_token(now - scheduled.seq.enqueued_at)
                first.append(scheduled.seq.request.request_id)
            self._chosen(scheduled.seq, choice.token, choice.logprob)
        if first:
            log.debug("request(s) %s prefilled", ", ".join(first))

    def _chosen(self, seq: Sequence, token: int, logprob: float) -> None:
        """Record ``token`` for ``seq`` (engine side) and queue it, with its alternatives, for the output thread.
        A token the grammar refuses ends only that sequence."""
        top = seq.alternatives(token)
        try:
            reason = seq.record(token)
        except GenerationError as exc:
            self.fail(seq, exc)
            return
        self.output.put(ChosenToken(seq, token, logprob, reason, top))

    def fail(self, seq: Sequence, error: ServiceError) -> None:
        """End ``seq`` now (its slot is freed) and send ``error`` after the tokens already queued for it."""
        if not seq.done or not seq.finished:
            seq.done = True
            self.output.put(Failure(seq, error))

    def _step_failed(
        self,
        seqs: list[Sequence],
        exc: Exception,
        where: str,
        retry: Callable[[list[Sequence]], None] | None = None,
    ) -> None:
        """A batched step failed: an unrecoverable device error stops the engine; otherwise the batch is retried in
        halves (``retry``, :func:`service.engine.isolation.isolate_failure`) so only the culprit fails; a batch of
        one, or out of memory (the batch's size is at fault), fails its requests with the reason."""
        ids = ", ".join(s.request.request_id for s in seqs)
        if is_unrecoverable(exc):
            log.critical("unrecoverable CUDA error in %s; the engine stops", where, exc_info=exc)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.dead = (
                f"The GPU hit an unrecoverable error during the {where} ({first}); the engine has stopped and "
                "readiness answers 503. Restart the server; if it recurs, report it with the server log."
            )
            self._on_unrecoverable(seqs, NotReadyError(self.dead))
            return
        if isinstance(exc, WeightsChangedError):  # every later step would read the same lost weights
            log.critical("the weights changed on disk during the %s; the engine stops: %s", where, exc)
            self.dead = str(exc)
            self._on_unrecoverable(seqs, NotReadyError(self.dead))
            return
        if retry is not None and not is_out_of_memory(exc):
            if isolate_failure(seqs, where, lambda part: None if self.dead else retry(part)):
                return
        if is_out_of_memory(exc):
            log.error("out of memory in %s; failing request(s) %s", where, ids)
            # the allocator's cache is released by the loop, after this step: the failed group's KV cache and the
            # exception's frames still hold device memory here
            self.release_memory = torch.cuda.is_available()
            message = (
                f"Out of memory during the {where} of a batch of {len(seqs)}; the request was dropped. "
                "Retry with fewer tokens, or lower --max-batch-size / --max-total-tokens on the server."
            )
        else:
            log.error("generation failed in %s for request(s) %s", where, ids, exc_info=exc)
            message = f"Generation failed during the {where}: {type(exc).__name__}. The server logged the details."
        for seq in seqs:
            if not seq.done:
                self.fail(seq, GenerationError(message))

    # -- output thread -------------------------------------------------------------------------------------------
    def _emit(self, chosen: ChosenToken) -> None:
        """``seq.emit``, isolated: a failure there (a detokenizer error, a broken sink) ends only that sequence."""
        seq = chosen.seq
        try:
            finish = seq.emit(chosen.token, chosen.logprob, chosen.reason, chosen.top)
        except Exception:  # noqa: BLE001
            log.exception(
                "request %s: handling a generated token failed; dropping the sequence", seq.request.request_id
            )
            try:
                seq.fail(GenerationError("Generation failed while decoding a token; the server logged the details."))
            except Exception:  # noqa: BLE001 - the sink itself is what failed
                seq.finished = True
            return
        if finish is not None:
            self.metrics.tokens(finish.prompt_tokens, finish.generated_tokens)
            seq.sink(finish)

    @staticmethod
    def _emit_failure(failure: Failure) -> None:
        failure.seq.fail(failure.error)


def _where(rows: list[ScheduledRow]) -> str:
    """What a failed step was, for its error message."""
    kinds = {s.prefill for s in rows}
    return "prefill and decode step" if len(kinds) == 2 else ("prefill" if True in kinds else "decode step")


def _only(rows: list[ScheduledRow], part: list[Sequence]) -> list[ScheduledRow]:
    """The rows of the sequences in ``part`` (by identity), in their order."""
    keep = {id(seq) for seq in part}
    return [s for s in rows if id(s.seq) in keep]


def _rows(seqs: list[Sequence], part: list[Sequence]) -> list[int]:
    """The row indices in ``seqs`` of the sequences in ``part`` (by identity)."""
    index = {id(seq): r for r, seq in enumerate(seqs)}
    return [index[id(seq)] for seq in part]
