"""The model runner over the slot KV cache: rows prefilled together, in any slots, in chunks, with a prefix copied
from another slot, compute what each prompt would alone in plain transformers; decode rows and prompt chunks share one packed forward
(in bf16 on the native kernels: two, and each row's logits are bit for bit those it gets alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import ModelRunner, Row
from tests.loaders.kernel_paths import native_path  # noqa: F401  (fixture: one run per native kernel path)

PROMPTS = ["Once upon a time there was a river", "Hello", "The sea was calm and the night was long", "Rain fell"]
CPU = torch.device("cpu")
STEPS = 6


def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Plain transformers: the prompt's last logits and its greedy continuation."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(ids).logits[0, -1]
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )
    return logits, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2", "tiny_moe"])
def test_rows_in_scattered_slots_match_each_prompt_alone(request, fixture: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # rows really are padded
    cache = SlotKVCache(slots=6, max_len=64)
    runner = ModelRunner(model, CPU, cache)
    slots = [4, 0, 2, 5]  # not consecutive: the cache gathers the rows
    logits = runner.forward([Row(s, 0, p) for s, p in zip(slots, prompts)])
    got = [[int(t)] for t in logits.argmax(dim=-1)]
    for row, prompt in enumerate(prompts):
        ref_logits, _ = _reference(model, prompt)
        torch.testing.assert_close(logits[row], ref_logits, atol=1e-5, rtol=1e-5)
    positions = [len(p) for p in prompts]
    for _ in range(STEPS - 1):
        step = runner.forward([Row(s, pos, seq[-1:]) for s, pos, seq in zip(slots, positions, got)])
        for seq, t in zip(got, step.argmax(dim=-1).tolist()):
            seq.append(t)
        positions = [p + 1 for p in positions]
    for row, prompt in enumerate(prompts):
        assert got[row] == _reference(model, prompt)[1]


def test_chunked_prefill_and_a_copied_prefix_match_a_whole_prefill(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok(" ".join(PROMPTS * 3))["input_ids"]
    cache = SlotKVCache(slots=3, max_len=256)
    runner = ModelRunner(model, CPU, cache)
    ref_logits, _ = _reference(model, prompt)
    # slot 0: the prompt in chunks of 7, a decode-sized row on the way
    start = 0
    while start < len(prompt):
        chunk = prompt[start : start + 7]
        logits = runner.forward([Row(0, start, chunk)])
        start += len(chunk)
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)
    # slot 2: all but the last 3 tokens copied from slot 0, the rest fed
    cache.copy_prefix(0, 2, 0, len(prompt) - 3)
    logits = runner.forward([Row(2, len(prompt) - 3, prompt[-3:])])
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)
    assert cache.capacity >= len(prompt) and cache.capacity <= 256


def test_a_row_past_the_slot_length_is_refused(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner = ModelRunner(model, CPU, SlotKVCache(slots=1, max_len=8))
    with pytest.raises(ValueError, match="holds 8 per sequence"):
        runner.forward([Row(0, 5, [1, 2, 3, 4])])


def test_decode_rows_and_prompt_chunks_share_one_packed_forward(tiny_llama: Path) -> None:
    """An engine iteration: decode rows of two running sequences and two prompt chunks of different lengths (one
    the start of a long prompt) in one forward; each row computes what it would alone, and a row that asks gets the
    logits after every one of its tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    running = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    long_prompt = tok(" ".join(PROMPTS * 2))["input_ids"]
    short = tok(PROMPTS[3])["input_ids"]
    cache = SlotKVCache(slots=5, max_len=128)
    runner = ModelRunner(model, CPU, cache)
    first = (
        runner.forward([Row(3, 0, running[0])]).argmax(-1).tolist()
        + runner.forward([Row(1, 0, running[1])]).argmax(-1).tolist()
    )
    before = runner.forwards
    half = len(long_prompt) // 2
    out = runner.run(
        [
            Row(3, len(running[0]), first[:1]),
            Row(1, len(running[1]), first[1:]),
            Row(0, 0, long_prompt[:half], every_logits=True),
            Row(4, 0, short),
        ]
    )
    assert runner.forwards == before + 1
    for row, (prompt, token) in enumerate(zip(running, first)):
        ids = torch.tensor([prompt + [token]])
        with torch.inference_mode():
            want = model(ids).logits[0, -1]
        torch.testing.assert_close(out.last[row], want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        whole = model(torch.tensor([long_prompt])).logits[0]
    assert set(out.every) == {2}
    torch.testing.assert_close(out.every[2], whole[:half], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last[2], whole[half - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last[3], _reference(model, short)[0], atol=1e-5, rtol=1e-5)
    # the rest of the long prompt, next to a decode row, continues from what the packed forward wrote
    rest = runner.run([Row(0, half, long_prompt[half:]), Row(4, len(short), [int(out.last[3].argmax())])])
    torch.testing.assert_close(rest.last[0], whole[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("native_path")
def test_bf16_prompts_packed_give_each_row_what_it_gets_alone(tiny_llama: Path) -> None:
    """bf16 on the native kernels: prompts of different lengths packed into one forward, next to decode rows, give
    each row bit for bit the logits it gets alone, in two calls per iteration (decode rows, then the prompts); a
    prompt reaching past LONG_PROMPT_CONTEXT runs alone on SDPA, and also gives the same bits alone as in a crowd."""
    import loaders
    from service.engine import model_runner

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype="bfloat16", show_progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    long_prompt = tok(" ".join(PROMPTS * 20))["input_ids"]
    assert len(long_prompt) > model_runner.LONG_PROMPT_CONTEXT
    runner = ModelRunner(model, CPU, SlotKVCache(slots=8, max_len=1024))
    assert runner.half_packed == runner.packed == model_runner._prompt_products_row_independent(model)

    def alone(slot: int, prompt: list[int]) -> torch.Tensor:
        return runner.forward([Row(slot, 0, prompt)])[0]

    singles = [alone(s, p) for s, p in enumerate(prompts)]
    single_long = alone(6, long_prompt)
    # slots 0 and 1 decode a token each, next to the four prompts again (slots 2-5) and the long one (slot 7)
    before = runner.forwards
    rows = [Row(0, len(prompts[0]), [7]), Row(1, len(prompts[1]), [9])]
    rows += [Row(s + 2, 0, p) for s, p in enumerate(prompts)] + [Row(7, 0, long_prompt)]
    together = runner.forward(rows)
    if not runner.half_packed:  # torch's bf16 GEMM depends on the batch on this CPU: one forward per row width
        assert runner.forwards == before + len({len(r.tokens) for r in rows})
        assert [int(t) for t in together[2:6].argmax(-1)] == [int(t) for t in torch.stack(singles).argmax(-1)]
        return
    assert runner.forwards == before + 3  # decode rows, packed prompts, the long prompt
    for b, expected in enumerate(singles):
        assert torch.equal(together[b + 2], expected)
    assert torch.equal(together[6], single_long)
    for b, prompt in enumerate(prompts[:2]):  # the decode rows too: each as its own one-row step
        step = runner.forward([Row(b + 2, len(prompt), [7 if b == 0 else 9])])[0]
        assert torch.equal(step, together[b])


@pytest.mark.usefixtures("native_path")
def test_fp32_prompts_on_the_native_attention_match_transformers(tiny_llama: Path) -> None:
    """fp32 on the native kernels: prompts packed next to a decode row attend on the kernel, and a prompt reaching
    past LONG_PROMPT_CONTEXT runs alone on SDPA; every row's logits stay within 1e-5 of plain transformers."""
    import loaders
    from service.engine import model_runner

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype="float32", show_progress=False)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]] + [tok(" ".join(PROMPTS * 20))["input_ids"]]
    assert len(prompts[-1]) > model_runner.LONG_PROMPT_CONTEXT
    runner = ModelRunner(model, CPU, SlotKVCache(slots=6, max_len=1024))
    assert runner.native_attention and runner.packed and not runner.half_packed
    runner.forward([Row(5, 0, prompts[0])])  # slot 5 then decodes next to the prompts
    before = runner.forwards
    logits = runner.forward([Row(5, len(prompts[0]), [7])] + [Row(s, 0, p) for s, p in enumerate(prompts)])
    assert runner.forwards == before + 2  # the decode row and three prompts packed, the long prompt alone
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row + 1], _reference(plain, prompt)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], _reference(plain, prompts[0] + [7])[0], atol=1e-5, rtol=1e-5)


def test_decode_rows_run_the_native_step_with_transformers_tokens(tiny_llama: Path) -> None:
    """A model loaded on the native kernels decodes on :mod:`loaders.native.decode_step` (not the model's forward), rows
    in scattered slots: greedy tokens equal plain transformers', the last step's fp32 logits within 1e-5."""
    import loaders

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype="float32", show_progress=False)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    runner = ModelRunner(model, CPU, SlotKVCache(slots=6, max_len=64))
    assert runner.native_decoder is not None
    slots = [4, 0, 1, 5]
    got = [[int(t)] for t in runner.forward([Row(s, 0, p) for s, p in zip(slots, prompts)]).argmax(dim=-1)]
    for _ in range(STEPS - 1):
        rows = [Row(s, len(p) + len(seq) - 1, seq[-1:]) for s, p, seq in zip(slots, prompts, got)]
        step = runner.forward(rows)
        for seq, t in zip(got, step.argmax(dim=-1).tolist()):
            seq.append(t)
    assert runner.native_decoder.steps == STEPS - 1
    for row, prompt in enumerate(prompts):
        ref_logits = _reference(plain, prompt + got[row][:-1])[0]
        assert got[row] == _reference(plain, prompt)[1]
        torch.testing.assert_close(step[row], ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_of_several_tokens_run_the_native_step_with_each_tokens_decode_logits(
    tiny_llama: Path, dtype: str
) -> None:
    """A verify row (a decode row's token and its drafts, every token's logits) runs on the native decode step, one
    step-row a token, next to a one-token row: each token's logits are those decoding it alone gives (bit for bit
    in bf16, where a forward's prompt kernels would round differently), and a prompt chunk still takes the forward."""
    import loaders

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype=dtype, show_progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    drafts = [7, 11, 13, 5]

    def runner_after_prompts() -> ModelRunner:
        runner = ModelRunner(model, CPU, SlotKVCache(slots=4, max_len=64))
        runner.forward([Row(s, 0, p) for s, p in enumerate(prompts)])
        return runner

    together = runner_after_prompts()
    steps = together.native_decoder.steps
    out = together.run(
        [
            Row(0, len(prompts[0]), [9, *drafts], every_logits=True, decoding=True),
            Row(1, len(prompts[1]), [9], decoding=True),
        ]
    )
    assert together.native_decoder.steps == steps + 1  # one step: five step-rows and one
    alone = runner_after_prompts()
    for i, token in enumerate([9, *drafts]):
        logits = alone.forward([Row(0, len(prompts[0]) + i, [token])])[0]
        if dtype == "bfloat16":
            assert torch.equal(out.every[0][i], logits)
        else:
            torch.testing.assert_close(out.every[0][i], logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.last[0], out.every[0][-1])
    steps = together.native_decoder.steps
    together.run([Row(2, 0, prompts[0][:5])])
    assert together.native_decoder.steps == steps  # a prompt chunk is the model's forward


def test_the_row_independence_probe_sees_a_product_that_depends_on_its_batch() -> None:
    """The probe behind bf16 packing answers from what the products give: torch's GEMM as it is on this CPU, and a
    product whose rows pick up a trace of the rows beside them (which no CPU here gives, so it is written out)."""
    from loaders.native import linear

    weight = (torch.randn(640, 384, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    x = torch.randn(300, 384).bfloat16()
    full = torch.nn.functional.linear(x, weight)
    direct = all(
        torch.equal(torch.nn.functional.linear(x[s : s + n], weight), full[s : s + n]) for s, n in ((0, 1), (3, 270))
    )
    assert linear.torch_rows_independent([weight]) == direct

    def mixing(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, w)
        return out + 1e-2 * out.mean(dim=0, keepdim=True)

    assert not linear.torch_rows_independent([weight], product=mixing)


def test_the_probe_answer_is_cached_per_cpu_torch_and_weight_layout(monkeypatch, tmp_path: Path) -> None:
    """A start asks the probe once per question: the same weights' layout on the same CPU and torch is answered from
    the cache (the probe does not run), another layout or thread count is probed, and an unreadable answer is
    probed again and replaced."""
    from loaders.native import linear

    monkeypatch.setattr(linear, "probe_cache_dir", lambda: tmp_path / "probes")
    real = linear.torch_rows_independent
    probed: list[tuple[int, ...]] = []

    def counting(weights):
        probed.append(tuple(w.shape[0] for w in weights))
        return real(weights)

    monkeypatch.setattr(linear, "torch_rows_independent", counting)
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(320, 256, generator=g) * 0.05).bfloat16()
    first = linear.rows_independent_on_this_cpu([weight])
    assert first == real([weight]) and probed == [(320,)]
    # other values, same layout: answered from the cache
    assert linear.rows_independent_on_this_cpu([torch.randn_like(weight)]) == first and probed == [(320,)]
    (answer,) = (tmp_path / "probes").iterdir()
    assert json.loads(answer.read_text())["independent"] is first
    linear.rows_independent_on_this_cpu([weight[:160]])  # another shape: probed
    assert probed == [(320,), (160,)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        linear.rows_independent_on_this_cpu([weight])
    finally:
        torch.set_num_threads(threads)
    assert probed[-1] == (320,) and len(probed) == 3
    answer.write_text("{not json")
    assert linear.rows_independent_on_this_cpu([weight]) == first and len(probed) == 4
    assert json.loads(answer.read_text())["independent"] is first  # written back whole
    # an answer stored for another key under this name (a collision) is not believed
    stored = json.loads(answer.read_text())
    answer.write_text(json.dumps({"key": {**stored["key"], "torch": "0.0"}, "independent": not first}))
    assert linear.rows_independent_on_this_cpu([weight]) == first and len(probed) == 5


def test_an_unwritable_probe_cache_only_means_probing(monkeypatch, tmp_path: Path) -> None:
    from loaders.native import linear

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(linear, "probe_cache_dir", lambda: blocked / "probes")  # under a file: mkdir fails
    weight = torch.randn(64, 128).bfloat16()
    assert linear.rows_independent_on_this_cpu([weight]) == linear.torch_rows_independent([weight])


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_the_probe_covers_the_layers_torch_runs(
    tiny_llama: Path, monkeypatch, cpu_kernels: str, tmp_path: Path
) -> None:
    """With the native linear kernels or without them (``cpu_kernels="torch"``: every product is torch's), the
    probe runs on the model's first linear weight and on its widest."""
    import loaders
    from loaders.native import linear
    from service.engine import model_runner

    model = loaders.load_model(
        tiny_llama, device_map={"": "cpu"}, dtype="bfloat16", show_progress=False, cpu_kernels=cpu_kernels
    )
    probed: list[list[torch.Tensor]] = []
    monkeypatch.setattr(linear, "probe_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(linear, "torch_rows_independent", lambda weights: probed.append(weights) or True)
    assert model_runner._prompt_products_row_independent(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widest = max(linears, key=lambda m: m.in_features)
    assert len(probed) == 1 and probed[0][0] is linears[0].weight and probed[0][1] is widest.weight
    assert widest.in_features > linears[0].in_features
