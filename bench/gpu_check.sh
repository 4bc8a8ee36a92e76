#!/usr/bin/env bash
# The one script for a borrowed GPU machine (docs/gpu.md, "The GPU check"):
#
#   bench/gpu_check.sh [--dry-run] [--budget 420] [--only stage,...]
#
# 1. Makes the environment: the machine's own Python and torch; when bench/wheelhouse/ holds wheels (built by
#    bench/gpu_wheelhouse.sh on a machine with an index, carried to the GPU machine), installs them with --no-index
#    --no-deps into $WORK/site, put ahead of the machine's packages (transformers >= 5.24 and the serving stack).
#    With no pip it unpacks the wheels (they are zip files). What is still missing is a SKIP line, not a failure.
# 2. Runs `python -m bench.gpu_check`: each stage in its own process under its own timeout, 420 s in all, every
#    line written to $OUT/gpu_check.jsonl and $OUT/gpu_check.json the moment it is known.
# Exit status: the driver's (0 all pass; 2 no CUDA device; 10 + the first failed stage's number), or 124 when the
# whole run overran its outer timeout (the JSON still holds every stage that finished).
# --dry-run (or LOADMASTER_GPU_CHECK_CPU=1): the CPU stands in for GPU 0 and a tiny model for the 1B one.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/bench/results/gpu_check}"
WORK="${LOADMASTER_GPU_CHECK_WORK:-${TMPDIR:-/tmp}/loadmaster-gpu-check}"
WHEELS="${LOADMASTER_WHEELHOUSE:-$ROOT/bench/wheelhouse}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT" "$WORK"
export OUT LOADMASTER_GPU_CHECK_WORK="$WORK" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The allocator setting the image runs with (Dockerfile), so the check measures the production allocator.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
SITE=""
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$WORK/site"
    rm -rf "$SITE" && mkdir -p "$SITE"
    if timeout 90 "$PY" -m pip --version >/dev/null 2>&1; then
        timeout 90 "$PY" -m pip install --disable-pip-version-check --no-index --no-deps --no-compile --quiet \
            --target "$SITE" "$WHEELS"/*.whl >"$OUT/wheelhouse-install.log" 2>&1 \
            || echo "wheelhouse: pip install failed (see wheelhouse-install.log); unpacking instead" | tee -a "$OUT/wheelhouse-install.log"
    fi
    if ! compgen -G "$SITE/transformers*" >/dev/null; then
        for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" >>"$OUT/wheelhouse-install.log" 2>&1; done
    fi
    echo "wheelhouse: $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
else
    echo "wheelhouse: none at $WHEELS; using the machine's packages as they are"
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
timeout -k 10 "${LOADMASTER_GPU_CHECK_TIMEOUT:-480}" "$PY" -m bench.gpu_check --out "$OUT" "$@"
rc=$?
[ "$rc" = 124 ] && echo "gpu_check: the whole run overran ${LOADMASTER_GPU_CHECK_TIMEOUT:-480} s; $OUT/gpu_check.json holds what finished"
exit "$rc"
