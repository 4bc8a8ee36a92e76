"""Attention on the native kernel (``loadmaster::decode_attention``) on every instruction-set path this CPU has:
decode rows and bf16 prompt rows against attention computed in float64, independent of the batch (and, for prompt
tokens, of packing), in place over the slot cache's strided views, and switched on in loaded models without
changing what they compute."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import loaders
from loaders.native import operators
from loaders.native.attention import NATIVE_ATTENTION, decode_attention_forward

#: (query heads, KV heads, head size): multi-head, grouped (GQA, 3 and 8 per KV head), and head sizes that are not
#: a multiple of the AVX-512 width (80) or are larger (128).
SHAPES = [(4, 4, 64), (12, 4, 64), (8, 1, 80), (16, 2, 128)]


def _operands(b: int, h: int, kv: int, d: int, length: int, dtype: torch.dtype, seed: int):
    """Query ``[B, H, 1, D]`` as transformers lays it out, keys and values as views of a larger slot storage (as
    :class:`service.engine.kv_pool.BoundSlotCache` returns them), and a mask with holes (each row keeps a key)."""
    g = torch.Generator().manual_seed(seed)
    store_k = torch.randn(b + 3, kv, length + 29, d, generator=g).to(dtype)
    store_v = torch.randn(b + 3, kv, length + 29, d, generator=g).to(dtype)
    key, value = store_k[1 : 1 + b, :, :length], store_v[1 : 1 + b, :, :length]
    query = torch.randn(b, 1, h, d, generator=g).to(dtype).transpose(1, 2)
    mask = torch.rand(b, 1, 1, length, generator=g) > 0.3
    mask[:, :, :, 0] = True
    return query, key, value, mask


def _reference(query, key, value, mask, scale):
    out = F.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("h,kv,d", SHAPES)
@pytest.mark.parametrize("length", [1, 7, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_attention_in_float64(kernel_path, h, kv, d, length, dtype):
    b, scale = 5, d**-0.5
    query, key, value, mask = _operands(b, h, kv, d, length, dtype, seed=h * 1000 + d + length)
    out = operators.decode_attention(query, key, value, mask, scale)
    assert out.shape == (b, 1, h, d) and out.dtype == dtype
    exact = _reference(query, key, value, mask, scale)
    # float32 sums: a few ulps of the values; bf16: one rounding of the output (values are O(1))
    tolerance = 2e-6 if dtype == torch.float32 else 2**-7
    assert (out.double() - exact).abs().max().item() <= tolerance * max(1.0, exact.abs().max().item())
    no_mask = operators.decode_attention(query, key, value, None, scale)
    assert (no_mask.double() - _reference(query, key, value, None, scale)).abs().max().item() <= tolerance * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(native_path, dtype):
    query, key, value, mask = _operands(9, 12, 4, 64, 100, dtype, seed=7)
    together = operators.decode_attention(query, key, value, mask, 0.125)
    for row in (0, 4, 8):
        alone = operators.decode_attention(
            query[row : row + 1], key[row : row + 1], value[row : row + 1], mask[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], together[row])


def test_masked_keys_weigh_nothing_whatever_they_hold(native_path):
    query, key, value, mask = _operands(3, 8, 2, 64, 40, torch.float32, seed=3)
    before = operators.decode_attention(query, key, value, mask, 0.125)
    key, value = key.clone(), value.clone()
    key[~mask[:, 0, 0, :].unsqueeze(1).expand_as(key[..., 0])] = 1e30
    value[~mask[:, 0, 0, :].unsqueeze(1).expand_as(value[..., 0])] = float("nan")
    assert torch.equal(operators.decode_attention(query, key, value, mask, 0.125), before)


@pytest.mark.parametrize("h,kv,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_tokens_match_causal_attention_in_float64(kernel_path, h, kv, d, dtype):
    """Several query tokens per row, each over the keys its causal mask row lets through (rows at different starts
    in the cache, so each row's mask is its own)."""
    b, width, length, scale = 3, 11, 40, d**-0.5
    g = torch.Generator().manual_seed(h + d)
    key = torch.randn(b, kv, length, d, generator=g).to(dtype)
    value = torch.randn(b, kv, length, d, generator=g).to(dtype)
    query = torch.randn(b, width, h, d, generator=g).to(dtype).transpose(1, 2)
    starts = torch.tensor([0, 13, 29])  # row r's tokens sit at starts[r] .. starts[r] + width - 1
    positions = starts[:, None] + torch.arange(width)[None, :]
    mask = (torch.arange(length)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, L]
    out = operators.decode_attention(query, key, value, mask, scale)
    assert out.shape == (b, width, h, d) and out.dtype == dtype
    exact = _reference(query, key, value, mask, scale)
    tolerance = 2e-6 if dtype == torch.float32 else 2**-7
    assert (out.double() - exact).abs().max().item() <= tolerance * max(1.0, exact.abs().max().item())


def test_a_prompt_token_does_not_depend_on_packing_or_chunks(native_path):
    """Two bf16 prompts packed end to end ([1, T] with a block-diagonal causal mask, as the engine's runner packs
    them) give each token, bit for bit, what that prompt gives alone, and what a later chunk of it gives."""
    g = torch.Generator().manual_seed(11)
    h, kv, d, widths = 12, 4, 64, (9, 23)
    keys = [torch.randn(1, kv, w, d, generator=g).bfloat16() for w in widths]
    values = [torch.randn(1, kv, w, d, generator=g).bfloat16() for w in widths]
    queries = [torch.randn(1, h, w, d, generator=g).bfloat16() for w in widths]

    def causal(n_queries: int, n_keys: int, first: int = 0) -> torch.Tensor:
        pos = torch.arange(first, first + n_queries)
        return (torch.arange(n_keys)[None, :] <= pos[:, None])[None, None]

    alone = [
        operators.decode_attention(q, k, v, causal(w, w), 0.125) for q, k, v, w in zip(queries, keys, values, widths)
    ]
    total = sum(widths)
    mask = torch.zeros(1, 1, total, total, dtype=torch.bool)
    mask[..., : widths[0], : widths[0]] = causal(widths[0], widths[0])
    mask[..., widths[0] :, widths[0] :] = causal(widths[1], widths[1])
    packed = operators.decode_attention(
        torch.cat(queries, dim=2), torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, 0.125
    )
    assert torch.equal(packed[:, : widths[0]], alone[0]) and torch.equal(packed[:, widths[0] :], alone[1])
    # the second prompt's last 8 tokens as a chunk after its first 15 (already in the cache)
    chunk = operators.decode_attention(queries[1][:, :, 15:], keys[1], values[1], causal(8, 23, first=15), 0.125)
    assert torch.equal(chunk, alone[1][:, 15:])


def test_operator_checks_its_operands(kernel_path):
    query, key, value, mask = _operands(2, 4, 2, 64, 10, torch.float32, seed=1)
    with pytest.raises(ValueError, match="need a mask"):
        operators.decode_attention(torch.cat([query, query], dim=2), key, value, None, 0.125)
    with pytest.raises(ValueError, match=r"\[B, 1, T, L\]"):
        operators.decode_attention(torch.cat([query, query, query], dim=2), key, value, mask.expand(2, 1, 2, 10), 0.125)
    with pytest.raises(ValueError, match="multiple of KV"):
        operators.decode_attention(query[:, :3], key, value, mask, 0.125)
    with pytest.raises(ValueError, match="one dtype"):
        operators.decode_attention(query, key.bfloat16(), value, mask, 0.125)
    with pytest.raises(ValueError, match="mask must be bool"):
        operators.decode_attention(query, key, value, mask.float(), 0.125)
    fake = torch.ops.loadmaster.decode_attention(query.to("meta"), key.to("meta"), value.to("meta"), None, 0.125)
    assert fake.shape == (2, 1, 4, 64)


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def test_other_calls_run_transformers_sdpa_unchanged(native_path):
    """Prefill rows without a mask (transformers leaves causal ones to SDPA's is_causal), float masks and extra
    terms are transformers' sdpa, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Module().eval()
    query, key, value, mask = _operands(2, 12, 4, 64, 9, torch.float32, seed=5)
    prefill = torch.randn(2, 12, 9, 64)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(2, 1, 9, 9)
    for q, m in ((prefill, None), (prefill.bfloat16(), None), (query, mask.float()), (prefill, causal.float())):
        k, v = (key.bfloat16(), value.bfloat16()) if q.dtype == torch.bfloat16 else (key, value)
        if m is None:  # the causal case transformers leaves to SDPA's is_causal
            k, v = k[..., :9, :], v[..., :9, :]
        ours, _ = decode_attention_forward(module, q, k, v, m, scaling=0.125)
        theirs, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.125)
        assert torch.equal(ours, theirs)
    ours, _ = decode_attention_forward(module, query, key, value, mask, scaling=0.125)
    assert torch.allclose(ours, sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)[0], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_models_switch_and_decode_as_before(native_path, tiny_llama, dtype, monkeypatch):
    """A model loaded onto the CPU runs its decode steps on the kernel; greedy tokens and, in fp32, logits (1e-5)
    are those of the same model on sdpa. ``LOADMASTER_DECODE_ATTENTION=sdpa`` keeps sdpa."""
    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype=dtype, show_progress=False)
    assert model.config._attn_implementation == NATIVE_ATTENTION and model.load_stats.native_attention
    monkeypatch.setenv("LOADMASTER_DECODE_ATTENTION", "sdpa")
    plain = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype=dtype, show_progress=False)
    assert plain.config._attn_implementation == "sdpa" and not plain.load_stats.native_attention
    ids = torch.tensor([[5, 17, 2, 99, 31, 8]])
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
        theirs = plain.generate(
            ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert torch.equal(ours.sequences, theirs.sequences)
    if dtype == "float32":
        diff = max((a - b).abs().max().item() for a, b in zip(ours.logits, theirs.logits))
        assert diff <= 1e-5
