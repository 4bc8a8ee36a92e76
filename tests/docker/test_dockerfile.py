"""The Dockerfile's CUDA settings, read without Docker (the smoke test builds and runs the image in CI).

There is one Dockerfile: the CUDA image is its default build, and the CPU image that tests/docker/smoke.sh builds
differs only in its build arguments, so every install step the CUDA image runs is run by the smoke test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_one_dockerfile_serves_both_images() -> None:
    assert [p.name for p in ROOT.glob("Dockerfile*")] == ["Dockerfile"]
    smoke = (ROOT / "tests" / "docker" / "smoke.sh").read_text()
    assert "--build-arg BASE_IMAGE=" in smoke and "--build-arg TORCH_INDEX_URL=" in smoke


def test_the_cuda_image_inherits_no_driver_requirement_torch_does_not_have() -> None:
    """torch's CUDA wheel carries its own CUDA libraries, so the base is plain Ubuntu: an nvidia/cuda base would bring
    NVIDIA_REQUIRE_CUDA, refusing drivers torch runs on (issue 34 defect 8); the toolkit still mounts the driver."""
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert base is not None and re.fullmatch(r"ubuntu:[\d.]+", base.group(1)), base
    assert "NVIDIA_REQUIRE_CUDA" not in DOCKERFILE.split("ARG BASE_IMAGE")[1].replace("an nvidia/cuda base", "")
    assert re.search(r"^\s*NVIDIA_VISIBLE_DEVICES=all\b", DOCKERFILE, re.M)
    assert re.search(r"^\s*NVIDIA_DRIVER_CAPABILITIES=compute,utility\b", DOCKERFILE, re.M)
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", DOCKERFILE, re.M)
    assert index is not None and "download.pytorch.org/whl/cu" in index.group(1)


def test_the_allocator_uses_expandable_segments() -> None:
    assert re.search(r"^\s*PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\b", DOCKERFILE, re.M)


def test_the_gpu_check_measures_the_allocator_the_image_runs() -> None:
    image = re.search(r"^\s*PYTORCH_CUDA_ALLOC_CONF=(\S+?)\s*\\?$", DOCKERFILE, re.M).group(1)
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert f'PYTORCH_CUDA_ALLOC_CONF="${{PYTORCH_CUDA_ALLOC_CONF:-{image}}}"' in script


def test_a_wheels_folder_makes_the_build_offline() -> None:
    """With docker/build-extras/wheels/ the build reaches no index: --find-links alone would still need four."""
    assert re.search(r"^ARG WHEELS_ONLY=1$", DOCKERFILE, re.M)
    assert 'if [ "${WHEELS_ONLY}" = 1 ]; then export PIP_NO_INDEX=1; offline=1; fi' in DOCKERFILE
    assert 'if [ -n "${TORCH_INDEX_URL}" ] && [ "$offline" = 0 ]' in DOCKERFILE


def test_a_torch_missing_from_the_cuda_index_fails_the_build_with_what_to_do() -> None:
    assert "is not on ${TORCH_INDEX_URL}: pick a version it lists" in DOCKERFILE
    assert "torch.version.cuda" in DOCKERFILE


def test_the_health_check_waits_long_enough_for_a_70b_load() -> None:
    """141 GB at 100 MB/s from network storage is ~24 minutes; the start period must cover it."""
    period = re.search(r"^HEALTHCHECK .*--start-period=(\d+)s", DOCKERFILE, re.M)
    assert period is not None and int(period.group(1)) >= 141e9 / 100e6
