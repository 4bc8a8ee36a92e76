"""The plan and the engine agree on the step: the engine never runs a forward of more tokens than the plan budgets
activations for (:meth:`planner.types.Workload.step_tokens`), because both read one constant."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import planner
from planner.model.skeleton import load_skeleton
from planner.placement.sizing import activation_bytes
from planner.types import PREFILL_CHUNK, Workload
from service.engine import scheduler
from service.engine.engine import Engine
from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 256])  # the default step, and a tight box's smaller one
def test_the_engine_prefills_the_chunk_the_plan_budgets(tiny_llama: Path, chunk: int) -> None:
    assert scheduler.PREFILL_CHUNK is PREFILL_CHUNK  # one definition, not two equal numbers
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    widths: list[int] = []

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            widths.append(int(ids.numel()))

    model.register_forward_pre_hook(count, with_kwargs=True)
    batch = 8
    engine = Engine(
        model, tok, max_batch_size=batch, max_queue=16, max_total_tokens=1000, prefix_cache=False, prefill_chunk=chunk
    )
    try:
        # 3280 prompt tokens in all, over one step's; each under LONG_PROMPT_CONTEXT, so they are packed together
        long_prompt = tok("the sea " * 300)["input_ids"][:480]
        requests = [GenerationRequest(prompt_ids=long_prompt[: 480 - 20 * i], max_new_tokens=8) for i in range(batch)]
        sinks = [queue.Queue() for _ in requests]
        for req, sink in zip(requests, sinks):  # queued before the loop starts: one wave, admitted together
            engine.submit(req, sink.put)
        engine.start()
        for sink in sinks:
            while not isinstance(ev := sink.get(timeout=120), (FinishEvent, ErrorEvent)):
                pass
            assert isinstance(ev, FinishEvent), ev
    finally:
        engine.stop()
    workload = Workload(dtype="float32", batch_size=batch, context=1000, prefill_chunk=chunk)
    assert max(widths) > chunk // 2, "the wave was prefilled together, in steps of up to the plan's chunk"
    assert max(widths) <= workload.step_tokens() < batch * 1000


def test_a_served_plan_budgets_the_engines_step_not_a_whole_batch_prefill(tiny_llama: Path) -> None:
    whole = planner.plan(str(tiny_llama), max_memory={"cpu": "1GiB"}, batch_size=8, context=1024)
    served = planner.plan(
        str(tiny_llama), max_memory={"cpu": "1GiB"}, batch_size=8, context=1024, prefill_chunk=PREFILL_CHUNK
    )
    skeleton = load_skeleton(str(tiny_llama))
    step = activation_bytes(skeleton, served.workload)
    assert served.workload.step_tokens() == PREFILL_CHUNK + 8
    assert step * 8 * 1024 == activation_bytes(skeleton, whole.workload) * (PREFILL_CHUNK + 8)
    assert sum(b.activations for b in served.budgets) < sum(b.activations for b in whole.budgets)
