"""A 1.03B Llama whose greedy choice has a wide, stated logit margin: what issue 35's speculative figures run on.

Why: a random-weight model's logits are nearly flat, so its int8 or int4 copy disagrees with it at once (int4
drafts of the random 100M Llama were 24% accepted), and no trained checkpoint of this size can be downloaded or
trained here. Drafting from a quantized copy pays exactly as often as the copy agrees with the model, so a speed-up
measured on flat logits says nothing about a trained model, whose copies agree most of the time (95% for int8 and
84% for int4 on the trained demo model). This model keeps everything a pass costs and changes only what decides
the next token:

- It is the bench's random 1.03B float32 Llama (:func:`bench.common.llama_dir`): the same shapes, the same 4.1 GB
  of shards, the same bytes read and products computed per token.
- Its output head is its input embedding, permuted: ``lm_head.weight[j] = embed_tokens.weight[perm[j]]`` for a
  seeded permutation ``perm``. A final hidden state along token t's embedding then scores ``perm^-1(t)`` at
  ``|e_t|^2`` and every other token at ``e_k . e_t``, about ``|e_t|^2 / sqrt(hidden)`` apart (the margin).
- Every decoder block's writes to the residual stream (``o_proj`` and ``down_proj``) are scaled by
  ``residual_scale``, so the blocks move the stream less than that margin, and the copies' rounding less still.

Greedy text is then mostly the walk ``t -> perm^-1(t)``, and the blocks decide the rest. The bench reports the
margin it measured (top-1 minus top-2 logit, relative to top-1) and the drafts' acceptance beside every figure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.common import llama_dir, model_cache_dir

RECIPE_FILE = "margin_recipe.json"
#: The residual writes' scale and the permutation's seed the figures were measured with.
RESIDUAL_SCALE = 0.05
SEED = 35


def margin_llama_dir(residual_scale: float = RESIDUAL_SCALE, seed: int = SEED) -> Path:
    """The 1.03B float32 margin Llama (see the module docstring), built once from the bench's 1B Llama."""
    base = llama_dir("1b", "float32")
    out = model_cache_dir() / f"llama-1b-margin-float32-s{residual_scale:g}"
    recipe = {"base": json.loads((base / "loadmaster_build.json").read_text()), "scale": residual_scale, "seed": seed}
    done = out / RECIPE_FILE
    if done.is_file() and json.loads(done.read_text()) == recipe:
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in base.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "loadmaster_build.json":
            shutil.copy2(f, partial / f.name)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    embed = _tensor(base / index["model.embed_tokens.weight"], "model.embed_tokens.weight")
    perm = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
    for shard in sorted({index[k] for k in index}):
        with safe_open(base / shard, framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            metadata = fh.metadata()
        for name, t in tensors.items():
            if name == "lm_head.weight":
                tensors[name] = embed[perm].contiguous()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = (t * residual_scale).contiguous()
        save_file(tensors, partial / shard, metadata=metadata)
    (partial / RECIPE_FILE).write_text(json.dumps(recipe))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def _tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as fh:
        return fh.get_tensor(name)


if __name__ == "__main__":
    print(margin_llama_dir())
