"""Issue 37's client checks: unmodified guidellm and lm-eval, from PyPI, against a real ``loadmaster serve``.

Outside CI. Neither client is a project dependency, and this script installs nothing: it runs their command-line
tools from a separate environment (their pins would move the project's), made once with

    python3 -m venv .clients-venv && .clients-venv/bin/pip install guidellm "lm-eval[api,hf]"

and then, with the project's interpreter (which starts the server):

    .venv/bin/python -m bench.peers.agent_clients --clients-venv .clients-venv            # the 100M Llama, fp32
    .venv/bin/python -m bench.peers.agent_clients --clients-venv .clients-venv --skip lm-eval --formats chat

- guidellm: a sweep (synchronous, throughput, then constant rates between them) of synthetic prompts, once per
  request format (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``: ``--formats``). It passes when
  no request of any strategy errored or was left incomplete. The throughput stage's concurrency is the server's
  ``max_concurrent_requests`` (from ``/info``): guidellm's default, 512, is more than the server admits, and the
  refused ones (429, by design) would count as errors of the client's configuration, not of the server.
- lm-eval: a small log-likelihood task (multiple choice, plus a rolling one) on a dataset written here, scored by
  ``local-completions`` through the server (token ids, echo, logprobs) and by lm-eval's own ``hf`` backend on the
  same model folder, both adding BOS. It passes when every request's log-likelihood agrees within ``--tolerance``
  and the greedy flags are equal. (``tokenized_requests=False`` is not compared: lm-eval then decodes its ids,
  BOS included, back to text, which any server that adds BOS to a text prompt, vLLM too, reads one token longer.)

Prints a pass/fail line for each client, the largest log-likelihood difference, and one ``BENCH_RESULT {...}``
line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULT_PREFIX, llama_dir, spawn_server, wait_ready

#: guidellm's request formats, by the short names ``--formats`` takes.
FORMATS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
#: The multiple-choice documents: each context is scored with every choice (a log-likelihood request apiece).
CHOICE_DOCS = [
    ("The capital of France is", [" Paris", " London", " Berlin"]),
    ("Two plus two equals", [" four", " five", " 22"]),
    ("She opened the door and saw", [" a cat sleeping on the mat.", " nothing at all", " the sea"]),
    ("In 1969, the first humans", [" landed on the Moon", " crossed the Atlantic", " built a bridge"]),
    ("Water boils at", [" 100 degrees Celsius", " 50°C", " room temperature"]),
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"]),
    ("Café au lait is a drink made with", [" coffee and milk", " tea", " juice — or so they say"]),
    ("Question: What colour is the sky?\nAnswer:", [" blue", " green", " red"]),
]
#: The rolling documents: whole texts scored token by token (lm-eval's perplexity tasks).
ROLLING_DOCS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day, and the meadow smelled of fresh grass.",
    "Loadmaster plans where each tensor lives before a single weight is read, then serves what it loaded.",
]
TASKS = ("agent_clients_choice", "agent_clients_rolling")


@dataclass
class SweepStage:
    """One strategy of a guidellm sweep, as its JSON report counts it."""

    strategy: str
    successful: int
    errored: int
    incomplete: int
    requests_per_s: float
    output_tokens_per_s: float


@dataclass
class GuidellmRun:
    format: str
    returncode: int
    stages: list[SweepStage] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return (
            self.returncode == 0
            and bool(self.stages)
            and all(s.errored == 0 and s.incomplete == 0 and s.successful > 0 for s in self.stages)
        )


@dataclass
class LogLikelihoods:
    """lm-eval's comparison: the largest |local-completions - hf| over all requests, and greedy flags that differ."""

    requests: int
    max_abs_diff: float
    greedy_mismatches: int
    error: str | None = None

    def passed(self, tolerance: float) -> bool:
        return (
            self.error is None and self.requests > 0 and self.max_abs_diff <= tolerance and not self.greedy_mismatches
        )


def client_env(home: Path) -> dict[str, str]:
    """The clients' environment: offline (nothing may come from the Hub), their caches in the run's folder."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(home / "hf-home"),
        TOKENIZERS_PARALLELISM="false",
    )


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float) -> int:
    """Run a client, its output into ``log_path``; the exit status (124 when it ran past ``timeout``)."""
    print("$ " + " ".join(cmd), flush=True)
    with log_path.open("w") as log:
        try:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


# -- guidellm -------------------------------------------------------------------------------------------------------
def _stage(bench: dict[str, Any]) -> SweepStage:
    strategy = bench["config"]["strategy"]
    rate = strategy.get("rate") or strategy.get("max_concurrency") or strategy.get("streams")
    label = strategy["type_"] + (f"@{rate:.3g}" if isinstance(rate, (int, float)) else "")
    requests = bench["requests"]
    metrics = bench["metrics"]
    return SweepStage(
        strategy=label,
        successful=len(requests.get("successful") or []),
        errored=len(requests.get("errored") or []),
        incomplete=len(requests.get("incomplete") or []),
        requests_per_s=float(metrics["requests_per_second"]["successful"]["mean"]),
        output_tokens_per_s=float(metrics["output_tokens_per_second"]["successful"]["mean"]),
    )


def run_guidellm(args: argparse.Namespace, url: str, model: Path, name: str, concurrency: int, out: Path) -> list:
    """One sweep per request format; each one's stages from guidellm's JSON report."""
    runs = []
    env = client_env(out)
    for short in args.formats.split(","):
        fmt = FORMATS[short]
        report = out / f"guidellm-{short}.json"
        cmd = [
            str(Path(args.clients_venv) / "bin" / "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={url},model={name},request_format={fmt}",
            "--profile",
            f"kind=sweep,sweep_size={args.sweep_size},max_concurrency={concurrency}",
            "--constraint",
            f"kind=max_requests,count={args.requests}",
            "--constraint",
            f"kind=max_duration,seconds={args.max_seconds}",
            "--tokenizer",
            f"kind=huggingface_auto,model={model}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ]
        rc = run_logged(cmd, out / f"guidellm-{short}.log", env, args.client_timeout)
        run = GuidellmRun(format=fmt, returncode=rc)
        try:
            run.stages = [_stage(b) for b in json.loads(report.read_text())["benchmarks"]]
        except (OSError, KeyError, ValueError) as e:
            run.error = f"no report ({type(e).__name__}: {e}); see {out / f'guidellm-{short}.log'}"
        runs.append(run)
        _print_guidellm(run)
    return runs


def _print_guidellm(run: GuidellmRun) -> None:
    print(f"guidellm {run.format}: {'PASS' if run.passed else 'FAIL'} (exit {run.returncode})", flush=True)
    if run.error:
        print(f"  {run.error}")
    for s in run.stages:
        print(
            f"  {s.strategy:<18} ok {s.successful:>4}  errored {s.errored:>3}  incomplete {s.incomplete:>3}  "
            f"{s.requests_per_s:7.2f} req/s  {s.output_tokens_per_s:8.1f} output tok/s"
        )


# -- lm-eval --------------------------------------------------------------------------------------------------------
def write_tasks(folder: Path) -> Path:
    """The two tasks and their local datasets (lm-eval reads them with ``--include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    choice = folder / "choice.jsonl"
    choice.write_text("".join(json.dumps({"context": c, "choices": ch, "label": 0}) + "\n" for c, ch in CHOICE_DOCS))
    rolling = folder / "rolling.jsonl"
    rolling.write_text("".join(json.dumps({"text": t}) + "\n" for t in ROLLING_DOCS))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (folder / f"{TASKS[0]}.yaml").write_text(
        f"task: {TASKS[0]}\n{common}dataset_kwargs:\n  data_files:\n    test: {choice}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_target: label\ndoc_to_choice: choices\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    (folder / f"{TASKS[1]}.yaml").write_text(
        f"task: {TASKS[1]}\n{common}dataset_kwargs:\n  data_files:\n    test: {rolling}\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    return folder


def _samples(folder: Path, task: str) -> dict[tuple[int, int], tuple[float, str | None]]:
    """Each request's (log-likelihood, greedy flag) from lm-eval's ``--log_samples`` file, by (doc, request)."""
    path = next(folder.rglob(f"samples_{task}_*.jsonl"))
    out = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for j, resp in enumerate(sample["resps"]):
            value = resp[0]
            if isinstance(value, (list, tuple)):
                out[(sample["doc_id"], j)] = (float(value[0]), str(value[1]) if len(value) > 1 else None)
            else:
                out[(sample["doc_id"], j)] = (float(value), None)
    return out


def run_lm_eval(args: argparse.Namespace, url: str, model: Path, name: str, out: Path) -> LogLikelihoods:
    tasks = write_tasks(out / "lm-eval-tasks")
    lm_eval = str(Path(args.clients_venv) / "bin" / "lm-eval")
    common = ["--tasks", ",".join(TASKS), "--include_path", str(tasks), "--log_samples"]
    api_args = (
        f"model={name},base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
        "tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1"
    )
    env = client_env(out)
    runs = {
        "local-completions": [lm_eval, "run", "--model", "local-completions", "--model_args", api_args]
        + ["--batch_size", str(args.lm_batch)],
        "hf": [lm_eval, "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32,add_bos_token=True"]
        + ["--device", "cpu"],
    }
    for backend, cmd in runs.items():
        rc = run_logged(
            [*cmd, *common, "--output_path", str(out / backend)], out / f"{backend}.log", env, args.client_timeout
        )
        if rc != 0:
            return LogLikelihoods(0, float("inf"), 0, error=f"lm-eval {backend} exited {rc}; see {out / backend}.log")
    worst, mismatches, count = 0.0, 0, 0
    try:
        for task in TASKS:
            api, ref = _samples(out / "local-completions", task), _samples(out / "hf", task)
            if api.keys() != ref.keys():
                return LogLikelihoods(0, float("inf"), 0, error=f"{task}: the two runs scored different requests")
            for key, (ll, greedy) in api.items():
                worst = max(worst, abs(ll - ref[key][0]))
                mismatches += greedy != ref[key][1]
                count += 1
    except (OSError, StopIteration, KeyError, ValueError) as e:
        return LogLikelihoods(0, float("inf"), 0, error=f"unreadable lm-eval samples ({type(e).__name__}: {e})")
    return LogLikelihoods(count, worst, mismatches)


# -- main -----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients-venv", required=True, help="the environment with guidellm and lm-eval (see above)")
    p.add_argument("--model", default=None, help="model folder (default: the 100M benchmark Llama, fp32)")
    p.add_argument("--port", type=int, default=8811)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", default="", help="comma-separated: guidellm, lm-eval")
    p.add_argument("--formats", default="chat,completions,responses", help=f"guidellm's formats: {','.join(FORMATS)}")
    p.add_argument("--sweep-size", type=int, default=4, help="guidellm sweep strategies (at least 2)")
    p.add_argument("--requests", type=int, default=8, help="requests per sweep strategy")
    p.add_argument("--max-seconds", type=float, default=60, help="cap per sweep strategy")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--lm-batch", type=int, default=1, help="prompts per local-completions request")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest log-likelihood difference that passes")
    p.add_argument("--client-timeout", type=float, default=1200, help="seconds each client run may take")
    p.add_argument("--out", default=None, help="folder for logs and reports (default: a temporary one)")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if not (Path(args.clients_venv) / "bin").is_dir():
        p.error(f"--clients-venv {args.clients_venv} is not an environment; make it as the docstring says")

    model = Path(args.model) if args.model else llama_dir("100m", "float32")
    out = Path(args.out or tempfile.mkdtemp(prefix="agent-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    print(f"serving {model} on {url}; logs and reports in {out}", flush=True)
    proc = spawn_server(model, args.port, out / "server.log", args.threads, [])
    result: dict[str, Any] = {"benchmark": "agent_clients", "model": str(model)}
    try:
        wait_ready(url, proc)
        import httpx

        info = httpx.get(url + "/info", timeout=10).json()
        name, concurrency = info["model_id"], int(info["limits"]["max_concurrent_requests"])
        ok = True
        if "guidellm" not in skip:
            runs = run_guidellm(args, url, model, name, concurrency, out)
            ok &= all(r.passed for r in runs)
            result["guidellm"] = [asdict(r) | {"passed": r.passed} for r in runs]
        if "lm-eval" not in skip:
            t0 = time.monotonic()
            lls = run_lm_eval(args, url, model, name, out)
            passed = lls.passed(args.tolerance)
            ok &= passed
            result["lm_eval"] = asdict(lls) | {"passed": passed, "tolerance": args.tolerance}
            print(
                f"lm-eval local-completions vs hf: {'PASS' if passed else 'FAIL'}: {lls.requests} requests, "
                f"max |diff| {lls.max_abs_diff:.3g} (tolerance {args.tolerance:g}), greedy mismatches "
                f"{lls.greedy_mismatches}, {time.monotonic() - t0:.0f}s" + (f"; {lls.error}" if lls.error else ""),
                flush=True,
            )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    result["passed"] = ok
    print(f"agent clients: {'PASS' if ok else 'FAIL'}")
    print(RESULT_PREFIX + json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
