"""Peer for the CPU kernel benchmark: CTranslate2's int8 decode of the same checkpoint, on the same threads.

Outside CI: ``ensure_installed()`` pip-installs ``ctranslate2`` into the running interpreter's environment (it is
not a project dependency). The checkpoint is converted once with CTranslate2's own transformers converter
(``quantization="int8"``: int8 weights with a float32 scale per output channel, the scheme our ``int8`` uses)
into ``<cache>/ct2-<name>-int8``, then decoded greedily token by token with ``generate_tokens``; tokens/s is
the inverse of the median gap between tokens, as :func:`bench.common.time_generation` measures ours.

``bench.quant --peers`` runs it side by side with our schemes; alone:
``.venv/bin/python -m bench.peers.kernels_ctranslate2 [--threads 2] [--new-tokens 32]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "ctranslate2"


def ensure_installed() -> None:
    """pip-install CTranslate2 here if it is missing (benchmarks only; CI never runs this)."""
    if importlib.util.find_spec("ctranslate2") is None:
        log.info("installing %s for the peer benchmark", PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)


def converted(model_dir: Path, cache: Path, quantization: str = "int8") -> Path:
    """The CTranslate2 copy of ``model_dir``, converted once (a marker file says the conversion finished)."""
    import ctranslate2

    out = cache / f"ct2-{model_dir.name}-{quantization}"
    marker = out / "loadmaster_converted.json"
    if not marker.is_file():
        ctranslate2.converters.TransformersConverter(str(model_dir), low_cpu_mem_usage=True).convert(
            str(out), quantization=quantization, force=True
        )
        marker.write_text(json.dumps({"source": str(model_dir), "quantization": quantization}))
    return out


def worker(spec: dict) -> dict:
    """One timed decode in this process: ``spec`` has path, cache, threads, new_tokens, prompt_len."""
    import ctranslate2
    from transformers import AutoTokenizer

    model_dir = Path(spec["path"])
    out = converted(model_dir, Path(spec["cache"]))
    t0 = time.perf_counter()
    gen = ctranslate2.Generator(str(out), device="cpu", compute_type="int8", intra_threads=int(spec["threads"]))
    ready = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = gen.num_symbols if hasattr(gen, "num_symbols") else tok.vocab_size
    ids = [(i % (vocab - 1)) + 1 for i in range(1, int(spec["prompt_len"]) + 1)]
    prompt = tok.convert_ids_to_tokens(ids)
    new = int(spec["new_tokens"])
    times, cpu, tokens = [], [], []
    t_start = time.perf_counter()
    for step in gen.generate_tokens(prompt, max_length=new, sampling_topk=1, end_token=[]):
        times.append(time.perf_counter())
        cpu.append(time.process_time())
        tokens.append(step.token_id)

    def rate(ts: list[float]) -> float:
        gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
        median = gaps[len(gaps) // 2] if gaps else 0.0
        return 1.0 / median if median > 0 else 0.0

    return {
        "scheme": "ctranslate2 int8",
        "isa": "ctranslate2",
        "ready_s": ready,
        "first_token_s": times[0] - t_start if times else None,
        "decode_tok_s": rate(times),
        # per CPU-second, as bench.quant reports ours: meaningful with one thread (see bench.quant)
        "decode_tok_s_cpu": rate(cpu) if int(spec["threads"]) == 1 else 0.0,
        "from_saved_file": True,
        "version": ctranslate2.__version__,
        "tokens": tokens,
    }


def main(argv=None) -> int:
    from bench.common import emit, llama_dir, model_cache_dir, run_isolated

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bench 1B Llama, bf16)")
    args = ap.parse_args(argv)
    if args.worker:
        emit(worker(json.loads(args.worker)))
        return 0
    ensure_installed()
    path = args.model or llama_dir("1b", "bfloat16")
    spec = {
        "path": str(path),
        "cache": str(model_cache_dir()),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "prompt_len": 16,
    }
    print(json.dumps(run_isolated("bench.peers.kernels_ctranslate2", spec), indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
