"""Which models decode on loadmaster's native step, and which run transformers' forward at every decode step.

Why here: the loader's native decode step (``loaders.native.decode_step``) takes Llama-shaped decoder layers only,
and everything else (mixtures of experts, sliding windows, gpt-oss, GPT-2) decodes through the model's own
forward, which costs far more per layer than its bytes: Python module calls, dozens of small torch operators, and
for a MoE layer the router, its top-k and the experts' dispatch. The cost model charges that (see
:data:`planner.placement.cost_model.MODULE_LAYER_SECONDS`), so the planner must know which path a model takes; the
loader reads its list of layer classes from :data:`NATIVE_DECODE_LAYERS`, so the two cannot disagree.
"""

from __future__ import annotations

from planner.types import Skeleton

#: ``model_type`` -> its decoder layer class, for the models whose layers are Llama's: pre-norm RMSNorm, attention
#: with rotary q/k (optional q/k/v bias; Qwen3's RMSNorm of each q and k head), residual, RMSNorm, SiLU-gated MLP.
NATIVE_DECODE_LAYERS = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}


def runs_module_forward(skeleton: Skeleton) -> bool:
    """Whether the model's CPU decode steps run transformers' forward rather than the native step: a layer type the
    step does not take, routed experts, or layers attending over a sliding window (what the skeleton shows of the
    step's own checks; a CPU-only plan of one of these models decodes natively)."""
    if skeleton.model_type not in NATIVE_DECODE_LAYERS or skeleton.experts_per_token:
        return True
    return bool(skeleton.kv is not None and skeleton.kv.sliding_window and skeleton.kv.sliding_layers)
