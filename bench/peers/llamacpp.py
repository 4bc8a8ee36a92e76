"""Peer for the decode and serving benchmarks: llama.cpp on the same weights, the same prompts and the same threads.

Outside CI. ``ensure_installed()`` pip-installs ``llama-cpp-python`` (llama.cpp's library with its Python binding,
built from source for this CPU's instruction set: about 4 minutes on 2 idle cores) and ``gguf`` into the running
interpreter's environment; neither is a project dependency. Each checkpoint is written once as GGUF by
:mod:`bench.peers.gguf_export` into ``<cache>/gguf/<model>-<type>.gguf`` (``f32``, ``bf16`` or ``q8_0``), and
``q4_0`` / ``q4_k_m`` from the ``f32`` one by llama.cpp's own quantizer.

The runs drive llama.cpp's C API through the binding (``llama_decode`` over a ``llama_batch``), as its own
``llama-batched-bench`` does, with greedy choice by argmax over the returned logits:

- ``decode``: one sequence, the prompt ids ``1..16`` that ``bench.common.time_generation`` gives our models, then
  one token per step; tokens/s is the inverse of the median gap between tokens (``bench.quant --peers``);
- ``batched``: the benchmark's prompts (token ids from the checkpoint's own tokenizer), all prefilled in one batch
  as separate sequences, then ``max_new_tokens`` steps that decode one token of every sequence together; aggregate
  tokens/s over the whole run, prefill included, as ``bench.serve`` counts a server's (``bench.serve --peers``); and
  one sequence alone for the lone-request figure;
- ``ready``: a fresh process, timed from just before it is spawned, until the model is loaded (a context made) and
  until the first token of a prompt is out (``bench.ready --peers``).

    .venv/bin/python -m bench.peers.llamacpp --mode decode --type q8_0        # the 1B Llama, 2 threads
    .venv/bin/python -m bench.peers.llamacpp --mode batched --size 100m --dtype float32
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import median_rate

log = logging.getLogger(__name__)

PACKAGES = ("llama-cpp-python", "gguf")
#: llama.cpp built for this CPU's instruction set, without its tests and examples (the library is what runs).
BUILD_FLAGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
#: Which GGUF weight type matches which of our dtypes.
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}
#: The binding's log callback that silences llama.cpp (made once; a collected callback would crash it).
_QUIET_LOG: Any = None


def ensure_installed() -> None:
    """pip-install llama.cpp's binding (built for this CPU) and ``gguf`` if missing (benchmarks only)."""
    missing = [p for p, mod in zip(PACKAGES, ("llama_cpp", "gguf")) if importlib.util.find_spec(mod) is None]
    if missing:
        log.warning("installing %s for the peer benchmark (llama.cpp compiles for a few minutes)", missing)
        env = dict(
            os.environ,
            CMAKE_ARGS=os.environ.get("CMAKE_ARGS", BUILD_FLAGS),
            CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count()),
        )
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True, env=env)


#: GGUF types llama.cpp's own quantizer (``llama_model_quantize``) makes from the f32 GGUF, by its file type.
LLAMA_QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def gguf_file(
    model_dir: Path, cache: Path, weight_type: str, quantize: Callable[[Path, Path, str], None] | None = None
) -> Path:
    """The GGUF copy of ``model_dir`` in ``weight_type``, written once: ``f32``/``bf16``/``q8_0`` by
    :mod:`bench.peers.gguf_export`, the 4-bit types by llama.cpp's own quantizer from the ``f32`` copy (as its
    ``llama-quantize`` tool makes them): ``quantize(source, out, weight_type)``, through the binding by default
    (:mod:`bench.peers.llamacpp_speculative` passes the tool itself). Written whole or not at all."""
    from bench.peers.gguf_export import export

    out = cache / "gguf" / f"{model_dir.name}-{weight_type}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if weight_type not in LLAMA_QUANTIZED:
        return export(model_dir, out, weight_type)
    source = gguf_file(model_dir, cache, "f32")
    partial = out.with_suffix(".partial")
    try:
        (quantize or _llama_quantize)(source, partial, weight_type)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out)
    return out


def _llama_quantize(source: Path, out: Path, weight_type: str) -> None:
    """``source`` quantized to ``weight_type`` by llama.cpp (``llama_model_quantize``) into ``out``."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, LLAMA_QUANTIZED[weight_type])
    params.nthread = os.cpu_count() or 1
    rc = lc.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {weight_type} failed with {rc}")


@dataclass
class LlamaCpp:
    """A loaded llama.cpp model and context (C handles through the binding), with the batch it decodes."""

    model: Any
    ctx: Any
    batch: Any
    n_vocab: int
    capacity: int

    @classmethod
    def load(cls, path: Path, threads: int, sequences: int, tokens_per_sequence: int, batch_tokens: int) -> LlamaCpp:
        import llama_cpp as lc

        lc.llama_backend_init()
        global _QUIET_LOG
        if _QUIET_LOG is None:  # kept referenced: llama.cpp calls it long after this line
            _QUIET_LOG = lc.llama_log_callback(lambda *_: None)
        lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))  # its load log, not ours
        mparams = lc.llama_model_default_params()
        if os.environ.get("LOADMASTER_LLAMACPP_REPACK", "1") == "0":
            # Its weight repacking (AMX tiles for q8_0 on CPUs that have them) crashed llama.cpp 0.3.36 with an
            # illegal instruction (tilezero with no tile configuration) on one Xeon; this is what its users turn off.
            mparams.use_extra_bufts = False
        model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = sequences * tokens_per_sequence
        cparams.n_batch = cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = sequences
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not make a context")
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        return cls(model, ctx, lc.llama_batch_init(batch_tokens, 0, sequences), n_vocab, batch_tokens)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode ``(token, position, sequence, wants_logits)`` items in one call; the argmax token of each item
        that wanted logits, in order."""
        import llama_cpp as lc
        import numpy as np

        if len(items) > self.capacity:
            raise ValueError(f"{len(items)} tokens in one batch; the context takes {self.capacity}")
        b = self.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, wants) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = seq
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, item in enumerate(items):
            if item[3]:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def clear(self) -> None:
        """Forget every sequence's cache (between timed runs)."""
        import llama_cpp as lc

        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        import llama_cpp as lc

        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


@contextmanager
def loaded(path: Path, threads: int, sequences: int, tokens_per_sequence: int, batch_tokens: int) -> Iterator[LlamaCpp]:
    llm = LlamaCpp.load(path, threads, sequences, tokens_per_sequence, batch_tokens)
    try:
        yield llm
    finally:
        llm.close()


def generate(llm: LlamaCpp, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """Greedy generation of ``new_tokens`` for every prompt at once: one prefill batch, then one batch per step.
    The tokens of each sequence, and the clock after every step (the prefill's first)."""
    items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
    firsts = llm.decode(items)
    times = [time.perf_counter()]
    out = [[t] for t in firsts]
    for step in range(1, new_tokens):
        nxt = llm.decode([(seq[-1], len(prompts[s]) + step - 1, s, True) for s, seq in enumerate(out)])
        times.append(time.perf_counter())
        for seq, t in zip(out, nxt):
            seq.append(t)
    return out, times


def decode_worker(spec: dict) -> dict:
    """One sequence from the prompt ids 1..prompt_len (as ``time_generation`` gives our models)."""
    path = gguf_file(Path(spec["path"]), Path(spec["cache"]), spec["type"])
    new, prompt_len = int(spec["new_tokens"]), int(spec["prompt_len"])
    t0 = time.perf_counter()
    with loaded(path, int(spec["threads"]), 1, prompt_len + new + 8, max(prompt_len, 32)) as llm:
        ready = time.perf_counter() - t0
        ids = [(i % (llm.n_vocab - 1)) + 1 for i in range(1, prompt_len + 1)]
        start = time.perf_counter()
        out, times = generate(llm, [ids], new)
    import llama_cpp

    return {
        "scheme": f"llama.cpp {spec['type']}",
        "isa": "llama.cpp",
        "ready_s": ready,
        "first_token_s": times[0] - start,
        "decode_tok_s": median_rate(times),
        "decode_tok_s_cpu": 0.0,
        "from_saved_file": True,
        "version": llama_cpp.__version__,
        "tokens": out[0],
    }


def batched_worker(spec: dict) -> dict:
    """The benchmark's prompts together, and the first alone; best of ``repeats`` each."""
    ensure_installed()
    from tokenizers import Tokenizer

    model_dir = Path(spec["model"])
    path = gguf_file(model_dir, Path(spec["cache"]), GGUF_TYPE[spec["dtype"]])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in spec["texts"]]
    new, repeats = int(spec["max_new_tokens"]), int(spec["repeats"])
    longest = max(len(p) for p in prompts)
    total = sum(len(p) for p in prompts)
    with loaded(path, int(spec["threads"]), len(prompts), longest + new + 8, max(total, len(prompts))) as llm:

        def run(batch: list[list[int]]) -> float:
            llm.clear()
            t0 = time.perf_counter()
            out, _ = generate(llm, batch, new)
            took = time.perf_counter() - t0
            assert all(len(s) == new for s in out)
            return took

        run(prompts[:2])  # warm-up
        batched = min(run(prompts) for _ in range(repeats))
        lone = min(run(prompts[:1]) for _ in range(repeats))
    import llama_cpp

    return {
        "llamacpp_batched_tps": round(len(prompts) * new / batched, 2),
        "llamacpp_lone_tps": round(new / lone, 2),
        "llamacpp_type": GGUF_TYPE[spec["dtype"]],
        "llamacpp_version": llama_cpp.__version__,
    }


def ready_child(path: str, threads: int) -> None:
    """Run in a fresh process: load, then make the first token of a short prompt; print the clock at each."""
    with loaded(Path(path), threads, 1, 64, 32) as llm:
        loaded_at = time.time()
        generate(llm, [[1, 2, 3, 4, 5, 6, 7, 8]], 1)
        first_at = time.time()
    print(json.dumps({"loaded_at": loaded_at, "first_token_at": first_at}), flush=True)


def time_to_ready(model_dir: Path, cache: Path, weight_type: str, threads: int) -> dict[str, float]:
    """From just before a fresh process is spawned: seconds until llama.cpp has loaded the model, and until the
    first token; the page cache is warm (the GGUF is read once first)."""
    path = gguf_file(model_dir, cache, weight_type)
    path.read_bytes()  # warm, as bench.ready warms our shards
    t0 = time.time()
    code = "import sys; from bench.peers.llamacpp import ready_child; ready_child(sys.argv[1], int(sys.argv[2]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(threads)], capture_output=True, text=True, check=True
    )
    marks = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ready_s": marks["loaded_at"] - t0, "first_token_s": marks["first_token_at"] - t0}


def main(argv: list[str] | None = None) -> int:
    from bench.common import emit, llama_dir, model_cache_dir, run_isolated

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["decode", "batched", "ready"], default="decode")
    ap.add_argument("--size", default="1b", choices=["100m", "1b"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--type", default=None, choices=["f32", "bf16", "q8_0", *LLAMA_QUANTIZED], help="GGUF type (default: --dtype's)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        emit(batched_worker(spec) if "texts" in spec else decode_worker(spec))
        return 0
    ensure_installed()
    path = llama_dir(args.size, args.dtype)
    weight_type = args.type or GGUF_TYPE[args.dtype]
    if args.mode == "ready":
        print(json.dumps(time_to_ready(path, model_cache_dir(), weight_type, args.threads)))
        return 0
    if args.mode == "batched":
        from bench.serve import prompts

        spec = {
            "model": str(path),
            "cache": str(model_cache_dir()),
            "dtype": args.dtype,
            "texts": prompts(16),
            "max_new_tokens": args.new_tokens,
            "repeats": 3,
            "threads": args.threads,
        }
    else:
        spec = {
            "path": str(path),
            "cache": str(model_cache_dir()),
            "type": weight_type,
            "threads": args.threads,
            "new_tokens": args.new_tokens,
            "prompt_len": 16,
        }
    print(json.dumps(run_isolated("bench.peers.llamacpp", spec), indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
