#!/usr/bin/env bash
# Build bench/wheelhouse/ on a machine with a package index, for the GPU machine (no network, Python 3.12, its
# own torch 2.11, transformers 5.17, accelerate 1.15; no fastapi, uvicorn, pydantic-settings, sse-starlette,
# xgrammar or bitsandbytes). bench/gpu_check.sh installs it there with --no-index --no-deps.
#
# Holds transformers >= 5.24 (with its serving extra: `transformers serve` is the baseline) and loadmaster's serving
# stack, for CPython 3.12 manylinux x86_64, under 60 MiB (what the device tool carries). Left out on purpose:
# torch and the nvidia-* wheels (the machine's own), numpy (the machine's torch brings it; 16 MiB), bitsandbytes
# (~60 MiB: its checks are SKIP lines), xgrammar (structured output is not in the GPU check) and torch's own
# dependencies (sympy, networkx, jinja2, fsspec...) and accelerate (1.15 there is new enough).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/bench/wheelhouse}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
LIMIT_MIB=60
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --disable-pip-version-check --quiet --only-binary=:all: --dest "$DEST" \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "transformers[serving]>=5.24,<6" "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.6" "pydantic-settings>=2.2" \
    "sse-starlette>=3.0" "prometheus-client>=0.20" "httpx>=0.27" "huggingface_hub>=1.0,<3" "safetensors>=0.4" \
    "tokenizers>=0.20"
# what the machine's torch already brings (its versions are the ones that torch was built against)
for w in numpy torch nvidia_ triton sympy mpmath networkx setuptools jinja2 markupsafe MarkupSafe fsspec kernels accelerate; do
    rm -f "$DEST"/${w}-*.whl "$DEST"/${w}*.whl
done
size=$(du -sm "$DEST" | cut -f1)
echo "wheelhouse: $(ls "$DEST"/*.whl | wc -l) wheels, ${size} MiB in $DEST"
if [ "$size" -gt "$LIMIT_MIB" ]; then
    echo "wheelhouse: over ${LIMIT_MIB} MiB; the device tool cannot carry it" >&2
    exit 1
fi
