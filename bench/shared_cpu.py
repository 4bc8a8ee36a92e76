"""Serving on a shared CPU (issue 33): a quiet machine, one and two busy neighbours, and a 1-CPU quota cgroup, for
loadmaster (default threads), loadmaster ``--threads 1`` and transformers' continuous batching, side by side.

    .venv/bin/python -m bench.shared_cpu                                  # every scenario, best of 3
    .venv/bin/python -m bench.shared_cpu --scenarios quiet,busy1 --repeats 2 --out bench/results/shared_cpu.json

Each scenario starts its own neighbours: bounded busy loops (``while time.time() < deadline: pass``) that the bench
starts before and kills after, or a cgroup v1/v2 CPU quota of 1 CPU that the contender's process (server or peer)
is started in; the clients run outside it. In each round every contender runs in turn (alternating), and each
figure is the best over ``--repeats`` rounds.

- **loadmaster**: a real server; at each concurrency level (1, 4, 16) that many clients each stream one request of
  a 128-token prompt and 64 new tokens at once: tokens/s, time to first token p50/p99, inter-token latency
  p50/p99 over every stream.
- **before** (with ``--baseline DIR``): the same server from an older checkout, for before/after.
- **transformers**: ``generate_batch`` (the engine behind ``transformers serve --continuous-batching``) in a fresh
  process on the same prompts: tokens/s at each level, and the time until the whole wave of 16 has its first token
  (``max_new_tokens=1``), an upper bound on its TTFT p99.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import RESULT_PREFIX, run_together, write_json

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path(os.environ.get("LOADMASTER_TEST_CACHE") or ROOT / ".cache" / "test-models") / "llama-100m-float32"
SCENARIOS = ("quiet", "busy1", "busy2", "quota1")
CONTENDERS = ("loadmaster", "loadmaster-t1", "transformers")
LEVELS = (1, 4, 16)
NEW_TOKENS = 64
PROMPT_TOKENS = 128
BUSY_LOOP = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def wave_prompts(model: Path, n: int = 16) -> list[str]:
    """``n`` distinct prompts of about :data:`PROMPT_TOKENS` tokens each."""
    from transformers import AutoTokenizer

    from bench.serve import WORDS

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for i in range(n):
        text = f"Story {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(200))
        out.append(tok.decode(tok(text)["input_ids"][:PROMPT_TOKENS], skip_special_tokens=True))
    return out


# -- neighbours ----------------------------------------------------------------------------------------------------
@contextmanager
def neighbours(scenario: str, seconds: float = 900):
    """Busy loops for ``busyN``; for ``quota1`` a 1-CPU quota cgroup, yielded as the path to join (else None)."""
    loops = []
    group = None
    if scenario.startswith("busy"):
        code = BUSY_LOOP.format(s=seconds)
        loops = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(int(scenario[4:]))]
    elif scenario == "quota1":
        group = make_quota_cgroup(1.0)
    try:
        yield group
    finally:
        for p in loops:
            p.kill()
            p.wait()
        if group is not None:
            remove_cgroup(group)


def make_quota_cgroup(cpus: float) -> Path:
    """A cgroup whose CFS quota is ``cpus`` CPUs (v2 ``cpu.max`` where the unified hierarchy has the cpu
    controller, else v1 ``cpu.cfs_quota_us``); needs root."""
    name = f"loadmaster-bench-{uuid.uuid4().hex[:8]}"
    period = 100_000
    v2 = Path("/sys/fs/cgroup")
    if "cpu" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else False:
        group = v2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        return group
    base = next(p for p in (Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu")) if p.is_dir())
    group = base / name
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
    return group


def remove_cgroup(group: Path) -> None:
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:  # its last process is still exiting
            time.sleep(0.1)


def _joiner(group: Path | None):
    """A ``preexec_fn`` that moves the child into ``group`` before it runs anything."""
    if group is None:
        return None
    procs = str(group / "cgroup.procs")
    return lambda: Path(procs).write_text(str(os.getpid()))


# -- loadmaster ----------------------------------------------------------------------------------------------------
def _stream(url: str, text: str, out: list[dict]) -> None:
    import httpx

    body = {"inputs": text, "parameters": {"max_new_tokens": NEW_TOKENS}}
    stamps = []
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=900) as c, c.stream("POST", "/generate_stream", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
    out.append({"start": start, "stamps": stamps})


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 4)


def measure_server(url: str, prompts: list[str]) -> dict[str, Any]:
    """At each level, that many streams at once: tokens/s, TTFT and ITL percentiles."""
    out = {}
    for n in LEVELS:
        results: list[dict] = []
        wall = run_together([threading.Thread(target=_stream, args=(url, prompts[i], results)) for i in range(n)])
        ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
        itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
        out[str(n)] = {
            "tok_s": round(sum(len(r["stamps"]) for r in results) / wall, 2),
            "wall_s": round(wall, 3),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50),
            "itl_p99_s": _pct(itl, 99),
        }
    return out


def run_loadmaster(
    group: Path | None, threads: int | None, prompts: list[str], port: int, root: Path = ROOT
) -> dict[str, Any]:
    """A server from the checkout at ``root`` (``--baseline``: an older tree, for before/after)."""
    from bench.common import wait_ready

    cmd = [sys.executable, "-m", "service.cli", "serve", str(MODEL), "--port", str(port), "--log-level", "warning"]
    cmd += ["--max-batch-size", "16", "--max-total-tokens", "512", "--no-prefix-cache"]
    cmd += ["--threads", str(threads)] if threads else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(root))
    log = open(ROOT / ".cache" / f"shared_cpu-{port}.log", "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, preexec_fn=_joiner(group))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        _stream(url, "warm up", [])
        result = measure_server(url, prompts)
        import httpx

        result["cpu_threads"] = httpx.get(url + "/info", timeout=30).json().get("cpu_threads")
        return result
    finally:
        proc.terminate()
        proc.wait()
        log.close()


# -- transformers ----------------------------------------------------------------------------------------------------
def peer_worker(prompts: list[str]) -> dict[str, Any]:
    """In this process: transformers' ``generate_batch`` at each level, and the wave's first-token time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = [tok(p)["input_ids"] for p in prompts]
    cb_config = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512)

    def run(batch: list[list[int]], n: int) -> float:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=-1)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate_batch(inputs=batch, generation_config=cfg, continuous_batching_config=cb_config)
        return time.perf_counter() - t0

    run(ids[:2], 2)  # warm-up
    out: dict[str, Any] = {str(n): {"tok_s": round(n * NEW_TOKENS / run(ids[:n], NEW_TOKENS), 2)} for n in LEVELS}
    out["16"]["wave_first_token_s"] = round(run(ids, 1), 3)
    out["threads"] = torch.get_num_threads()
    return out


def run_transformers(group: Path | None, prompts: list[str]) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "bench.shared_cpu", "--peer-worker", json.dumps(prompts)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, preexec_fn=_joiner(group), timeout=1800
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return {"error": "\n".join(proc.stderr.splitlines()[-10:])}


# -- the table -----------------------------------------------------------------------------------------------------
def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level: the most tokens/s and the lowest latencies over the rounds."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out: dict[str, Any] = {}
    for level in map(str, LEVELS):
        row: dict[str, Any] = {}
        for key in ok[0][level]:
            values = [r[level][key] for r in ok if r[level].get(key) is not None]
            row[key] = (max if key == "tok_s" else min)(values) if values else None
            row[key + "_runs"] = values
        out[level] = row
    out["cpu_threads"] = ok[-1].get("cpu_threads")
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    head = "| scenario | contender | tok/s c1 | tok/s c4 | tok/s c16 | TTFT p50/p99 c16 (s) | ITL p50/p99 c16 (s) |"
    lines = [head, "|" + "---|" * 7]
    for scenario, contenders in results.items():
        for name, r in contenders.items():
            if "error" in r:
                lines.append(f"| {scenario} | {name} | error: {r['error'][:60]} | | | | |")
                continue
            c16 = r["16"]
            ttft = (
                f"{c16.get('ttft_p50_s')} / {c16.get('ttft_p99_s')}"
                if "ttft_p50_s" in c16
                else f"wave {c16.get('wave_first_token_s')}"
            )
            itl = f"{c16.get('itl_p50_s')} / {c16.get('itl_p99_s')}" if "itl_p50_s" in c16 else "-"
            lines.append(
                f"| {scenario} | {name} | {r['1']['tok_s']} | {r['4']['tok_s']} | {c16['tok_s']} | {ttft} | {itl} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=18733)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="an older checkout (git archive REV | tar -x -C DIR): adds contender 'before' (its default threads)",
    )
    p.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer_worker:
        print(RESULT_PREFIX + json.dumps(peer_worker(json.loads(args.peer_worker))), flush=True)
        return 0
    prompts = wave_prompts(MODEL)
    results: dict[str, dict[str, Any]] = {}
    for scenario in args.scenarios.split(","):
        names = args.contenders.split(",") + (["before"] if args.baseline else [])
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
        with neighbours(scenario) as group:
            time.sleep(1)
            for round_ in range(args.repeats):
                for name in runs:  # alternating: every contender once per round
                    if name == "transformers":
                        r = run_transformers(group, prompts)
                    elif name == "before":
                        r = run_loadmaster(group, None, prompts, args.port, root=args.baseline.resolve())
                    else:
                        r = run_loadmaster(group, 1 if name.endswith("t1") else None, prompts, args.port)
                    runs[name].append(r)
                    print(scenario, round_, name, json.dumps({k: r.get(k) for k in ("1", "16", "error")}), flush=True)
        results[scenario] = {name: best(rs) for name, rs in runs.items()}
    print(table(results))
    if args.out:
        payload = {"results": results, "table": table(results), "date": time.strftime("%Y-%m-%d %H:%M")}
        payload["machine"] = {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()}
        write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
