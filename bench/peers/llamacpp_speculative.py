"""Peer for ``bench.speculate --peers``: llama.cpp's own speculative decoding (its ``llama-speculative-simple``
example: a draft GGUF proposes, the target verifies) and its plain decode (``llama-completion``), on the same
weights, prompt, token count and threads.

Outside CI. The binding ``bench.peers.llamacpp`` installs builds no examples, so this module builds the two tools
once from the source distribution of ``llama-cpp-python`` (pip-downloaded; it vendors llama.cpp whole) into
``<cache>/llama.cpp-<version>/build`` (``cmake``, native instruction set, about 5 minutes on 2 cores). The target
is the checkpoint written as ``f32`` GGUF, the draft its ``q8_0`` or ``q4_0`` (:func:`gguf`; the latter by
llama.cpp's own ``llama-quantize``): llama.cpp's nearest counterparts of our ``int8`` and ``int4`` copies.

Both tools run greedy (``--temp 0``), ``--ignore-eos``, with the prompt as text (the GGUF carries the checkpoint's
byte-level BPE vocabulary). The rate is llama.cpp's own: ``decoded N tokens in S seconds`` for the speculative
example (prompt excluded), the ``eval time`` line for ``llama-completion``; acceptance is its ``accept`` line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.peers.llamacpp import gguf_file

#: The tools built, and the flags: CPU only, this CPU's instruction set, no tests, server or network.
TARGETS = ("llama-speculative-simple", "llama-completion", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)


@dataclass(frozen=True)
class PeerRun:
    """One llama.cpp run: decode tokens/s and, for a speculative one, the share of drafts accepted."""

    tok_s: float
    acceptance: float | None = None


def tools(cache: Path) -> Path:
    """The folder of the built tools, building them once (the newest ``llama-cpp-python`` source on the index)."""
    built = sorted(cache.glob("llama.cpp-*/build/bin/llama-speculative-simple"))
    if built:
        return built[-1].parent
    cache.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(cache)]
    subprocess.run([*pip, "llama-cpp-python"], check=True)
    sdist = sorted(cache.glob("llama_cpp_python-*.tar.gz"))[-1]
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    source = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    build = cache / f"llama.cpp-{version}" / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", "--target", *TARGETS], check=True, capture_output=True)
    return build / "bin"


def gguf(bin_dir: Path, model_dir: Path, cache: Path, kind: str) -> Path:
    """The GGUF of ``model_dir`` in ``kind`` (``f32``, ``q8_0`` or ``q4_0``), written once under ``cache`` as
    :func:`bench.peers.llamacpp.gguf_file` writes it, ``q4_0`` by the ``llama-quantize`` tool built here (the binding
    need not be installed)."""

    def quantize(source: Path, out: Path, weight_type: str) -> None:
        subprocess.run([str(bin_dir / "llama-quantize"), str(source), str(out), weight_type], check=True,
                       capture_output=True)  # fmt: skip

    return gguf_file(model_dir, cache, kind, quantize)


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {proc.stderr[-800:]}")
    return proc.stdout + proc.stderr


def plain(bin_dir: Path, target: Path, prompt: str, new_tokens: int, threads: int) -> PeerRun:
    """llama.cpp's plain greedy decode of ``new_tokens`` tokens: its eval rate."""
    out = _run([str(bin_dir / "llama-completion"), "-m", str(target), "-p", prompt, "-n", str(new_tokens),
                "--temp", "0", "-t", str(threads), "-c", "1024", "--ignore-eos", "-no-cnv"])  # fmt: skip
    m = re.search(r"\beval time =.*?([\d.]+) tokens per second", out.replace("prompt eval time", ""))
    if not m:
        raise RuntimeError(f"llama-completion printed no eval rate: {out[-800:]}")
    return PeerRun(float(m.group(1)))


def speculative(
    bin_dir: Path, target: Path, draft: Path, prompt: str, new_tokens: int, threads: int, draft_tokens: int
) -> PeerRun:
    """llama.cpp's speculative greedy decode with ``draft``: its decode rate and acceptance."""
    out = _run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_tokens), "-p", prompt,
                "-n", str(new_tokens), "--temp", "0", "-t", str(threads), "-td", str(threads), "-c", "1024",
                "--ignore-eos"])  # fmt: skip
    rate = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", out)
    accept = re.search(r"accept\s+=\s+([\d.]+)%", out)
    if not rate:
        raise RuntimeError(f"llama-speculative-simple printed no decode rate: {out[-800:]}")
    return PeerRun(float(rate.group(1)), float(accept.group(1)) / 100 if accept else None)
