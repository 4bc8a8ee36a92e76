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


def test_the_cuda_image_starts_from_an_nvidia_base_image() -> None:
    """torch's CUDA wheel carries its own CUDA libraries: a ``-base`` image suffices (issue 14 item 11)."""
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert base is not None and re.fullmatch(r"nvidia/cuda:[\d.]+-base-ubuntu[\d.]+", base.group(1)), base
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", DOCKERFILE, re.M)
    assert index is not None and "download.pytorch.org/whl/cu" in index.group(1)


def test_the_allocator_uses_expandable_segments() -> None:
    assert re.search(r"^\s*PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\b", DOCKERFILE, re.M)


def test_the_health_check_waits_long_enough_for_a_70b_load() -> None:
    """141 GB at 100 MB/s from network storage is ~24 minutes; the start period must cover it."""
    period = re.search(r"^HEALTHCHECK .*--start-period=(\d+)s", DOCKERFILE, re.M)
    assert period is not None and int(period.group(1)) >= 141e9 / 100e6
