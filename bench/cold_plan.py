"""Cold-start benchmark: ``loadmaster plan CONFIG`` against ``accelerate estimate-memory`` on the same config.

Each run is a fresh process, timed wall clock from spawn to exit, as a user meets it: interpreter start, imports,
reading the config, building the model description and the answer. The two tools alternate run by run, so a
neighbour's burst on this shared machine hits both alike, and each figure is the best of ``--repeats`` runs.

- ``loadmaster plan CONFIG --gpus 4x24GiB``: the command of issue 8. Where this machine's free RAM (the ``cpu``
  device when only GPUs are declared) is too small for the model, it answers "does not fit" with checked advice
  (exit 2): that is still a full plan, and the row says so.
- ``loadmaster plan CONFIG --gpus 4x24GiB --max-memory cpu=512GiB``: the same with RAM declared, so it always plans.
- ``accelerate estimate-memory DIR``: accelerate's own from-config estimate (a meta model built by transformers on
  a directory holding the ``config.json``). Its CLI first asks the Hugging Face Hub for the repo's metadata
  (``verify_on_hub``), which fails for a local directory and with no network (as here). So the accelerate runs
  are a fresh ``python`` that replaces only that lookup with the answer the Hub would give a plain transformers
  repo (library ``transformers``, no ``auto_map``) and then runs accelerate's own ``estimate_command``: its imports,
  config read, meta model and table, unchanged.

Run: ``.venv/bin/python -m bench.cold_plan`` (prints a table; ``--out FILE`` writes JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIGS = ("llama-3-70b", "mixtral-8x7b", "qwen2-72b", "gemma-2-27b", "phi-3-mini", "gpt2-xl")
GPUS = "4x24GiB"


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds from spawn to exit, the exit code, and the last line of output (for the table)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    seconds = time.perf_counter() - t0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return seconds, proc.returncode, lines[-1] if lines else ""


def contenders(config: Path, config_dir: Path) -> dict[str, list[str]]:
    loadmaster = str(BIN / "loadmaster")
    return {
        "loadmaster plan --gpus": [loadmaster, "plan", str(config), "--gpus", GPUS],
        "loadmaster plan --gpus --max-memory cpu": [
            loadmaster,
            "plan",
            str(config),
            "--gpus",
            GPUS,
            "--max-memory",
            "cpu=512GiB",
        ],
        "accelerate estimate-memory": [
            sys.executable,
            str(Path(__file__).resolve()),
            "--accelerate-worker",
            str(config_dir),
        ],
    }


def bench(names: list[str], repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="cold-plan-") as tmp:
        for name in names:
            config = ROOT / "examples" / "configs" / f"{name}.json"
            config_dir = Path(tmp) / name
            config_dir.mkdir()
            shutil.copy(config, config_dir / "config.json")
            cmds = contenders(config, config_dir)
            runs: dict[str, list[tuple[float, int, str]]] = {k: [] for k in cmds}
            for _ in range(repeats):  # interleaved: each round runs every contender once
                for label, cmd in cmds.items():
                    runs[label].append(timed(cmd))
            row: dict = {"config": name}
            for label, results in runs.items():
                best = min(results)
                row[label] = {
                    "best_s": round(best[0], 3),
                    "runs_s": [round(r[0], 3) for r in results],
                    "exit": best[1],
                    "last_line": best[2][:160],
                }
            acc = row["accelerate estimate-memory"]["best_s"]
            for label in cmds:
                row[label]["vs_accelerate"] = round(acc / row[label]["best_s"], 2)
            rows.append(row)
    return rows


def accelerate_worker(config_dir: str) -> int:
    """``accelerate estimate-memory CONFIG_DIR --library_name transformers`` with the Hub lookup answered locally."""
    from types import SimpleNamespace

    # Run as a script, this folder is sys.path[0], and its kernels.py would shadow the ``kernels`` package that
    # transformers probes for: accelerate must see the environment a user's shell gives it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from accelerate.commands import estimate

    estimate.verify_on_hub = lambda repo, token=None: SimpleNamespace(config={}, library_name="transformers")
    args = estimate.estimate_command_parser().parse_args([config_dir, "--library_name", "transformers"])
    estimate.estimate_command(args)
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--accelerate-worker":
        return accelerate_worker(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help="names under examples/configs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = bench(args.configs, args.repeats)
    labels = [k for k in rows[0] if k != "config"]
    print(f"cold wall time, best of {args.repeats} (fresh process each; ratio = accelerate / this)")
    print(f"{'config':<14}" + "".join(f"{label:>44}" for label in labels))
    for row in rows:
        cells = []
        for label in labels:
            r = row[label]
            note = "" if r["exit"] == 0 else f" exit {r['exit']}"
            cells.append(f"{r['best_s']:.2f} s ({r['vs_accelerate']:.1f}x){note}")
        print(f"{row['config']:<14}" + "".join(f"{c:>44}" for c in cells))
    for row in rows:
        for label in labels:
            if row[label]["exit"] not in (0, 2):
                print(f"! {row['config']} / {label}: {row[label]['last_line']}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"gpus": GPUS, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
