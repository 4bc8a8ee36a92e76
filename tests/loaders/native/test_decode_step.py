"""Decode steps on the native kernels end to end (:mod:`loaders.native.decode_step`), on every instruction-set path this
CPU has: fp32 logits within 1e-5 of transformers' own forward, a row's bf16 result independent of its batch and of
the slots around it, quantized layers, biases (Qwen2), disk readahead's pre-hooks, and the models it declines."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import loaders
from loaders.native import decode_step
from loaders.native.attention import use_native_attention
from loaders.native.decode_step import MAX_ROWS, NativeDecoder, add_rms_norm, rope_store, silu_mul, team
from loaders.native.linear import use_native_linears
from planner.model.decode_path import runs_module_forward
from planner.model.skeleton import load_skeleton
from tests.models import tiny_gpt2_dir, tiny_gpt_oss_dir, tiny_llama_dir, tiny_moe_dir

SLOTS, CAPACITY = 6, 64
#: Llama 3's frequency-dependent scaling (positions past 16 are scaled), so the step's cos/sin table is tested on it.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A small random model of a transformers class, switched to the native kernels as a load would do."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    if kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":  # an RMSNorm on each q and k head
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=LLAMA3_ROPE))
    model = model.to(dtype).eval()
    with torch.no_grad():  # random biases and norm weights (their default init, 0 and 1, would test little)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.normal_(1, 0.3)
    use_native_linears(model)
    use_native_attention(model)
    return model


def _prefilled(model, prompts: dict[int, list[int]]) -> tuple[dict, dict]:
    """Slot storage ``[SLOTS, KV, CAPACITY, D]`` per layer, each prompt's keys and values written into its slot by
    transformers' own forward."""
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for slot, ids in prompts.items():
            cache = DynamicCache()
            model(torch.tensor([ids]), cache=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                k, v = layer.keys[0], layer.values[0]  # [KV, T, D]
                if i not in keys:
                    keys[i] = k.new_zeros(SLOTS, k.shape[0], CAPACITY, k.shape[2])
                    values[i] = v.new_zeros(SLOTS, v.shape[0], CAPACITY, v.shape[2])
                keys[i][slot, :, : len(ids)] = k
                values[i][slot, :, : len(ids)] = v
    return keys, values


def _step(decoder, rows: list[tuple[int, list[int], int]], keys, values) -> torch.Tensor:
    """One step over rows (slot, prompt, next token)."""
    with torch.inference_mode():
        return decoder.step(
            torch.tensor([t for _, _, t in rows]),
            torch.tensor([len(p) for _, p, _ in rows]),
            torch.tensor([s for s, _, _ in rows]),
            keys,
            values,
        )


def _step_matches_forward(model, relative: float, floor: float = 0.0) -> None:
    """One native decode step of two prefilled rows against the model's own forward over each whole sequence: the
    last logits within ``relative`` of the reference's largest (at least ``floor``)."""
    decoder = NativeDecoder(model)
    rows = [(0, list(range(3, 20)), 9), (1, list(range(30, 36)), 100)]
    keys, values = _prefilled(model, {s: p for s, p, _ in rows})
    logits = _step(decoder, rows, keys, values)
    with torch.inference_mode():
        for b, (_, prompt, token) in enumerate(rows):
            ref = model(torch.tensor([prompt + [token]])).logits[0, -1]
            assert (logits[b] - ref).abs().max().item() <= relative * max(floor, ref.abs().max().item())


#: Rows (slot, prompt, next token): different lengths, slots out of order and with gaps (several attention runs).
ROWS = [(0, list(range(5, 22)), 7), (1, list(range(40, 49)), 11), (3, list(range(9, 40)), 3), (2, [4, 5], 290)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fp32_step_matches_transformers(native_path, kind):
    model = _model(kind, torch.float32)
    decoder = NativeDecoder(model)
    keys, values = _prefilled(model, {s: p for s, p, _ in ROWS})
    logits = _step(decoder, ROWS, keys, values)
    with torch.inference_mode():
        for b, (slot, prompt, token) in enumerate(ROWS):
            ref = model(torch.tensor([prompt + [token]])).logits[0, -1]
            assert (logits[b] - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
            # the step wrote the token's keys where the next step reads them
            cache = DynamicCache()
            model(torch.tensor([prompt + [token]]), cache=cache, use_cache=True)
            k = cache.layers[1].keys[0, :, -1]
            assert (keys[1][slot, :, len(prompt)] - k).abs().max().item() <= 1e-5


def test_a_call_gets_a_thread_per_share_of_work_it_pays_for() -> None:
    share = decode_step.MIN_BYTES_PER_THREAD
    assert team(2, 8 * 1024) == 1  # a norm of one 2048-wide fp32 row: waking a second thread costs more
    assert team(2, 2 * share) == 2 and team(2, 40 * share) == 2  # never past torch's count
    assert team(1, 40 * share) == 1 and team(4, 3 * share) == 3
    assert team(2, 0) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_gives_the_same_bits_on_one_thread_or_two_per_call(native_path, monkeypatch, dtype):
    """Teams split work by output rows and (row, head) tasks, never a sum: the thread count changes no bit."""
    model = _model("qwen3", dtype)
    decoder = NativeDecoder(model)
    keys, values = _prefilled(model, {s: p for s, p, _ in ROWS})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(decode_step, "MIN_BYTES_PER_THREAD", 1)  # every call on both threads
        both = _step(decoder, ROWS, {i: k.clone() for i, k in keys.items()}, values)
        monkeypatch.setattr(decode_step, "MIN_BYTES_PER_THREAD", 1 << 40)  # every call on one
        one = _step(decoder, ROWS, keys, values)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(both, one)


def test_bf16_row_does_not_depend_on_its_batch(native_path):
    model = _model("qwen2", torch.bfloat16)
    decoder = NativeDecoder(model)
    keys, values = _prefilled(model, {s: p for s, p, _ in ROWS})
    together = _step(decoder, ROWS, keys, values)
    for b, row in enumerate(ROWS):
        alone = _step(decoder, [row], keys, values)
        assert torch.equal(alone[0], together[b])
    with torch.inference_mode():  # and within bf16 rounding of transformers' own forward
        for b, (_, prompt, token) in enumerate(ROWS):
            ref = model(torch.tensor([prompt + [token]])).logits[0, -1].float()
            assert (together[b].float() - ref).abs().max().item() <= 0.03 * ref.abs().max().item()


@pytest.mark.parametrize("kernel", ["add_rms_norm", "rope_store", "silu_mul"])
def test_a_refused_element_step_fails_the_step_not_its_logits(native_path, kernel):
    """Were an element-wise kernel to refuse a step (its shape checks), the step raises rather than return logits
    computed from what its buffers held before."""
    model = _model("llama", torch.float32)
    decoder = NativeDecoder(model)
    keys, values = _prefilled(model, {s: p for s, p, _ in ROWS})
    real = decoder._fn[kernel]  # noqa: SLF001
    decoder._fn[kernel] = lambda *args: real(*args) or -1  # noqa: SLF001 - runs, then reports a refusal
    with pytest.raises(RuntimeError, match="rejected a step of 4 rows"):
        _step(decoder, ROWS, keys, values)
    decoder._fn[kernel] = real  # noqa: SLF001
    assert torch.isfinite(_step(decoder, ROWS, keys, values)).all()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_layers_run_their_kernels(native_path, scheme):
    model = loaders.load_model(tiny_llama_dir(), device_map={"": "cpu"}, show_progress=False, cpu_quantization=scheme)
    # the same kernels, fed the same activations up to the norms' order of summation; activation quantization can
    # turn such a difference into one quantum of a product
    _step_matches_forward(model, relative=0.02)


def test_pre_hooks_run_at_their_layer(native_path):
    model = _model("llama", torch.float32)
    seen: list[str] = []
    model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: seen.append("layer 1 mlp"))
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append("head"))
    model.model.register_forward_pre_hook(lambda m, a: seen.append("decoder"))  # around every layer
    decoder = NativeDecoder(model)
    keys, values = _prefilled(model, {0: [1, 2, 3]})
    seen.clear()
    _step(decoder, [(0, [1, 2, 3], 4)], keys, values)
    assert seen == ["decoder", "layer 1 mlp", "head"]


def test_declines_what_it_does_not_run(kernel_path, monkeypatch):
    llama = _model("llama", torch.float32)
    gpt2 = loaders.load_model(tiny_gpt2_dir(), device_map={"": "cpu"}, show_progress=False)
    assert NativeDecoder.for_model(gpt2) is None
    if not kernel_path.available:
        assert NativeDecoder.for_model(llama) is None
        return
    decoder = NativeDecoder.for_model(llama)
    assert decoder is not None
    every_cache = {layer.index: torch.empty(0) for layer in decoder.layers}
    assert decoder.takes(1, every_cache) and not decoder.takes(MAX_ROWS + 1, every_cache)
    handle = llama.register_forward_pre_hook(lambda m, a: None)  # added later: only the model's forward runs it
    assert not decoder.takes(1, every_cache)
    handle.remove()
    monkeypatch.setenv("LOADMASTER_NATIVE_DECODE", "0")
    assert NativeDecoder.for_model(llama) is None
    monkeypatch.setenv("LOADMASTER_NATIVE_DECODE", "sometimes")
    with pytest.raises(ValueError, match="LOADMASTER_NATIVE_DECODE='sometimes'"):
        NativeDecoder.for_model(llama)
    monkeypatch.delenv("LOADMASTER_NATIVE_DECODE")
    llama.model.layers[0].register_forward_hook(lambda m, a, o: None)
    assert NativeDecoder.for_model(llama) is None
    plain_head = _model("llama", torch.float32)
    plain_head.lm_head.__class__ = torch.nn.Linear  # a layer on no native kernel
    assert NativeDecoder.for_model(plain_head) is None


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 steps between two bf16 tensors of finite values."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_element_steps_round_as_transformers_modules(native_path, dtype):
    """RMSNorm after the residual add, rotary + cache write, SiLU * up against transformers' own modules: rotary
    bit for bit (the same products and sum, each rounded where torch rounds), the norm and SiLU within one bf16 step
    (the order of the norm's sum, the last bits of exp) or a few float32 ulps."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    rows, hidden, heads, kv, d = 5, 96, 6, 2, 16
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    want_h = h + delta
    with torch.inference_mode():
        want = norm(want_h)
        got = add_rms_norm(h, delta, norm.weight.detach(), 1e-5)
    assert torch.equal(h, want_h)
    if dtype is torch.bfloat16:
        assert _ulps_apart(got, want) <= 1
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    angles = torch.randn(40, d // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(rows, heads * d, generator=g).to(dtype)
    k = torch.randn(rows, kv * d, generator=g).to(dtype)
    v = torch.randn(rows, kv * d, generator=g).to(dtype)
    positions, slots = torch.tensor([0, 7, 39, 3, 12]), torch.tensor([2, 0, 5, 1, 4])
    kc, vc = torch.zeros(6, kv, 40, d, dtype=dtype), torch.zeros(6, kv, 40, d, dtype=dtype)
    q4, k4 = q.view(rows, heads, 1, d), k.view(rows, kv, 1, d)
    want_q, want_k = apply_rotary_pos_emb(q4, k4, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), 1)
    rope_store(q, k, v, cos, sin, positions, slots, kc, vc)
    assert torch.equal(q.view(rows, heads, 1, d), want_q)
    for b in range(rows):
        assert torch.equal(kc[slots[b], :, positions[b]], want_k[b, :, 0])
        assert torch.equal(vc[slots[b], :, positions[b]], v[b].view(kv, d))
    assert int((kc != 0).any(-1).sum()) == rows * kv  # nothing else written

    gate = (torch.randn(rows, 2100, generator=g) * 4).to(dtype)
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's range both ways, and zero
    up = torch.randn(rows, 2100, generator=g).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate, up)
    if dtype is torch.bfloat16:
        assert _ulps_apart(got, want) <= 1
    else:
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


def test_pre_quantized_zero_point_layers_run_their_kernel(native_path, tmp_path):
    """An AWQ checkpoint (4-bit with a zero point per group) decodes on ``linear_q4z`` as the model's forward does."""
    import compressed_tensors  # noqa: F401

    from bench.quant_checkpoints import write_quantized

    write_quantized(tiny_llama_dir(), tmp_path / "awq", "awq", group=64)
    model = loaders.load_model(tmp_path / "awq", device_map={"": "cpu"}, show_progress=False, dtype="float32")
    assert model.model.layers[0].self_attn.q_proj.zeros is not None
    _step_matches_forward(model, relative=0.02)


@pytest.mark.parametrize("fmt", ["fp8", "ct-fp8"])
def test_pre_quantized_fp8_layers_run_their_kernel(native_path, tmp_path, fmt):
    """FP8 checkpoints (128x128 blocks; per channel) decode on ``linear_fp8`` as the model's forward does, to float32
    summation order: the kernel converts each stored byte exactly."""
    from bench.quant_checkpoints import write_quantized
    from loaders.native.fp8_linear import Fp8CPULinear

    write_quantized(tiny_llama_dir(), tmp_path / fmt, fmt)
    model = loaders.load_model(tmp_path / fmt, device_map={"": "cpu"}, show_progress=False, dtype="float32")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8CPULinear)
    _step_matches_forward(model, relative=1e-5, floor=1.0)


def test_pre_quantized_mxfp4_layers_run_their_kernel(native_path, tmp_path):
    """MXFP4 checkpoints decode on ``linear_mxfp4`` (reading the stored blocks and scale bytes) as the model's
    forward does, within the int4 kernels' 2%: the kernel rounds activations to int8, so the float32 summation
    order elsewhere (attention, norms) can move an activation across a rounding step."""
    from bench.quant_checkpoints import write_quantized
    from loaders.native.mxfp4_linear import Mxfp4CPULinear

    write_quantized(tiny_llama_dir(), tmp_path / "mxfp4", "mxfp4")
    model = loaders.load_model(tmp_path / "mxfp4", device_map={"": "cpu"}, show_progress=False, dtype="float32")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Mxfp4CPULinear)
    _step_matches_forward(model, relative=0.02)


@pytest.mark.parametrize("double_quant", [False, True])
def test_pre_quantized_bnb_4bit_layers_run_their_kernel(native_path, tmp_path, double_quant):
    """bitsandbytes nf4 checkpoints decode on ``linear_nf4`` (reading the stored codes) as the model's forward does,
    to float32 summation order: the kernel takes float32 x and the exact table values."""
    from bench.quant_checkpoints import write_quantized
    from loaders.native.bnb_4bit import Bnb4CPULinear

    write_quantized(tiny_llama_dir(), tmp_path / "nf4", "bnb-4bit", quant_type="nf4", double_quant=double_quant)
    model = loaders.load_model(tmp_path / "nf4", device_map={"": "cpu"}, show_progress=False, dtype="float32")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Bnb4CPULinear)
    _step_matches_forward(model, relative=1e-5, floor=1.0)


@pytest.mark.parametrize("make", [tiny_llama_dir, tiny_gpt2_dir, tiny_moe_dir, tiny_gpt_oss_dir])
def test_the_planner_knows_which_models_decode_here(native_path, make):
    """The cost model charges transformers' forward to the models this step declines
    (planner.model.decode_path): the two agree on each kind of checkpoint."""
    path = make()
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    assert (NativeDecoder.for_model(model) is None) is runs_module_forward(load_skeleton(str(path)))
