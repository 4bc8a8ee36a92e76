# loadmaster: big-model inference with planned device maps, for multi-GPU hosts.
#
#   docker build -t loadmaster .
#   docker run --gpus all -p 8080:8080 -v /models:/models:ro -v loadmaster-data:/data \
#       -e LOADMASTER_MODEL=/models/my-model loadmaster
#
# One Dockerfile for both images, so the CPU image's smoke test (tests/docker/smoke.sh: a local Debian base,
# TORCH_INDEX_URL= for PyPI's CPU torch) runs every install step the CUDA image runs. The CUDA image is the
# default. Its base is plain Ubuntu, not nvidia/cuda: torch's CUDA wheel brings its own CUDA runtime, cuBLAS, cuDNN
# and NCCL as pip packages, and an nvidia/cuda base would add its NVIDIA_REQUIRE_CUDA, which makes the container
# toolkit refuse drivers older than that image's CUDA even where torch's wheel runs on them (issue 34 defect 8).
# The two NVIDIA_* variables below are what the toolkit needs to mount the host's driver (`--gpus all`).
# See docs/gpu.md. Build-time-only inputs (a CA bundle for pip, a folder of wheels) go in docker/build-extras/
# and stay in the build stage: the final image holds only the virtualenv. With docker/build-extras/wheels/ present
# the build is offline: every package, torch included, comes from that folder (--no-index).
ARG BASE_IMAGE=ubuntu:24.04

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
# A CUDA build of torch by default; set empty to take torch from PyPI or the wheels in build-extras.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# With wheels in docker/build-extras/wheels/: 1 (the default) installs from them alone (--no-index, an offline
# build); 0 lets pip also reach the indexes for what the folder lacks (the smoke test's partial wheel cache).
ARG WHEELS_ONLY=1
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=180
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# A C compiler in the build stage only, to build the native CPU kernels once (loaders/native/kernel_build.py); the final
# image carries the built libraries, not the compiler. Best effort: without it the image uses torch's kernels.
ARG NATIVE_KERNELS=1
RUN if [ "${NATIVE_KERNELS}" = 1 ] && ! command -v cc >/dev/null 2>&1; then \
        (timeout 300 apt-get update && timeout 300 apt-get install -y --no-install-recommends gcc libc6-dev \
         && rm -rf /var/lib/apt/lists/*) >/tmp/apt-gcc.log 2>&1 \
        || echo "no C compiler could be installed: the image will use torch's CPU kernels"; \
    fi
COPY docker/build-extras/ /build-extras/
COPY pyproject.toml README.md* /src/
COPY planner /src/planner
COPY loaders /src/loaders
COPY service /src/service
RUN set -eu; \
    if [ -f /build-extras/ca.crt ]; then export PIP_CERT=/build-extras/ca.crt; fi; \
    offline=0; \
    if [ -d /build-extras/wheels ] && ls /build-extras/wheels/*.whl >/dev/null 2>&1; then \
        export PIP_FIND_LINKS=/build-extras/wheels; \
        if [ "${WHEELS_ONLY}" = 1 ]; then export PIP_NO_INDEX=1; offline=1; fi; \
    fi; \
    test -f /src/README.md || echo "# loadmaster" > /src/README.md; \
    python3 -m venv /opt/loadmaster; \
    if [ "$offline" = 0 ]; then /opt/loadmaster/bin/pip install --upgrade pip; fi; \
    if [ -n "${TORCH_INDEX_URL}" ] && [ "$offline" = 0 ]; then \
        /opt/loadmaster/bin/pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX_URL}" \
        || { echo "${TORCH_SPEC} is not on ${TORCH_INDEX_URL}: pick a version it lists" \
                  "(pip index versions torch --index-url ${TORCH_INDEX_URL}) and pass --build-arg TORCH_SPEC=torch==X"; exit 1; }; \
        /opt/loadmaster/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 'torch ' + torch.__version__ + ' from ${TORCH_INDEX_URL} has no CUDA')"; \
    else \
        /opt/loadmaster/bin/pip install "${TORCH_SPEC}"; \
    fi; \
    /opt/loadmaster/bin/pip install /src; \
    /opt/loadmaster/bin/loadmaster --help >/dev/null; \
    if [ "${NATIVE_KERNELS}" = 1 ]; then \
        LOADMASTER_KERNEL_CACHE=/opt/loadmaster/kernels /opt/loadmaster/bin/python -c \
            "from loaders.native import kernel_build, map_guard; print('native CPU kernels built:', *kernel_build.build_all(), map_guard.build())" \
        || echo "native CPU kernels not built: the image will use torch's CPU kernels"; \
    fi

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    (getent group loadmaster || groupadd --system --gid 10001 loadmaster) \
    && useradd --system --uid 10001 --gid loadmaster --home-dir /data --no-create-home --shell /usr/sbin/nologin loadmaster \
    && mkdir -p /data && chown loadmaster:loadmaster /data
COPY --from=build /opt/loadmaster /opt/loadmaster
ENV PATH=/opt/loadmaster/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data \
    HF_HUB_OFFLINE=1 \
    LOADMASTER_HOME=/data/loadmaster \
    LOADMASTER_KERNEL_CACHE=/opt/loadmaster/kernels \
    LOADMASTER_HOST=0.0.0.0 \
    LOADMASTER_PORT=8080 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
VOLUME ["/data"]
USER loadmaster
WORKDIR /data
EXPOSE 8080
# expandable_segments: the KV cache and the streaming slots grow and shrink with the batch; expandable segments
# map more memory into one segment instead of leaving fragments that an OOM then cannot use.
# Healthy once the model is loaded. Failed checks during the start period do not count, and the first success
# ends it, so it is sized for the slowest load: a 70B model in bf16 (141 GB) from network storage at 100 MB/s
# takes ~24 minutes.
HEALTHCHECK --interval=5s --timeout=3s --start-period=1800s --retries=3 \
    CMD ["/opt/loadmaster/bin/python", "-c", "import os, sys, urllib.request; port = os.environ.get('LOADMASTER_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health/ready', timeout=2).status == 200 else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["loadmaster", "serve"]
