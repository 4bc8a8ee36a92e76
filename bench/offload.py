"""Offload benchmark: half of a ~1B Llama's decoder layers on disk, loadmaster against accelerate and transformers.

The same device map for everyone: embeddings, the first half of the layers, the final norm and the head on the
CPU; the second half on ``"disk"``. Each contender runs in a fresh process (``bench/load.py``'s worker) and
reports time to ready, bytes written to its offload folder, time to first token and decode tokens/s with the
bandwidth achieved (weight bytes read per token x tokens/s). A fully resident loadmaster run is the reference
for the ">= 0.8x resident" target.

loadmaster runs its linear layers on the native kernels (``loaders/native/kernel_build.py``) where they build; two
more rows run the same loader with torch's kernels (``cpu_kernels="torch"``), so the table shows what the loader
buys and what the kernel buys. "tokens = transformers" counts how many greedy tokens, from the first, equal
those of transformers on the same weights and map.

Warm: the page cache holds the shards (and each contender's offload files, just written). Cold: after the
load, the shards' and offload files' pages are dropped (``posix_fadvise(DONTNEED)``) before generating; the
first token then reads the disk share from the device, whose cold sequential read rate is measured as the
ceiling.

Run from the repository root: ``.venv/bin/python -m bench.offload [--dtype bfloat16] [--out bench/results/offload.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import best_of, disk_read_bandwidth, llama_dir, machine, print_table, token_agreement, write_json
from bench.load import warm

LOAD_WORKER = "bench.load"


def half_on_disk_map(path: Path) -> tuple[dict, int]:
    """Second half of the decoder layers on disk, everything else on the CPU. Returns (map, disk layers)."""
    cfg = json.loads((path / "config.json").read_text())
    n = int(cfg["num_hidden_layers"])
    dm: dict = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(n):
        dm[f"model.layers.{i}"] = "cpu" if i < n // 2 else "disk"
    return dm, n - n // 2


COLUMNS = [
    ("label", "contender"),
    ("ready_s", "ready s"),
    ("offload_written", "offload written"),
    ("first_token_s", "first token s"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_gb_s", "GB/s"),
    ("vs_accelerate", "x accelerate"),
    ("vs_resident", "x resident"),
    ("cold_read_gb_s", "cold read GB/s"),
    ("load_rss", "load RSS"),
    ("tokens_vs_transformers", "tokens = transformers"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contenders", default="loadmaster,accelerate,transformers")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="fresh-process runs per contender (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    ap.add_argument(
        "--no-torch-kernels",
        action="store_true",
        help="skip the loadmaster runs with torch's linear kernels instead of the native ones",
    )
    ap.add_argument("--model-dir", help="use this checkpoint instead of the ~1B random-weight Llama")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "offload.json"))
    args = ap.parse_args(argv)

    path = Path(args.model_dir) if args.model_dir else llama_dir("1b", args.dtype)
    dm, disk_layers = half_on_disk_map(path)
    shards = sorted(path.glob("*.safetensors"))
    ceiling = disk_read_bandwidth(max(shards, key=lambda p: p.stat().st_size))
    warm(path)
    work = Path(tempfile.mkdtemp(prefix="loadmaster-bench-"))
    runs = [{"contender": "loadmaster", "label": "loadmaster, all resident", "device_map": {"": "cpu"}}]
    for c in args.contenders.split(","):
        runs.append({"contender": c, "label": f"{c}, half on disk (warm)", "device_map": dm})
    if not args.no_torch_kernels and "loadmaster" in args.contenders.split(","):
        # The same loader with torch's own linear kernels: separates what the loader buys from what the
        # native kernels buy. Its "x resident" is against the resident run with torch kernels too.
        runs.append(
            {
                "contender": "loadmaster",
                "label": "loadmaster (torch kernels), all resident",
                "device_map": {"": "cpu"},
                "cpu_kernels": "torch",
            }
        )
        runs.append(
            {
                "contender": "loadmaster",
                "label": "loadmaster (torch kernels), half on disk (warm)",
                "device_map": dm,
                "cpu_kernels": "torch",
            }
        )
    if not args.no_cold:
        for c in args.contenders.split(","):
            runs.append({"contender": c, "label": f"{c}, half on disk (cold)", "device_map": dm, "cold": True})
    rows = []
    for run in runs:
        spec = {
            **run,
            "path": str(path),
            "dtype": args.dtype,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "offload_folder": str(work / run["contender"]),
        }
        r = best_of(LOAD_WORKER, spec, args.repeats)
        r.setdefault("label", run["label"])
        if r.get("cold") and r.get("prefill_s"):
            # the first forward pass reads the whole disk share from the device
            r["cold_read_gb_s"] = r.get("disk_bytes", 0) / r["prefill_s"] / 1e9 if r.get("disk_bytes") else None
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    token_agreement(rows, "transformers, half on disk (warm)")
    residents = {
        r["label"].removesuffix(", all resident"): r
        for r in rows
        if r["label"].endswith("all resident") and "error" not in r
    }
    for temp in ("warm", "cold"):
        acc = next((r for r in rows if r["label"] == f"accelerate, half on disk ({temp})" and "error" not in r), None)
        for r in rows:
            if r["label"].endswith(f"({temp})") and "decode_tok_s" in r:
                if acc and acc.get("decode_tok_s"):
                    r["vs_accelerate"] = r["decode_tok_s"] / acc["decode_tok_s"]
                # against the resident run of the same contender and kernels (loadmaster's by default)
                resident = residents.get(r["label"].split(", half on disk")[0], residents.get("loadmaster"))
                if resident and resident.get("decode_tok_s"):
                    r["vs_resident"] = r["decode_tok_s"] / resident["decode_tok_s"]
    print()
    table = print_table(rows, COLUMNS)
    print(
        f"disk: {disk_layers} of {len([k for k in dm if k.startswith('model.layers.')])} layers; "
        f"cold sequential read ceiling {ceiling / 1e9:.2f} GB/s"
    )
    write_json(
        Path(args.out),
        {
            "bench": "offload",
            "machine": machine(),
            "threads": args.threads,
            "dtype": args.dtype,
            "device_map": dm,
            "disk_read_bandwidth": ceiling,
            "rows": rows,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
