"""Planner benchmark: loadmaster's planner against accelerate's, on the same meta models and max_memory.

For each real architecture (built by transformers on the meta device from its published config) and a
synthetic MoE with over 150k tensors, it measures, in one run:

- planning time: ours (walk the meta model into a Skeleton + plan) against accelerate
  (``get_balanced_memory`` + ``infer_auto_device_map``), best of a few repeats;
- for batch 8 at context 4096, per device: each planner's planned total against the real need of its map
  (weights + KV cache + activations + logits, computed by one sizing model for both), and whether that need
  exceeds the device.

The real architectures are the published configs in ``examples/configs``. Prints a table and writes JSON (``--out``).
Run from the repository root: ``.venv/bin/python -m bench.plan``. ``--moe`` prints the mixture-of-experts table
instead: predicted tokens/s of layer-wise offload against the sparsity-aware ``auto`` (issue 15, docs/moe.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from planner.api import plan  # noqa: E402
from planner.hardware.device_inventory import build_hardware  # noqa: E402
from planner.hardware.devices import device_label  # noqa: E402
from planner.hardware.units import format_bytes, parse_size  # noqa: E402
from planner.model.skeleton import config_from_dict, skeleton_from_model  # noqa: E402
from planner.placement.inputs import make_workload  # noqa: E402
from planner.placement.solve import make_problem  # noqa: E402
from planner.placement.strategies import compute_loads  # noqa: E402
from planner.types import Block, DeviceId, KVGeometry, Skeleton, TensorSpec  # noqa: E402

log = logging.getLogger("bench.plan")
GPUS = 4
GPU_SIZE = "24GiB"
CPU_SIZE = "512GiB"
BATCH, CONTEXT = 8, 4096


def real_configs() -> dict[str, dict]:
    """The published configs of real models shipped in ``examples/configs``, by file stem."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(CONFIGS.glob("*.json"))}


def synthetic_llama(layers: int, hidden: int = 64, intermediate: int = 128, vocab: int = 1000) -> Skeleton:
    """A Llama-shaped Skeleton of plain numbers (9 tensors a layer), for timing the planner against size."""
    heads, kv_heads, dtype = 8, 2, "float32"
    head_dim = hidden // heads

    def weight(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(f"{name}.weight", shape, dtype, "parameter", len(shape) == 2 and "embed" not in name)

    blocks = [Block("model.embed_tokens", (weight("model.embed_tokens", vocab, hidden),), is_embedding=True)]
    for i in range(layers):
        p = f"model.layers.{i}"
        blocks.append(
            Block(
                p,
                (
                    weight(f"{p}.self_attn.q_proj", hidden, hidden),
                    weight(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden),
                    weight(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden),
                    weight(f"{p}.self_attn.o_proj", hidden, hidden),
                    weight(f"{p}.mlp.gate_proj", intermediate, hidden),
                    weight(f"{p}.mlp.up_proj", intermediate, hidden),
                    weight(f"{p}.mlp.down_proj", hidden, intermediate),
                    weight(f"{p}.input_layernorm", hidden),
                    weight(f"{p}.post_attention_layernorm", hidden),
                ),
                no_split=True,
                layer_index=i,
            )
        )
    blocks.append(Block("model.norm", (weight("model.norm", hidden),)))
    blocks.append(Block("lm_head", (weight("lm_head", vocab, hidden),), is_head=True))
    return Skeleton(
        name="synthetic-llama",
        architecture="LlamaForCausalLM",
        model_type="llama",
        blocks=tuple(blocks),
        tied_groups=(),
        no_split_classes=("LlamaDecoderLayer",),
        kv=KVGeometry(layers, kv_heads, head_dim),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        default_dtype=dtype,
    )


def meta_model(cfg: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = config_from_dict(cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


class _Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)


class _MoELayer(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden // 4, bias=False)
        self.v_proj = nn.Linear(hidden, hidden // 4, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, inter) for _ in range(experts))
        self.norm = nn.LayerNorm(hidden)


class SyntheticMoE(nn.Module):
    """An MoE with one nn.Linear per expert projection, as unfused MoE checkpoints are laid out: many tensors."""

    _no_split_modules = ["_MoELayer"]

    def __init__(
        self, layers: int = 40, experts: int = 1280, hidden: int = 1024, inter: int = 256, vocab: int = 32000
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_MoELayer(hidden, inter, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def synthetic_skeleton_fields(model: SyntheticMoE) -> Skeleton:
    """Our skeleton of the synthetic MoE; it has no transformers config, so the geometry is filled in here."""
    from dataclasses import replace

    from planner.types import KVGeometry

    skel = skeleton_from_model(model, name="synthetic-moe")
    hidden = model.embed_tokens.embedding_dim
    return replace(
        skel,
        kv=KVGeometry(len(model.layers), 8, hidden // 32),
        vocab_size=model.embed_tokens.num_embeddings,
        hidden_size=hidden,
        intermediate_size=2 * model.layers[0].experts[0].w1.out_features,
        num_attention_heads=32,
        default_dtype="bfloat16",
    )


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def accelerate_map(model: nn.Module, max_memory: dict) -> dict[str, Any]:
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(
        model, max_memory=dict(max_memory), no_split_module_classes=no_split, dtype=torch.bfloat16
    )
    return infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=torch.bfloat16)


def needs_of_map(skel: Skeleton, device_map: dict[str, Any], max_memory: dict) -> dict[DeviceId, int]:
    """Real need per device of any device map: our sizing of weights + KV + activations + logits (no reserve)."""
    hw = build_hardware(max_memory, gpu_reserve=0)
    workload = make_workload(skel, "bf16", None, BATCH, CONTEXT)
    problem = make_problem(skel, hw, workload)
    keys = sorted(device_map, key=len, reverse=True)

    def device_of(name: str) -> DeviceId:
        for k in keys:
            if k == "" or name == k or name.startswith(k + "."):
                v = device_map[k]
                return v if isinstance(v, int) or v in ("cpu", "disk") else int(str(v).split(":")[-1])
        raise KeyError(name)

    assignment = [device_of(b.tensors[0].name if b.tensors else b.name) for b in skel.blocks]
    loads = compute_loads(problem, assignment)
    return {d.id: loads.total(d.id) for d in hw.devices}


def bench_one(
    name: str, model: nn.Module, skel_fn: Callable[[nn.Module], Skeleton], max_memory: dict, repeats: int
) -> dict[str, Any]:
    def ours() -> Any:
        skel = skel_fn(model)
        return skel, plan(skel, max_memory=max_memory, strategy="auto", dtype="bf16", batch_size=BATCH, context=CONTEXT)

    t_ours, (skel, our_plan) = best_time(ours, repeats)
    t_plan_only, _ = best_time(
        lambda: plan(skel, max_memory=max_memory, strategy="auto", dtype="bf16", batch_size=BATCH, context=CONTEXT),
        repeats,
    )
    t_acc, acc = best_time(lambda: accelerate_map(model, max_memory), max(1, repeats if name != "synthetic-moe" else 1))
    acc_need = needs_of_map(skel, acc, max_memory)
    caps = {k if not str(k).isdigit() else int(k): parse_size(v) for k, v in max_memory.items()}
    devices = []
    for b in our_plan.budgets:
        cap = caps[b.device]
        devices.append(
            {
                "device": device_label(b.device),
                "capacity": cap,
                "ours_total": b.total,
                "ours_over": b.total > cap,
                "accelerate_need": acc_need.get(b.device, 0),
                "accelerate_over": acc_need.get(b.device, 0) > cap,
            }
        )
    n_tensors = sum(len(b.tensors) for b in skel.blocks)
    return {
        "model": name,
        "tensors": n_tensors,
        "ours_seconds": t_ours,
        "ours_plan_only_seconds": t_plan_only,
        "accelerate_seconds": t_acc,
        "speedup": t_acc / t_ours if t_ours else float("inf"),
        "plan_only_speedup": t_acc / t_plan_only if t_plan_only else float("inf"),
        "ours_strategy": our_plan.strategy,
        "ours_offloaded": our_plan.offloaded_bytes,
        "ours_decode_tokens_per_s": our_plan.prediction.decode_tokens_per_s,
        "devices": devices,
    }


def scaling(points: tuple[int, ...] = (1_000, 10_000, 100_000), repeats: int = 3) -> list[dict[str, Any]]:
    """Planning time of synthetic Skeletons (no torch) against their tensor count: it should grow linearly."""
    rows = []
    for n in points:
        skel = synthetic_llama(layers=max(1, n // 9))
        tensors = sum(len(b.tensors) for b in skel.blocks)
        mm = {i: "64MiB" for i in range(4)}
        mm["cpu"] = "64GiB"
        t, _ = best_time(
            lambda skel=skel, mm=mm: plan(
                skel, max_memory=mm, strategy="auto", dtype="bf16", context=256, gpu_reserve=0
            ),
            repeats,
        )
        rows.append({"tensors": tensors, "seconds": t, "us_per_tensor": t / tensors * 1e6})
    return rows


#: The MoE table: (config stem, GPUs, cpu RAM) with layer-wise offload against the sparsity-aware plan (issue 15).
MOE_CASES = [
    ("mixtral-8x7b", "1x24GiB", "256GiB"),
    ("mixtral-8x7b", "8x80GB", "2TiB"),
    ("qwen3-moe-30b-a3b", "1x24GiB", "256GiB"),
    ("qwen3-moe-30b-a3b", "8x80GB", "2TiB"),
    ("gpt-oss-120b", "1x24GiB", "256GiB"),
    ("gpt-oss-120b", "8x80GB", "2TiB"),
    ("deepseek-v3", "1x80GB", "2TiB"),
    ("deepseek-v3", "8x80GB", "2TiB"),
    ("deepseek-v3", "1x24GiB", "2TiB"),  # the layers without their experts do not fit: cpu_layers against streaming
]
MOE_BATCHES = (1, 4)
MOE_CONTEXT = 4096


def moe_table() -> list[dict[str, Any]]:
    """Predicted decode tokens/s of the layer-wise plans (best of sequential and balanced: whole layers on the
    GPUs, the rest streamed) against ``auto``, which may keep routed experts on the CPU; both under the
    sparsity-aware cost model, bf16, on declared hardware (no machine needed)."""
    rows = []
    for stem, gpus, cpu in MOE_CASES:
        path = str(CONFIGS / f"{stem}.json")
        for batch in MOE_BATCHES:
            kw = dict(gpus=gpus, max_memory={"cpu": cpu}, dtype="bf16", batch_size=batch, context=MOE_CONTEXT)
            layer_wise = max(
                (plan(path, strategy=s, **kw) for s in ("sequential", "balanced")),
                key=lambda p: p.prediction.decode_tokens_per_s,
            )
            auto = plan(path, **kw)
            gpus_used = len({d for d in auto.placement.values() if isinstance(d, int)})
            rows.append(
                {
                    "model": stem,
                    "gpus": gpus,
                    "cpu": cpu,
                    "batch": batch,
                    "layer_wise_strategy": layer_wise.strategy,
                    "layer_wise_tokens_per_s": layer_wise.prediction.decode_tokens_per_s,
                    "layer_wise_streamed": layer_wise.offloaded_bytes,
                    "auto_strategy": auto.strategy,
                    "auto_tokens_per_s": auto.prediction.decode_tokens_per_s,
                    "auto_streamed": auto.offloaded_bytes,
                    "auto_gpus_used": gpus_used,
                    "ratio": auto.prediction.decode_tokens_per_s / layer_wise.prediction.decode_tokens_per_s,
                }
            )
    return rows


def print_moe_table(rows: list[dict[str, Any]]) -> None:
    print(f"\nMoE: layer-wise offload against auto (sparsity-aware), bf16, context {MOE_CONTEXT}, predicted tok/s")
    print(
        f"{'model':<18} {'hardware':<17} {'batch':>5} {'layer-wise':>10} {'streamed':>9} {'auto':>9} "
        f"{'streamed':>9} {'ratio':>6} {'GPUs':>4}  auto strategy"
    )
    for r in rows:
        print(
            f"{r['model']:<18} {r['gpus'] + ' + ' + r['cpu']:<17} {r['batch']:>5} "
            f"{r['layer_wise_tokens_per_s']:>10.3g} {format_bytes(r['layer_wise_streamed']):>9} "
            f"{r['auto_tokens_per_s']:>9.3g} {format_bytes(r['auto_streamed']):>9} {r['ratio']:>5.1f}x "
            f"{r['auto_gpus_used']:>4}  {r['auto_strategy']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan.json"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default=",".join(sorted(real_configs()) + ["synthetic-moe"]))
    ap.add_argument("--moe-layers", type=int, default=40)
    ap.add_argument("--moe-experts", type=int, default=1280)
    ap.add_argument("--moe", action="store_true", help="print only the MoE table (layer-wise against sparsity-aware)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.moe:
        rows = moe_table()
        print_moe_table(rows)
        out = Path(args.out).with_name("plan_moe.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"context": MOE_CONTEXT, "rows": rows}, indent=2))
        print(f"\nwrote {out}")
        return 0
    max_memory: dict[Any, str] = {i: GPU_SIZE for i in range(GPUS)}
    max_memory["cpu"] = CPU_SIZE
    results = []
    for name in args.models.split(","):
        log.info("building %s on the meta device", name)
        if name == "synthetic-moe":
            with torch.device("meta"):
                model = SyntheticMoE(layers=args.moe_layers, experts=args.moe_experts).to(torch.bfloat16)
            skel_fn: Callable[[nn.Module], Skeleton] = synthetic_skeleton_fields  # type: ignore[assignment]
        else:
            model = meta_model(real_configs()[name])
            skel_fn = lambda m, n=name: skeleton_from_model(m, name=n)  # noqa: E731
        log.info("planning %s", name)
        results.append(bench_one(name, model, skel_fn, max_memory, args.repeats))
        del model
        gc.collect()

    print(f"\nPlanning on {GPUS}x{GPU_SIZE} + cpu {CPU_SIZE}, bf16, batch {BATCH} x context {CONTEXT}\n")
    print("ours = walk the meta model into a Skeleton + plan; plan = planning from the Skeleton alone")
    print(
        f"{'model':<14} {'tensors':>8} {'accelerate':>11} {'ours':>9} {'ratio':>6} {'plan':>9} {'ratio':>6}  strategy"
    )
    for r in results:
        print(
            f"{r['model']:<14} {r['tensors']:>8} {r['accelerate_seconds'] * 1e3:>9.1f}ms "
            f"{r['ours_seconds'] * 1e3:>7.1f}ms {r['speedup']:>5.1f}x "
            f"{r['ours_plan_only_seconds'] * 1e3:>7.1f}ms {r['plan_only_speedup']:>5.1f}x  {r['ours_strategy']}"
        )
    print(
        f"\nPer device at batch {BATCH} x context {CONTEXT}: planned total (ours) and real need of the map "
        "(weights + KV + activations + logits); '!' = over capacity"
    )
    print(f"{'model':<14} {'device':<6} {'capacity':>9} {'ours':>10} {'accelerate':>11}")
    for r in results:
        for d in r["devices"]:
            print(
                f"{r['model']:<14} {d['device']:<6} {format_bytes(d['capacity']):>9} "
                f"{format_bytes(d['ours_total']) + ('!' if d['ours_over'] else ' '):>10} "
                f"{format_bytes(d['accelerate_need']) + ('!' if d['accelerate_over'] else ' '):>11}"
            )
    scale = scaling()
    print("\nPlanning time against model size (synthetic skeletons, auto strategy, 4 GPUs + cpu):")
    print(f"{'tensors':>8} {'seconds':>9} {'us/tensor':>10}")
    for row in scale:
        print(f"{row['tensors']:>8} {row['seconds']:>9.4f} {row['us_per_tensor']:>10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "gpus": GPUS,
                "gpu_size": GPU_SIZE,
                "cpu": CPU_SIZE,
                "batch": BATCH,
                "context": CONTEXT,
                "results": results,
                "scaling": scale,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0 if not any(d["ours_over"] for r in results for d in r["devices"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
