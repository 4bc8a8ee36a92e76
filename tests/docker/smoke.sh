#!/usr/bin/env bash
# Prove the Docker image works on this machine: build a local Debian base (debootstrap + docker import, since no
# registry can be reached), build the image on it (pip gets the host's CA bundle and wheel folder at build time
# only), run it on the demo model by its Hub id from a mounted Hub cache, then by path; wait for its HEALTHCHECK to
# say healthy, send /generate, stop it. Last, serve a model bigger than its container (`--memory` below the
# checkpoint's size, no flag but the model) and check its greedy tokens against transformers.
#
# Exits 0 with "docker smoke: NOT RUN: <why>" when no Docker engine can be started here (scripts/install-docker
# installs one; CI runs it first, and tests/docker/test_smoke.py fails on NOT RUN when CI is set); non-zero on a
# failure.
# Each step prints a "docker smoke:" line as it starts, with the seconds since the script began.
# Environment: LOADMASTER_SMOKE_KEEP=1 keeps the image; DEBIAN_MIRROR overrides the debootstrap mirror;
# LOADMASTER_HOME is where the demo model is built (once) and kept (the tests use their own cache for it).
# Runs may overlap on one engine (CI jobs, several checkouts): each has its own image tag and logs
# (/tmp/loadmaster-smoke.*/), and only the shared base image is reused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BASE_TAG="loadmaster-smoke-base:bookworm"
IMAGE="loadmaster:smoke-$$"  # per run, like the logs below: two runs on one engine must not share them
LOGS="$(mktemp -d /tmp/loadmaster-smoke.XXXXXX)"
NAME="loadmaster-smoke-$$"
EXTRAS="docker/build-extras"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

say() { echo "docker smoke: $* [${SECONDS}s]"; }
not_run() { say "NOT RUN: $*"; exit 0; }

# -- an engine ------------------------------------------------------------------------------------------------------
command -v docker >/dev/null 2>&1 || not_run "no docker client (bash scripts/install-docker installs one)"
say "starting (building the image takes minutes, the first build longer)"
if ! docker info >/dev/null 2>&1; then
    started="$(bash scripts/install-docker --start 2>&1)" || not_run "no Docker engine could be started: $(echo "$started" | tail -n 1)"
    echo "$started"
fi

DANGLING_BEFORE="$(docker images -q -f dangling=true 2>/dev/null | tr '\n' ' ')"
cleanup() {
    docker rm -f "$NAME" >/dev/null 2>&1 || true
    rm -rf "$EXTRAS/wheels" "$EXTRAS/ca.crt"
    if [ "${LOADMASTER_SMOKE_KEEP:-0}" != 1 ]; then
        docker rmi "$IMAGE" >/dev/null 2>&1 || true
        # the build stage this build left untagged (only images that were not dangling before it, never others)
        for id in $(docker images -q -f dangling=true 2>/dev/null); do
            case " $DANGLING_BEFORE " in *" $id "*) ;; *) docker rmi "$id" >/dev/null 2>&1 || true ;; esac
        done
    fi
}
trap cleanup EXIT

# -- a local Debian base ---------------------------------------------------------------------------------------------
if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null 2>&1 || not_run "debootstrap is not installed (bash scripts/install-docker installs it)"
    rootfs="$(mktemp -d)"
    say "debootstrap bookworm from $MIRROR (a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR" \
        >"$LOGS/debootstrap.log" 2>&1 || { tail -n 20 "$LOGS/debootstrap.log"; exit 1; }
    tar -C "$rootfs" -c . | docker import - "$BASE_TAG" >/dev/null
    rm -rf "$rootfs"
fi

# -- the image (CA bundle + wheels at build time only) ---------------------------------------------------------------
mkdir -p "$EXTRAS/wheels"
cert="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
[ -f "$cert" ] && cp "$cert" "$EXTRAS/ca.crt"
for dir in ${PIP_FIND_LINKS:-/opt/wheels}; do
    [ -d "$dir" ] || continue
    for whl in "$dir"/*.whl; do
        if [ -f "$whl" ]; then cp -l "$whl" "$EXTRAS/wheels/" 2>/dev/null || cp "$whl" "$EXTRAS/wheels/"; fi
    done
done
say "building $IMAGE on $BASE_TAG (torch from the local wheels or PyPI; CPU, since no CUDA base can be pulled)"
docker build --network host --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_INDEX_URL= --build-arg WHEELS_ONLY=0 -t "$IMAGE" . \
    >"$LOGS/docker-build.log" 2>&1 || { tail -n 30 "$LOGS/docker-build.log"; exit 1; }
say "built $IMAGE"
rm -rf "$EXTRAS/wheels" "$EXTRAS/ca.crt"
user="$(docker image inspect -f '{{.Config.User}}' "$IMAGE")"
[ -n "$user" ] && [ "$user" != root ] || { say "FAILED: the image runs as '$user', not a non-root user"; exit 1; }

# -- run it on the demo model ----------------------------------------------------------------------------------------
PY=".venv/bin/python"; [ -x "$PY" ] || PY=python3
say "the demo model (built once, about a minute the first time)"
demo="$(HF_HUB_OFFLINE=1 "$PY" -c 'from service.model.demo_model import build_demo_model; print(build_demo_model())')"
port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
wait_healthy() {  # container name
    local status=starting
    for _ in $(seq 1 120); do
        status="$(docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null || echo gone)"
        [ "$status" = healthy ] && break
        [ "$status" = gone ] || [ "$(docker inspect -f '{{.State.Running}}' "$1")" = false ] && break
        sleep 2
    done
    if [ "$status" != healthy ]; then
        say "FAILED: container $1 is '$status'"; docker logs "$1" 2>&1 | tail -n 30; exit 1
    fi
}

# -- by Hub id, from a mounted Hugging Face cache (HF_HOME=/data in the image), with no Hub reachable --------------
# The cache holds the demo model as the Hub cache lays out a download of "loadmaster/demo": snapshots/<commit>/
# with the files, refs/main naming the commit. This is what `docker run -v $HOME/.cache/huggingface:/data ...
# serve org/name` reads after a first start has downloaded the model there.
hub_cache="$(mktemp -d)"
commit="$(printf 'loadmaster docker smoke' | sha1sum | cut -c1-40)"
repo_dir="$hub_cache/hub/models--loadmaster--demo"
mkdir -p "$repo_dir/snapshots/$commit" "$repo_dir/refs"
cp -r "$demo"/. "$repo_dir/snapshots/$commit/"
printf '%s' "$commit" > "$repo_dir/refs/main"
chmod -R a+rwX "$hub_cache"
HUB_NAME="$NAME-by-id"
trap 'docker rm -f "$HUB_NAME" >/dev/null 2>&1 || true; rm -rf "$hub_cache"; cleanup' EXIT
hub_port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
docker run -d --name "$HUB_NAME" -p "127.0.0.1:$hub_port:8080" -v "$hub_cache:/data" -e HF_HUB_OFFLINE=1 \
    -e LOADMASTER_MAX_MEMORY=cpu=2GiB -e LOADMASTER_GRACE_PERIOD=10 "$IMAGE" loadmaster/demo >/dev/null
say "container $HUB_NAME serves loadmaster/demo from the mounted cache on port $hub_port; waiting for HEALTHCHECK"
wait_healthy "$HUB_NAME"
curl -sf "http://127.0.0.1:$hub_port/info" | "$PY" -c 'import sys; t = sys.stdin.read(); assert "loadmaster/demo" in t, t' \
    || { say "FAILED: /info does not name loadmaster/demo"; docker logs "$HUB_NAME" 2>&1 | tail -n 30; exit 1; }
curl -sf "http://127.0.0.1:$hub_port/generate" -H 'Content-Type: application/json' \
    -d '{"inputs": "Once upon a time", "parameters": {"max_new_tokens": 5}}' >/dev/null \
    || { say "FAILED: /generate by id"; docker logs "$HUB_NAME" 2>&1 | tail -n 30; exit 1; }
docker rm -f "$HUB_NAME" >/dev/null
say "by id: loadmaster/demo served from the mounted cache (HF_HOME=/data, HF_HUB_OFFLINE=1)"

docker run -d --name "$NAME" -p "127.0.0.1:$port:8080" -v "$demo:/models/demo-model:ro" \
    -e LOADMASTER_MAX_MEMORY=cpu=2GiB -e LOADMASTER_GRACE_PERIOD=10 "$IMAGE" /models/demo-model >/dev/null
say "container $NAME on port $port; waiting for HEALTHCHECK"
wait_healthy "$NAME"
reply="$(curl -sf "http://127.0.0.1:$port/generate" -H 'Content-Type: application/json' \
    -d '{"inputs": "Once upon a time", "parameters": {"max_new_tokens": 20, "details": true}}')" \
    || { say "FAILED: /generate"; docker logs "$NAME" 2>&1 | tail -n 30; exit 1; }
echo "$reply" | "$PY" -c 'import json, sys; r = json.load(sys.stdin); assert r["details"]["generated_tokens"] == 20, r; print("docker smoke: /generate ->", repr(r["generated_text"]))'
# The native kernels were built in the build stage (when a compiler could be installed there) and are used in
# the image, which has no compiler, wherever the CPU has the instructions (avx512_bf16 covers both).
kernel="$(docker exec "$NAME" python -c 'from loaders.native import kernel_build; sts = [kernel_build.status(d) for d in kernel_build.KERNELS]; print(all(s.available for s in sts), "|", "; ".join(s.reason for s in sts))')"
if grep -q "native CPU kernels built:" "$LOGS/docker-build.log" && grep -qw avx512_bf16 /proc/cpuinfo; then
    case "$kernel" in True*) say "native kernels: in use in the image ($kernel)" ;;
        *) say "FAILED: the kernels were built in the image but do not load: $kernel"; exit 1 ;; esac
else
    say "native kernels: not in use in the image ($kernel)"
fi
# GPU images load bitsandbytes models through transformers, which needs accelerate at run time: prove both are
# installed and work in this image with a real 4-bit load of the demo model (bitsandbytes' CPU backend here).
# The count carries a label: progress bars on stderr may end the combined output after it.
quant_out="$(docker exec "$NAME" python -c 'import accelerate, bitsandbytes as bnb, loaders; m = loaders.load_model("/models/demo-model", device_map={"": "cpu"}, dtype="float32", quantization="nf4", show_progress=False); print("nf4-linears:", sum(isinstance(x, bnb.nn.Linear4bit) for x in m.modules()), flush=True)' 2>&1 || true)"
quant="$(printf '%s\n' "$quant_out" | sed -n 's/^.*nf4-linears: //p' | tail -n 1)"
case "$quant" in
    ''|0|*[!0-9]*) say "FAILED: a bitsandbytes nf4 load in the image: $(printf '%s\n' "$quant_out" | tail -n 5)"; exit 1 ;;
    *) say "quantized load: $quant nf4 linear layers (accelerate and bitsandbytes work in the image)" ;;
esac
# The CUDA settings are the image's, whatever the base: the allocator's expandable segments, a start period that
# covers a 70B load from network storage.
alloc="$(docker exec "$NAME" printenv PYTORCH_CUDA_ALLOC_CONF || true)"
[ "$alloc" = "expandable_segments:True" ] || { say "FAILED: PYTORCH_CUDA_ALLOC_CONF is '$alloc' in the image"; exit 1; }
start="$(docker inspect -f '{{json .Config.Healthcheck.StartPeriod}}' "$IMAGE")"  # nanoseconds (the plain template prints 30m0s)
[ "$start" -ge 1800000000000 ] || { say "FAILED: HEALTHCHECK start period ${start}ns < 30 min"; exit 1; }
docker stop -t 30 "$NAME" >/dev/null
code="$(docker inspect -f '{{.State.ExitCode}}' "$NAME")"
[ "$code" = 0 ] || { say "FAILED: exit code $code after SIGTERM"; docker logs "$NAME" 2>&1 | tail -n 20; exit 1; }

# -- a model bigger than its container: --memory below the checkpoint's size, no flag but the model ----------------
# The demo model (a few MB) is far smaller than any Python process, so this run serves the 300M test Llama (1.2 GB
# of fp32 safetensors) in a 1 GiB container. The server measures the box and its own footprint, keeps what fits
# resident and streams the rest from the mounted checkpoint; its greedy tokens must equal plain transformers' on the
# host, /metrics must show weights streamed from disk, and the kernel must not OOM-kill it.
say "a model bigger than its container (the 300M Llama, fp32, built once)"
big="$(HF_HUB_OFFLINE=1 "$PY" -c 'from tests.models import llama_300m_dir; print(llama_300m_dir())')"
BOX_BYTES=$((1024 * 1024 * 1024))
big_bytes="$(cat "$big"/*.safetensors | wc -c)"
[ "$big_bytes" -gt "$BOX_BYTES" ] || { say "FAILED: the checkpoint ($big_bytes B) is not bigger than the box"; exit 1; }
BIG_NAME="$NAME-bigger"
trap 'docker rm -f "$BIG_NAME" >/dev/null 2>&1 || true; cleanup' EXIT
# a cold page cache for its shards, as on a machine that just started (pages cached by the host are not charged to
# the container, so a warm cache would hide the streaming)
"$PY" -c 'import os, sys; [os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED) or os.close(fd) for fd in (os.open(p, os.O_RDONLY) for p in sys.argv[1:])]' "$big"/*.safetensors
big_port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
docker run -d --name "$BIG_NAME" --memory "$BOX_BYTES" --memory-swap "$BOX_BYTES" -p "127.0.0.1:$big_port:8080" \
    -v "$big:/models/big:ro" -e LOADMASTER_GRACE_PERIOD=10 "$IMAGE" /models/big >/dev/null
say "container $BIG_NAME: $big_bytes B of checkpoint in --memory $BOX_BYTES, no flag but the model; waiting for HEALTHCHECK"
wait_healthy "$BIG_NAME"
big_reply="$(curl -sf "http://127.0.0.1:$big_port/generate" -H 'Content-Type: application/json' \
    -d '{"inputs": "The sea is", "parameters": {"max_new_tokens": 6, "details": true}}')" \
    || { say "FAILED: /generate in the box"; docker logs "$BIG_NAME" 2>&1 | tail -n 30; exit 1; }
big_metrics="$(curl -sf "http://127.0.0.1:$big_port/metrics")" || { say "FAILED: /metrics in the box"; exit 1; }
oom="$(docker inspect -f '{{.State.OOMKilled}}' "$BIG_NAME")"
[ "$oom" = false ] || { say "FAILED: the container was OOM-killed"; exit 1; }
BIG_REPLY="$big_reply" BIG_METRICS="$big_metrics" "$PY" - "$big" <<'PYCHECK' || { docker logs "$BIG_NAME" 2>&1 | tail -n 30; exit 1; }
import json, os, sys

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.disable_progress_bar()
got = [t["id"] for t in json.loads(os.environ["BIG_REPLY"])["details"]["tokens"]]
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = tok("The sea is", return_tensors="pt")["input_ids"]
with torch.no_grad():
    want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
assert got == want, f"docker smoke: FAILED: greedy tokens in the box {got} != transformers {want}"
streamed = {
    s.labels.get("device"): s.value
    for f in text_string_to_metric_families(os.environ["BIG_METRICS"])
    for s in f.samples
    if s.name == "loadmaster_weights_bytes" and s.labels.get("placement") == "streamed"
}
assert streamed.get("disk", 0) > 0, f"docker smoke: FAILED: no weights streamed from disk: {streamed}"
print(f"docker smoke: bigger than the box: greedy equals transformers, {streamed['disk'] / 1e6:.0f} MB streamed from disk")
PYCHECK
docker rm -f "$BIG_NAME" >/dev/null
say "bigger than the box: served in --memory $BOX_BYTES, not OOM-killed"
say "PASSED (built on $BASE_TAG, healthy, /generate answered by path and by Hub id, stopped cleanly; a model bigger than its container served)"
