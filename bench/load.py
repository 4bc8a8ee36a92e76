"""Load benchmark: loadmaster against accelerate and transformers, fully CPU-resident, on a ~1B Llama.

For each dtype (fp32 and bf16 checkpoints, >= 4 shards each) every contender runs in a fresh process:

- loadmaster: ``loaders.load_model(path, device_map={"": "cpu"})``
- accelerate: ``init_empty_weights`` + ``load_checkpoint_and_dispatch(device_map={"": "cpu"})``
- transformers: ``AutoModelForCausalLM.from_pretrained(device_map={"": "cpu"})``

and reports time to ready, time to first token (ready + prefill of a 16-token prompt), peak RSS during the load
above the process's baseline (imports) against the CPU-resident bytes, bytes written to an offload folder, and
greedy decode tokens/s with the bandwidth it implies (weight bytes read per token x tokens/s). Page cache warm:
the shards are read once before the contenders run. The same worker serves ``bench/offload.py``.

Run from the repository root: ``.venv/bin/python -m bench.load [--dtypes float32,bfloat16] [--out bench/results/load.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import (
    best_of,
    decode_bytes_per_token,
    drop_cache,
    emit,
    llama_dir,
    machine,
    print_table,
    reset_rss_peak,
    rss_now,
    rss_peak,
    time_generation,
    token_agreement,
    write_json,
)

CONTENDERS = ("loadmaster", "accelerate", "transformers")


# -- worker (runs in a fresh process) ----------------------------------------------------------------------------
def _load(contender: str, path: str, dtype, device_map: dict, offload_folder: str | None, cpu_kernels: str = "auto"):
    from transformers import AutoConfig, AutoModelForCausalLM

    if contender == "loadmaster":
        import loaders

        return loaders.load_model(
            path,
            device_map=device_map,
            dtype=dtype,
            offload_folder=offload_folder,
            show_progress=False,
            cpu_kernels=cpu_kernels,
        )
    if contender == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        config = AutoConfig.from_pretrained(path)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = load_checkpoint_and_dispatch(
            model,
            path,
            device_map=device_map,
            offload_folder=offload_folder,
            dtype=dtype,
            no_split_module_classes=model._no_split_modules,
        )
        model.tie_weights()
        return model.eval()
    if contender == "transformers":
        return AutoModelForCausalLM.from_pretrained(
            path, device_map=device_map, dtype=dtype, offload_folder=offload_folder
        ).eval()
    raise ValueError(contender)


def _resident_bytes(model) -> int:
    stats = getattr(model, "load_stats", None)
    if stats is not None:
        return int(stats.bytes_per_device.get("cpu", 0))
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.device.type == "cpu":
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _folder_bytes(folder: str | None) -> int:
    if not folder or not os.path.isdir(folder):
        return 0
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def worker(spec: dict) -> dict:
    import torch
    import transformers  # noqa: F401  (imports are not part of the load time)

    import loaders  # noqa: F401

    if spec.get("contender") == "accelerate":
        import accelerate  # noqa: F401
    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dtype = getattr(torch, spec["dtype"])
    folder = spec.get("offload_folder")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    base = rss_now()
    reset_rss_peak()
    t0 = time.perf_counter()
    model = _load(spec["contender"], spec["path"], dtype, spec["device_map"], folder, spec.get("cpu_kernels", "auto"))
    ready = time.perf_counter() - t0
    peak_load = rss_peak()
    resident = _resident_bytes(model)
    written = _folder_bytes(folder)
    if spec.get("cold"):
        drop_cache([Path(spec["path"])] + ([Path(folder)] if folder else []))
    gen = time_generation(model, new_tokens=spec.get("new_tokens", 16), vocab=model.config.vocab_size)
    disk_bytes = _disk_bytes(spec["path"], spec["device_map"], dtype)
    per_token = decode_bytes_per_token(model)
    return {
        **{k: spec[k] for k in ("contender", "dtype")},
        "label": spec.get("label", spec["contender"]),
        "cold": bool(spec.get("cold")),
        "ready_s": ready,
        "first_token_s": ready + gen["first_token_s"],
        "prefill_s": gen["first_token_s"],
        "peak_rss_load": peak_load,
        "baseline_rss": base,
        "load_rss": peak_load - base,
        "peak_rss_end": rss_peak(),
        "resident_bytes": resident,
        "rss_over_resident": (peak_load - base) / resident if resident else None,
        "offload_written": written,
        "decode_tok_s": gen["decode_tok_s"],
        "decode_tok_s_mean": gen["decode_tok_s_mean"],
        "bytes_per_token": per_token,
        "decode_gb_s": per_token * gen["decode_tok_s"] / 1e9,
        "disk_bytes": disk_bytes,
        "tokens": gen["tokens"],
        "native_linears": getattr(getattr(model, "load_stats", None), "native_linears", 0),
    }


def _disk_bytes(path: str, device_map: dict, dtype) -> int:
    """Bytes of the checkpoint's tensors that the map sends to disk, in the run dtype."""
    from loaders.checkpoint.device_order import entry_of
    from loaders.checkpoint.index import CheckpointIndex

    total = 0
    for key, e in CheckpointIndex.open(path).entries.items():
        try:
            if device_map[entry_of(key, device_map)] == "disk":
                total += e.numel * (dtype.itemsize if e.dtype.is_floating_point else e.dtype.itemsize)
        except KeyError:
            pass
    return total


# -- driver ------------------------------------------------------------------------------------------------------
COLUMNS = [
    ("dtype", "dtype"),
    ("label", "contender"),
    ("ready_s", "ready s"),
    ("first_token_s", "first token s"),
    ("load_rss", "load RSS"),
    ("resident_bytes", "CPU-resident"),
    ("rss_over_resident", "RSS/resident"),
    ("offload_written", "offload written"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_gb_s", "GB/s"),
    ("tokens_vs_transformers", "tokens = transformers"),
]


def warm(path: Path) -> None:
    """Read every shard once so that all contenders start from a warm page cache."""
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="fresh-process runs per contender (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    ap.add_argument("--model-dir", help="use this checkpoint instead of the ~1B random-weight Llama")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "load.json"))
    args = ap.parse_args(argv)
    if args.worker:
        emit(worker(json.loads(args.worker)))
        return 0
    rows = []
    for dtype in args.dtypes.split(","):
        path = Path(args.model_dir) if args.model_dir else llama_dir("1b", dtype)
        warm(path)
        for contender in args.contenders.split(","):
            spec = {
                "contender": contender,
                "path": str(path),
                "dtype": dtype,
                "device_map": {"": "cpu"},
                "new_tokens": args.new_tokens,
                "threads": args.threads,
            }
            r = best_of("bench.load", spec, args.repeats)
            r.setdefault("dtype", dtype)
            r.setdefault("label", contender)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    ratios = {}
    for dtype in args.dtypes.split(","):
        token_agreement([r for r in rows if r.get("dtype") == dtype], "transformers")
        by = {r["label"]: r for r in rows if r.get("dtype") == dtype and "error" not in r}
        if "loadmaster" in by and "accelerate" in by:
            ratios[dtype] = {
                "ready_speedup_vs_accelerate": by["accelerate"]["ready_s"] / by["loadmaster"]["ready_s"],
                "ready_speedup_vs_transformers": (
                    by["transformers"]["ready_s"] / by["loadmaster"]["ready_s"] if "transformers" in by else None
                ),
                "loadmaster_rss_over_resident": by["loadmaster"]["rss_over_resident"],
            }
    print()
    table = print_table(rows, COLUMNS)
    print(json.dumps(ratios, indent=2))
    write_json(
        Path(args.out),
        {
            "bench": "load",
            "machine": machine(),
            "threads": args.threads,
            "rows": rows,
            "ratios": ratios,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
