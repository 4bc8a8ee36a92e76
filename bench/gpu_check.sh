#!/usr/bin/env bash
# GPU check for the loader: part of a ~1B Llama CPU-offloaded and streamed to the GPU.
#
#   bench/gpu_check.sh [--out PATH] [--dtype bfloat16|float16] [--new-tokens N] [--offload-fraction F]
#
# On a machine with a CUDA GPU (torch with CUDA, accelerate installed) it:
#   1. measures the host-to-device ceiling: a pinned (and a pageable) 1 GiB memcpy, timed with CUDA events;
#   2. loads the model with loadmaster, the first (1-F) of the decoder layers on GPU 0 and the rest on "cpu"
#      (pinned, streamed by the double-buffered prefetcher), and checks its fp32 logits against a CPU reference
#      (plain transformers on the same weights);
#   3. measures greedy decode tokens/s and the H2D bandwidth achieved (offloaded bytes per token x tokens/s)
#      against the pinned ceiling, side by side with accelerate's cpu offload (load_checkpoint_and_dispatch
#      with the same device map) and a fully GPU-resident load;
#   4. prints a table and writes JSON (default bench/results/gpu_check.json, or $OUT/gpu_check.json).
# Exit status: 0 when the logits match, 1 when they do not, 2 when no CUDA device is visible.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
DEFAULT_OUT="$ROOT/bench/results/gpu_check.json"
[ -n "${OUT:-}" ] && DEFAULT_OUT="$OUT/gpu_check.json"
cd "$ROOT"
exec "$PY" - "$DEFAULT_OUT" "$@" <<'PYEOF'
import argparse, gc, json, os, sys, time
from pathlib import Path

import torch

default_out = sys.argv[1]
ap = argparse.ArgumentParser(prog="gpu_check.sh")
ap.add_argument("--out", default=default_out)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--new-tokens", type=int, default=32)
ap.add_argument("--offload-fraction", type=float, default=0.5)
ap.add_argument("--model-dir")
args = ap.parse_args(sys.argv[2:])

if not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible to torch (torch %s); nothing to check" % torch.__version__)
    sys.exit(2)

from bench.common import decode_bytes_per_token, print_table, time_generation, write_json  # noqa: E402
import loaders  # noqa: E402

dev = torch.device("cuda", 0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
rows, info = [], {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def h2d_ceiling(nbytes=1 << 30, pinned=True, repeats=5):
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = 0.0
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3))
    del src, dst
    return best


info["h2d_pinned_GBps"] = h2d_ceiling(pinned=True) / 1e9
info["h2d_pageable_GBps"] = h2d_ceiling(pinned=False) / 1e9
print(f"H2D ceiling: pinned {info['h2d_pinned_GBps']:.1f} GB/s, pageable {info['h2d_pageable_GBps']:.1f} GB/s")

if args.model_dir:
    path = Path(args.model_dir)
else:
    from bench.common import llama_dir
    path = llama_dir("1b", "bfloat16")
cfg = json.loads((path / "config.json").read_text())
n_layers = int(cfg["num_hidden_layers"])
n_off = max(1, int(round(n_layers * args.offload_fraction)))
split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
for i in range(n_layers):
    split[f"model.layers.{i}"] = 0 if i < n_layers - n_off else "cpu"
info.update(model=str(path), layers=n_layers, offloaded_layers=n_off)

# -- 1. correctness: fp32 logits against plain transformers on the CPU ------------------------------------------
from transformers import AutoModelForCausalLM  # noqa: E402

ids = (torch.arange(1, 33) % int(cfg["vocab_size"])).unsqueeze(0)
ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device_map={"": "cpu"}).eval()
with torch.inference_mode():
    ref_logits = ref(ids).logits.float()
del ref
gc.collect()
m = loaders.load_model(path, device_map=split, dtype="float32", show_progress=False)
with torch.inference_mode():
    got = m(ids.to(dev)).logits.float().cpu()
diff = (got - ref_logits).abs().max().item()
scale = ref_logits.abs().max().item()
info["fp32_max_abs_diff"] = diff
info["fp32_logit_scale"] = scale
ok = diff <= 1e-3 * max(1.0, scale)
print(f"fp32 logits vs CPU reference: max abs diff {diff:.3g} (scale {scale:.3g}) -> {'OK' if ok else 'MISMATCH'}")
del m
gc.collect()
torch.cuda.synchronize()


# -- 2. speed: loadmaster streaming vs accelerate cpu offload vs fully resident -------------------------------------
def offloaded_bytes(model):
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith("model.layers.") and split.get(".".join(name.split(".")[:3])) == "cpu":
            total += p.numel() * p.element_size()
    return total


def measure(label, load):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load()
    torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    gen = time_generation(_OnDevice(model), new_tokens=args.new_tokens, vocab=int(cfg["vocab_size"]))
    off = offloaded_bytes(model) if label != "loadmaster, all on GPU" else 0
    row = {"label": label, "ready_s": ready, "first_token_s": ready + gen["first_token_s"],
           "decode_tok_s": gen["decode_tok_s"], "bytes_per_token": decode_bytes_per_token(model),
           "offloaded_bytes": off, "h2d_GBps": off * gen["decode_tok_s"] / 1e9,
           "gpu_peak": torch.cuda.max_memory_allocated(), "tokens": gen["tokens"]}
    row["h2d_vs_pinned"] = row["h2d_GBps"] / info["h2d_pinned_GBps"] if off else None
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    del model
    gc.collect()
    torch.cuda.synchronize()
    return row


class _OnDevice(torch.nn.Module):
    """Feeds generate() its prompt on the GPU whatever the model's first parameter says."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def generate(self, ids, **kw):
        return self.model.generate(ids.to(dev), **kw).cpu()


dtype = getattr(torch, args.dtype)


def load_accelerate():
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = load_checkpoint_and_dispatch(model, str(path), device_map=split, dtype=dtype,
                                         no_split_module_classes=model._no_split_modules)
    model.tie_weights()
    return model.eval()


measure("loadmaster, all on GPU", lambda: loaders.load_model(path, device_map={"": 0}, dtype=args.dtype,
                                                             show_progress=False))
measure(f"loadmaster, {n_off}/{n_layers} layers CPU-offloaded",
        lambda: loaders.load_model(path, device_map=split, dtype=args.dtype, show_progress=False))
try:
    measure(f"accelerate, {n_off}/{n_layers} layers CPU-offloaded", load_accelerate)
except Exception as exc:  # keep our numbers even if the baseline breaks
    print(f"accelerate failed: {type(exc).__name__}: {exc}")
    rows.append({"label": "accelerate cpu offload", "error": str(exc)})

ref_tokens = rows[0].get("tokens")
for r in rows:
    if "tokens" in r:
        r["same_tokens"] = r["tokens"] == ref_tokens
print()
table = print_table(rows, [("label", "run"), ("ready_s", "ready s"), ("first_token_s", "first token s"),
                           ("decode_tok_s", "decode tok/s"), ("offloaded_bytes", "offloaded"),
                           ("h2d_GBps", "H2D GB/s"), ("h2d_vs_pinned", "x pinned ceiling"),
                           ("gpu_peak", "GPU peak"), ("same_tokens", "same tokens")])
print(f"pinned H2D ceiling {info['h2d_pinned_GBps']:.1f} GB/s; pageable {info['h2d_pageable_GBps']:.1f} GB/s; "
      f"fp32 logits max abs diff {diff:.3g}")
write_json(Path(args.out), {"bench": "gpu_check", "info": info, "rows": rows, "table": table})
sys.exit(0 if ok else 1)
PYEOF
