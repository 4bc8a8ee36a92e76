"""The GPU check's driver: every stage of :mod:`bench.gpu_stages` in a process of its own, under its own timeout,
its lines written to ``$OUT`` the moment they are known. Run it through ``bench/gpu_check.sh`` (which first makes the
environment), or alone:

    python -m bench.gpu_check [--out DIR] [--budget 420] [--only preflight,correctness]
    python -m bench.gpu_check --dry-run      # or LOADMASTER_GPU_CHECK_CPU=1: the CPU and a tiny model stand in

Results, rewritten after every stage so that a killed run still returns what it did:

- ``DIR/gpu_check.jsonl``: one JSON object a line (``stage``, ``name``, ``status`` PASS|FAIL|SKIP, ``detail``, data);
- ``DIR/gpu_check.json``: the stages so far, each with its status, seconds and lines, and the exit status so far;
- ``DIR/stage-<name>.log``: each stage's stderr.

Exit status: 0 when no line FAILs; 2 when torch sees no CUDA device (the other stages SKIP); else 10 + the number
(1-8) of the first stage with a FAIL line (every failure is in the JSON). A stage that raises, exits or overruns its
timeout gets a FAIL line saying so and the next stage runs.

For the CPU harness test: ``LOADMASTER_GPU_CHECK_STUB=1`` replaces every stage by one PASS line (no torch imported),
``LOADMASTER_GPU_CHECK_FAIL=<stage>`` makes that stage raise, ``LOADMASTER_GPU_CHECK_HANG=<stage>`` makes it overrun.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (stage, seconds it may take on one H100/H200 with the 1B model), in the order they run; 420 s in all.
STAGES = [
    ("preflight", 50),
    ("correctness", 60),
    ("engine", 45),
    ("streaming", 65),
    ("memory", 25),
    ("serving", 130),
    ("oom", 25),
    ("multi_gpu", 15),
]
BUDGET_S = 420


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def reporter(jsonl: Path, stage: str):
    """A ``report(name, status, detail, **data)`` that appends one line to ``jsonl`` and prints it at once."""

    def report(name: str, status: str, detail: str, **data) -> None:
        assert status in ("PASS", "FAIL", "SKIP"), status
        line = {"stage": stage, "name": name, "status": status, "detail": detail, **data}
        with jsonl.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        print(f"{status} {stage}/{name}: {detail}", flush=True)

    return report


# -- one stage, in the child ------------------------------------------------------------------------------------
def run_stage(stage: str, ctx: dict) -> int:
    report = reporter(Path(ctx["out"]) / "gpu_check.jsonl", stage)
    if os.environ.get("LOADMASTER_GPU_CHECK_HANG") == stage:
        time.sleep(3600)
    if os.environ.get("LOADMASTER_GPU_CHECK_FAIL") == stage:
        report("stub", "PASS", "a line written before the stage fails")
        raise RuntimeError(f"stage {stage} stubbed to fail")
    if os.environ.get("LOADMASTER_GPU_CHECK_STUB") == "1":
        report("stub", "PASS", "stubbed")
        return 0
    from bench.gpu_stages import STAGES as functions

    functions[stage](ctx, report)
    return 0


# -- the driver --------------------------------------------------------------------------------------------------
def _lines(jsonl: Path) -> list[dict]:
    if not jsonl.exists():
        return []
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]


def _run_child(stage: str, ctx_path: Path, timeout: float, log: Path) -> tuple[int | None, str]:
    """Run one stage in its own process group; (exit status or None on timeout, the tail of its stderr)."""
    cmd = [sys.executable, "-m", "bench.gpu_check", "--stage", stage, "--ctx", str(ctx_path)]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stderr=err, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # the stage's servers and workers go with it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    tail = log.read_text(errors="replace").strip().splitlines()[-6:]
    return rc, " | ".join(tail)[-600:]


def summarise(out: Path, stages: list[dict], started: float, device: str) -> int:
    """Rewrite gpu_check.json from the lines so far; the exit status so far."""
    lines = _lines(out / "gpu_check.jsonl")
    code = 0
    for number, st in enumerate(stages, 1):
        mine = [ln for ln in lines if ln["stage"] == st["stage"]]
        st["lines"] = mine
        st["status"] = (
            "FAIL"
            if any(ln["status"] == "FAIL" for ln in mine)
            else "PASS"
            if any(ln["status"] == "PASS" for ln in mine)
            else "SKIP"
        )
        if any(ln.get("no_gpu") for ln in mine):
            code = code or 2
        elif st["status"] == "FAIL" and code == 0:
            code = 10 + number
    payload = {
        "bench": "gpu_check",
        "device": device,
        "seconds": round(time.monotonic() - started, 1),
        "exit": code,
        "stages": stages,
    }
    _write(out / "gpu_check.json", json.dumps(payload, indent=1, default=str))
    return code


def drive(args: argparse.Namespace) -> int:
    out, started = Path(args.out), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "gpu_check.jsonl"
    jsonl.unlink(missing_ok=True)
    dry = args.dry_run
    ctx = {
        "dry": dry,
        "out": str(out),
        "work": str(Path(args.work_dir).resolve()),
        "tokens": 8 if dry else 64,
        "clients": 4 if dry else 16,
        "serve_tokens": 8 if dry else 128,
    }
    Path(ctx["work"]).mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    device = "cpu (dry run)" if dry else "gpu"
    stages: list[dict] = []
    deadline = started + args.budget
    for number, (stage, seconds) in enumerate(STAGES, 1):
        if only and stage not in only:
            continue
        entry = {"stage": stage, "number": number}
        stages.append(entry)
        left = deadline - time.monotonic()
        if summarise(out, stages[:-1], started, device) == 2:
            reporter(jsonl, stage)("not run", "SKIP", "no CUDA device")
        elif left < 5:
            reporter(jsonl, stage)("not run", "SKIP", f"the run's {args.budget:.0f} s budget is spent")
        else:
            timeout = min(seconds * args.scale, left)
            stage_ctx = dict(ctx, stage_timeout=timeout, deadline_in=timeout)
            ctx_path = out / f"ctx-{stage}.json"
            ctx_path.write_text(json.dumps(stage_ctx))
            t0 = time.monotonic()
            rc, tail = _run_child(stage, ctx_path, timeout, out / f"stage-{stage}.log")
            entry["seconds"] = round(time.monotonic() - t0, 1)
            if rc is None:
                reporter(jsonl, stage)("timeout", "FAIL", f"killed after {timeout:.0f} s; {tail}")
            elif rc != 0:
                reporter(jsonl, stage)("crashed", "FAIL", f"exit status {rc}: {tail}")
            elif not any(ln["stage"] == stage for ln in _lines(jsonl)):
                reporter(jsonl, stage)("no result", "FAIL", "the stage wrote no line")
        code = summarise(out, stages, started, device)
    code = summarise(out, stages, started, device)
    failed = [f"{s['number']} {s['stage']}" for s in stages if s["status"] == "FAIL"]
    print(
        f"gpu_check: exit {code}; {len(stages)} stages in {time.monotonic() - started:.0f} s; "
        f"failed: {', '.join(failed) or 'none'}; results in {out / 'gpu_check.json'}",
        flush=True,
    )
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("LOADMASTER_GPU_CHECK_CPU") == "1",
        help="the CPU stands in for GPU 0, a tiny model for the 1B one (LOADMASTER_GPU_CHECK_CPU=1)",
    )
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "gpu_check"))
    p.add_argument(
        "--work-dir",
        default=os.environ.get("LOADMASTER_GPU_CHECK_WORK", "/tmp/loadmaster-gpu-check"),
        help="where the model is built and the disk offload folder lives",
    )
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole run may take (default 420)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's timeout (a slow dry run)")
    p.add_argument("--only", help="comma-separated stages to run (the others are left out of the results)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--ctx", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage:
        ctx = json.loads(Path(args.ctx).read_text())
        ctx["deadline"] = time.monotonic() + ctx["deadline_in"]
        return run_stage(args.stage, ctx)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
