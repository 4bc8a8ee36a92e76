"""The planner sizes ``cpu_quantization`` layers to the bytes the loader allocates: a plan made for int8 or int4
and the model loaded from it agree block by block, to the byte (K tails padded to the group, the int8 head under
int4, a tied head's quantized copy, GPT-2's Conv1D left as it is)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import loaders
from loaders.native.quantization import QuantizedCPULinear
from planner import plan
from planner.errors import PlanError
from planner.model.skeleton import describe_checkpoint
from planner.placement.sizing import cpu_quantized_layout, size_blocks
from tests.models import tiny_gpt2_dir


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """A Llama whose widths are not multiples of the 64-input group (80 hidden, 144 MLP, vocab 300), so int8 rows
    are padded and int4 has a partial last group; untied head."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=80,
        intermediate_size=144,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("odd-llama")
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="100KB")
    return out


def _loaded_bytes_per_block(model: torch.nn.Module, block_names: list[str]) -> dict[str, int]:
    """Every parameter and buffer of ``model`` (shared ones once), summed by the block whose name is its longest
    prefix."""
    by_length = sorted(block_names, key=len, reverse=True)
    out = dict.fromkeys(block_names, 0)
    seen: set[int] = set()
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        owner = next((b for b in by_length if name == b or name.startswith(b + ".") or b == ""), None)
        assert owner is not None, f"{name} belongs to no block of the plan"
        out[owner] += t.nbytes
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize(
    ("which", "dtype"), [("odd_llama", "float32"), ("odd_llama", "bfloat16"), ("tiny_gpt2", "float32")]
)
def test_planned_bytes_are_the_loaded_bytes(request, which, dtype, scheme):
    path = request.getfixturevalue("odd_llama") if which == "odd_llama" else tiny_gpt2_dir()
    skeleton = describe_checkpoint(path, dtype).skeleton
    the_plan = plan(skeleton, max_memory={"cpu": "4GiB"}, dtype=dtype, cpu_quantization=scheme)
    assert the_plan.workload.cpu_quantization == scheme
    result = loaders.load_checkpoint(path, device_map=the_plan, show_progress=False)
    model = result.model
    assert result.stats.cpu_quantization is not None and result.stats.cpu_quantization.scheme == scheme
    quantized = [m for m in model.modules() if isinstance(m, QuantizedCPULinear)]
    assert quantized and isinstance(model.lm_head, QuantizedCPULinear) and model.lm_head.scheme == "int8"

    planned = {b.name: b.weight for b in size_blocks(skeleton, the_plan.workload)}
    loaded = _loaded_bytes_per_block(model, list(planned))
    assert loaded == planned
    cpu = next(b for b in the_plan.budgets if b.device == "cpu")
    assert cpu.weights == sum(loaded.values())
    plain = next(b for b in plan(skeleton, max_memory={"cpu": "4GiB"}, dtype=dtype).budgets if b.device == "cpu")
    if which == "tiny_gpt2":  # Conv1D layers stay float, and the tied head gets a quantized copy: it grows
        assert cpu.weights == plain.weights + cpu_quantized_layout(1024, 64, "int8").nbytes
    else:
        assert cpu.weights < plain.weights


def test_layouts_pad_rows_to_whole_groups():
    assert cpu_quantized_layout(10, 65, "int8").nbytes == 10 * 128 + 10 * 4
    assert cpu_quantized_layout(10, 65, "int4").nbytes == 10 * 64 + 10 * 2 * 2
    assert cpu_quantized_layout(7, 64, "int4").scales_shape == (7, 1)


def test_a_plan_loads_with_the_quantization_it_was_sized_for(odd_llama):
    the_plan = plan(odd_llama, max_memory={"cpu": "4GiB"}, dtype="float32", cpu_quantization="int8")
    with pytest.raises(PlanError, match="the plan was made for cpu_quantization='int8'"):
        loaders.load_checkpoint(odd_llama, device_map=the_plan, show_progress=False, cpu_quantization="int4")


def test_bad_cpu_quantization_plans_are_refused(odd_llama):
    with pytest.raises(PlanError, match="unknown cpu_quantization 'nf4'"):
        plan(odd_llama, max_memory={"cpu": "4GiB"}, cpu_quantization="nf4")
    with pytest.raises(PlanError, match="quantization= is bitsandbytes for GPU layers"):
        plan(odd_llama, max_memory={"cpu": "4GiB"}, quantization="nf4", cpu_quantization="int8")
    with pytest.raises(PlanError, match="not float16: plan with --dtype bf16 or fp32"):
        plan(odd_llama, max_memory={"cpu": "4GiB"}, dtype="float16", cpu_quantization="int4")
    with pytest.raises(PlanError, match="GPUs 0 are among the devices"):
        plan(odd_llama, gpus="1x24GiB", max_memory={"cpu": "4GiB"}, cpu_quantization="int4")
