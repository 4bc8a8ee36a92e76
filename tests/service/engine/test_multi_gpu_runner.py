"""The engine's device-pipeline runner on stand-in devices (runs that all compute on the CPU): its logits equal the
plain model runner's for batched decode rows and for packed rows (prefill chunks next to decode rows, a row asking
for every token's logits), each micro-batch carrying its own bound view of the shared slot cache; and when the
model cannot run pipelined, the plain runner is used, with the reason, and an explicit ``--micro-batches`` is
refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import ModelRunner, Row, RunOutput
from service.engine.multi_gpu_runner import PipelinedRunner, make_runner

PROMPTS = ["Once upon a time there was a river", "Hello", "The sea was calm and the night was long", "Rain fell"]
CPU = torch.device("cpu")


def _same(got: RunOutput, want: RunOutput) -> None:
    torch.testing.assert_close(got.last, want.last, atol=1e-5, rtol=1e-5)
    assert set(got.every) == set(want.every)
    for b in want.every:
        torch.testing.assert_close(got.every[b], want.every[b], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("runs", "micro_batches"), [(2, 2), (3, 3), (3, 1)])
def test_pipelined_logits_equal_the_plain_runners_for_batched_and_packed_rows(
    tiny_llama: Path, runs: int, micro_batches: int
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    plain = ModelRunner(model, CPU, SlotKVCache(slots=6, max_len=128))
    piped, report = make_runner(
        model, CPU, SlotKVCache(slots=6, max_len=128), micro_batches=micro_batches, standin_runs=runs
    )
    try:
        assert isinstance(piped, PipelinedRunner) and report.active and report.standin
        assert report.runs == runs and report.micro_batches == micro_batches
        assert [a for a, _ in report.layers] == sorted({r.first for r in piped.runs})
        slots = [4, 0, 2, 5]  # scattered: each micro-batch's view gathers its own rows
        # packed: whole prompts of different widths, one asking for every token's logits
        rows = [Row(s, 0, p, every_logits=(i == 2)) for i, (s, p) in enumerate(zip(slots, prompts))]
        want = plain.run(rows)
        _same(piped.run(rows), want)
        tokens = [[int(t)] for t in want.last.argmax(-1)]
        positions = [len(p) for p in prompts]
        for _ in range(4):  # batched: decode rows of one width, every one in its own slot
            rows = [Row(s, pos, seq[-1:]) for s, pos, seq in zip(slots, positions, tokens)]
            want = plain.run(rows)
            _same(piped.run(rows), want)
            for seq, t in zip(tokens, want.last.argmax(-1).tolist()):
                seq.append(t)
            positions = [p + 1 for p in positions]
        # packed again: decode rows next to a new prompt's chunk in slot 1
        rows = [Row(s, pos, seq[-1:]) for s, pos, seq in zip(slots, positions, tokens)]
        rows.insert(1, Row(1, 0, prompts[0][:5], every_logits=True))
        _same(piped.run(rows), plain.run(rows))
        assert piped.steps == 6 and piped.forwards >= 6
    finally:
        piped.close()
    assert isinstance(model.model.layers[0], type(model.model.layers[1]))  # the layers are put back
    assert not any(w.thread.is_alive() for w in piped.schedule.workers)


def test_a_model_on_one_device_runs_plain_and_an_explicit_micro_batches_is_refused_by_name(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner, report = make_runner(model, CPU, SlotKVCache(slots=2, max_len=16))
    assert type(runner) is ModelRunner and not report.active and report.runs == 0
    assert "every decoder layer is on" in report.reason
    with pytest.raises(ValueError, match=r"--micro-batches 2 \(LOADMASTER_MICRO_BATCHES\) .* device pipeline is off"):
        make_runner(model, CPU, SlotKVCache(slots=2, max_len=16), micro_batches=2)


def test_a_map_over_two_gpus_is_read_as_two_runs_and_a_map_with_offload_is_not(tiny_llama: Path) -> None:
    """Which runner a device map asks for, read from the map alone (no GPU is touched: the CPU layers only carry
    GPU labels here, and the runner is closed before any forward)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    model.hf_device_map = {"model.embed_tokens": 0, **{f"model.layers.{i}": int(i >= n // 2) for i in range(n)}}
    from service.engine.multi_gpu_runner import _layout

    plain = ModelRunner(model, CPU, SlotKVCache(slots=1, max_len=8))
    container, labels = _layout(model, plain, None)
    assert container == "model.layers" and labels == [int(i >= n // 2) for i in range(n)]
    model.hf_device_map["model.layers.0"] = "disk"
    assert "disk next to GPUs" in _layout(model, plain, None)


def test_a_model_whose_layers_take_positional_arguments_runs_plain_with_the_reason(tiny_gpt2: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    runner, report = make_runner(model, CPU, SlotKVCache(slots=2, max_len=16), standin_runs=2)
    assert type(runner) is ModelRunner and not report.active
    assert "positional arguments" in report.reason
    assert type(model.transformer.h[0]).__name__ == "GPT2Block"  # the capture was taken out again
    with pytest.raises(ValueError, match="--micro-batches 3 cannot be honoured: .*positional arguments"):
        make_runner(model, CPU, SlotKVCache(slots=2, max_len=16), micro_batches=3, standin_runs=2)
