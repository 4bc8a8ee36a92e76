"""The check for a GPU machine: correctness first, then the streaming schedule, then speed. Run through
``bench/gpu_check.sh`` (which adds the serving comparison), or alone:

    .venv/bin/python -m bench.gpu_check [--model-dir DIR] [--new-tokens 32] [--out PATH]
    .venv/bin/python -m bench.gpu_check --cpu        # every check that can run without a GPU (the tests run this)

Checks (each one a row; the exit status is 1 when any of them fails):

1. logits (fp32, TF32 off) and ``--new-tokens`` greedy tokens against plain transformers on the CPU, for an all-GPU
   load, a CPU-offloaded one (the second half of the layers on ``cpu``, streamed) and a disk-offloaded one;
2. every loaded parameter byte for byte against the checkpoint, for an all-GPU load on each GPU present (issue 14
   item 1: weights on GPU 1 and up were the ones at risk);
3. prefetch overlap (GPU only): after the first forward no block waits for a copy it should have prefetched, and
   the bytes copied per token equal the plan's offloaded bytes (the embeddings are looked up on the host);
4. bandwidth (GPU only): the host-to-device rate the streamed decode reaches, against a pinned 1 GiB copy's;
5. with ``--serve``: ``loadmaster serve`` and ``transformers serve --continuous-batching`` on the same weights,
   16 concurrent clients each (half greedy, half sampled): all answered, greedy answers equal, tokens/s side by side.

With ``--cpu`` the CPU stands in for GPU 0 in checks 1 and 2; 3 and 4 are reported as not run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("gpu_check")


@dataclass
class Check:
    """One line of the report: ``ok`` is None for a measurement or a check that could not run here."""

    name: str
    ok: bool | None
    detail: str


def _maps(n_layers: int, gpu: Any) -> dict[str, dict[str, Any]]:
    half = n_layers // 2
    out = {"all on GPU": {"": gpu}}
    for kind in ("cpu", "disk"):
        dm: dict[str, Any] = {"model.embed_tokens": gpu, "model.rotary_emb": gpu, "model.norm": gpu, "lm_head": gpu}
        for i in range(n_layers):
            dm[f"model.layers.{i}"] = gpu if i < half else kind
        out[f"{kind}-offloaded"] = dm
    return out


def check_correctness(path: Path, gpu: Any, device: torch.device, new_tokens: int, tmp: Path) -> list[Check]:
    """Logits and greedy tokens of each placement against plain transformers on the CPU, in fp32."""
    from transformers import AutoModelForCausalLM

    import loaders

    cfg = json.loads((path / "config.json").read_text())
    ids = (torch.arange(3, 3 + 24) * 7 % int(cfg["vocab_size"])).unsqueeze(0)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref_logits = ref(ids).logits.float()
        ref_tokens = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0].tolist()
    del ref
    out = []
    for label, dm in _maps(int(cfg["num_hidden_layers"]), gpu).items():
        model = loaders.load_model(
            path, device_map=dm, dtype="float32", show_progress=False, offload_folder=tmp / "offload"
        )
        with torch.inference_mode():
            logits = model(ids.to(device)).logits.float().cpu()
            tokens = model.generate(ids.to(device), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        diff = (logits - ref_logits).abs().max().item()
        scale = max(1.0, ref_logits.abs().max().item())
        same = tokens[0].tolist() == ref_tokens
        ok = diff <= 1e-3 * scale and same
        out.append(Check(f"{label}: logits + {new_tokens} greedy tokens", ok, f"max |diff| {diff:.3g}; same={same}"))
        del model
        gc.collect()
    return out


def check_bytes(path: Path, gpus: list[Any]) -> list[Check]:
    """Every parameter and persistent buffer of an all-GPU load, in the stored dtype, equal to the checkpoint."""
    from safetensors.torch import load_file

    import loaders

    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        stored.update(load_file(shard))
    dtype = str(next(iter(stored.values())).dtype).removeprefix("torch.")
    out = []
    for gpu in gpus:
        model = loaders.load_model(path, device_map={"": gpu}, dtype=dtype, show_progress=False)
        state = model.state_dict()
        wrong = [k for k, t in stored.items() if k in state and not torch.equal(state[k].cpu(), t)]
        compared = sum(1 for k in stored if k in state)
        ok = not wrong and compared > 0
        out.append(
            Check(f"GPU {gpu}: byte-exact parameters", ok, f"{compared} compared, {len(wrong)} differ {wrong[:3]}")
        )
        del model, state
        gc.collect()
    return out


def pinned_ceiling(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best host-to-device rate of a pinned copy, in bytes/s (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3))
    return best


def check_streaming(path: Path, device: torch.device, dtype: str, new_tokens: int) -> list[Check]:
    """Prefetch overlap and bytes per token against the plan, then the H2D rate against the pinned ceiling."""
    import loaders
    from planner.api import plan

    cfg = json.loads((path / "config.json").read_text())
    dm = _maps(int(cfg["num_hidden_layers"]), device.index)["cpu-offloaded"]
    model = loaders.load_model(path, device_map=dm, dtype=dtype, show_progress=False)
    streamer = model._loadmaster_streamer
    copied = [0]
    copy = streamer.backend.copy

    def counting_copy(dst, src, stream):
        copied[0] += dst.numel() * dst.element_size()
        copy(dst, src, stream)

    streamer.backend.copy = counting_copy
    ids = torch.arange(1, 17, device=device).unsqueeze(0)
    with torch.inference_mode():
        model(ids)  # learns the order
        waits, before = streamer.sync_loads, copied[0]
        model(ids)
        per_forward = copied[0] - before
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    late = streamer.sync_loads - waits
    predicted = plan(
        str(path), strategy=dm, dtype=dtype, max_memory={device.index: "1000GiB", "cpu": "1000GiB"}, gpu_reserve=0
    ).offloaded_bytes
    ratio = per_forward / predicted if predicted else float("nan")
    rate = per_forward * new_tokens / seconds
    ceiling = pinned_ceiling(device)
    return [
        Check("prefetch: copy waits after the first forward", late == 0, f"{late} blocks waited for their copy"),
        Check(
            "prefetch: bytes copied per token vs plan",
            abs(ratio - 1) <= 0.02,
            f"{per_forward} copied, plan {predicted} offloaded ({ratio:.3f}x)",
        ),
        Check(
            "bandwidth: streamed H2D vs pinned ceiling",
            None,
            f"{rate / 1e9:.1f} GB/s of {ceiling / 1e9:.1f} GB/s ({rate / ceiling:.0%}); {new_tokens / seconds:.1f} tok/s",
        ),
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(cmd: list[str], url: str, log_path: Path, ready: str, timeout: float = 600) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + ready, timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{' '.join(cmd[:3])} not ready in {timeout:.0f} s; see {log_path}")


def _completions(url: str, clients: int, max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` concurrent /v1/completions, even ones greedy, odd ones sampled (seeded); (answers, seconds)."""
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    answers: list[dict] = [{} for _ in range(clients)]

    def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": f"Request {i}: the river stone and the winter light",
            "max_tokens": max_tokens,
        }
        body.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i})
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        answers[i] = r.json() if r.status_code == 200 else {"error": f"{r.status_code}: {r.text[:200]}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - t0


def check_serving(path: Path, device: str, tmp: Path, clients: int = 16, max_tokens: int = 32) -> list[Check]:
    """``loadmaster serve`` and ``transformers serve --continuous-batching`` on the same weights and device, each
    answering ``clients`` concurrent requests (half greedy, half sampled): every request must complete, greedy
    answers must agree between the two, and the aggregate tokens/s are reported side by side."""
    runs: dict[str, tuple[list[dict], float]] = {}
    for name in ("loadmaster", "transformers"):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "loadmaster":
            cmd = [
                sys.executable,
                "-m",
                "service.cli",
                "serve",
                str(path),
                "--port",
                str(port),
                "--dtype",
                "float32",
            ]
            cmd += ["--max-batch-size", str(clients), "--log-level", "warning"]
            ready = "/health/ready"
        else:
            exe = str(Path(sys.executable).with_name("transformers"))
            cmd = [exe, "serve", str(path), "--continuous-batching", "--port", str(port), "--device", device]
            cmd += ["--dtype", "float32"]
            ready = "/health"
        proc = _serve(cmd, url, tmp / f"{name}-serve.log", ready)
        try:
            runs[name] = _completions(url, clients, max_tokens)
        finally:
            proc.terminate()
            proc.wait(60)
    out = []
    rates = {}
    for name, (answers, seconds) in runs.items():
        errors = [a["error"] for a in answers if "error" in a]
        tokens = sum(a.get("usage", {}).get("completion_tokens", 0) for a in answers if "error" not in a)
        rates[name] = tokens / seconds
        detail = f"{len(answers) - len(errors)}/{len(answers)} answered, {tokens} tokens, {rates[name]:.1f} tok/s"
        out.append(
            Check(
                f"serve ({name}): {clients} concurrent clients",
                not errors,
                detail + (f"; {errors[:1]}" if errors else ""),
            )
        )
    greedy = [i for i in range(clients) if i % 2 == 0]
    texts = {name: [runs[name][0][i].get("choices", [{}])[0].get("text") for i in greedy] for name in runs}
    same = sum(a == b and a is not None for a, b in zip(texts["loadmaster"], texts["transformers"]))
    out.append(
        Check("serve: greedy answers equal transformers serve's", same == len(greedy), f"{same}/{len(greedy)} equal")
    )
    ratio = rates["loadmaster"] / rates["transformers"] if rates.get("transformers") else float("nan")
    out.append(Check("serve: loadmaster vs transformers serve --continuous-batching", None, f"{ratio:.2f}x tokens/s"))
    return out


def run(args: argparse.Namespace) -> list[Check]:
    from bench.common import llama_dir

    path = Path(args.model_dir) if args.model_dir else llama_dir("100m", "float32")
    tmp = Path(args.work_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        gpu, device, gpus = "cpu", torch.device("cpu"), ["cpu"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit(2)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        gpu, device, gpus = 0, torch.device("cuda", 0), list(range(torch.cuda.device_count()))
    checks = check_correctness(path, gpu, device, args.new_tokens, tmp)
    checks += check_bytes(path, gpus)
    if args.serve:
        checks += check_serving(path, "cpu" if args.cpu else "cuda:0", tmp, clients=args.clients)
    if args.cpu:
        checks.append(Check("prefetch and bandwidth", None, "not run: they need a GPU"))
    else:
        checks += check_streaming(path, device, args.dtype, args.new_tokens)
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU stands in for GPU 0 (checks 1 and 2 only)")
    p.add_argument("--model-dir", help="a Llama checkpoint (default: the ~100M random-weight fixture, fp32)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="dtype of the streaming and bandwidth runs")
    p.add_argument("--work-dir", default="/tmp/loadmaster-gpu-check", help="offload folder for the disk run")
    p.add_argument("--out", default=None, help="write the checks as JSON here")
    p.add_argument("--serve", action="store_true", help="also compare loadmaster serve with transformers serve")
    p.add_argument("--clients", type=int, default=16)
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__}; use --cpu to check without one")
        return 2
    checks = run(args)
    for c in checks:
        mark = "n/a " if c.ok is None else ("OK  " if c.ok else "FAIL")
        print(f"{mark} {c.name}: {c.detail}")
    where = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": where, "checks": [asdict(c) for c in checks]}, indent=1))
    failed = [c for c in checks if c.ok is False]
    print(f"gpu_check on {where}: {len(checks) - len(failed)} of {len(checks)} rows without a mismatch")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
