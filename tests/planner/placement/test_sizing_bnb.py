"""The planner's quantized sizes equal what bitsandbytes really allocates (tiny Llama, on this CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from planner.api import plan


def _allocated_bytes(model: torch.nn.Module) -> int:
    """Every tensor the quantized model holds: parameters, buffers, and bitsandbytes' per-weight statistics
    (int8 row scales ``SCB``; 4-bit ``absmax``), each storage counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.untyped_storage().data_ptr() in seen:
            return
        seen.add(t.untyped_storage().data_ptr())
        total += t.numel() * t.element_size()

    for _, p in model.named_parameters():
        add(p)
        add(getattr(p, "SCB", None))
        state = getattr(p, "quant_state", None)
        if state is not None:
            add(state.absmax)
    for _, b in model.named_buffers():
        add(b)
    return total


@pytest.mark.parametrize(
    "quant,config",
    [
        ("int8", BitsAndBytesConfig(load_in_8bit=True)),
        ("nf4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)),
        ("fp4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float16)),
    ],
)
def test_quantized_weight_bytes_match_bitsandbytes(tiny_llama, quant, config):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama, quantization_config=config, dtype=torch.float16, device_map="cpu"
    )
    real = _allocated_bytes(model)
    planned = plan(tiny_llama, max_memory={"cpu": "1GiB"}, quantization=quant, dtype="fp16").budgets[0].weights
    # The 4-bit quant state's small per-tensor extras (code table, shape) are estimated: allow 64 B per tensor.
    n_quantized = sum(1 for m in model.modules() if type(m).__name__ in ("Linear8bitLt", "Linear4bit"))
    assert n_quantized > 0
    assert abs(planned - real) <= 64 * n_quantized, (planned, real)
