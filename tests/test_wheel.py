"""The project as a wheel: ``pip install .`` gets the kernel sources, the page and the demo's text, and the installed
``loadmaster serve --demo`` answers ``/generate`` from outside the repository.

The wheel is built from a copy of the sources (nothing is written into the checkout) without build isolation (no
index is reached; setuptools comes from the test extra). It is installed into a throwaway venv that sees this
venv's packages (torch is not installed again) but not the checkout, and the demo model it serves is built here
first into the run's own cache, in one training step, so the test takes seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "loaders", "service")
#: The package data the wheel must carry (each pattern's files in the checkout, by path).
DATA = ("loaders/native/kernels/*.c", "loaders/native/kernels/*.h", "service/ui/*.*", "service/model/data/*.txt")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, src],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert "warning" not in (build.stdout + build.stderr).lower(), build.stdout + build.stderr
    (path,) = out.glob("loadmaster-*.whl")
    return path


def test_the_wheel_carries_the_kernel_sources_the_page_and_the_demo_text(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for pattern in DATA:
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file()]
        assert files, pattern
        assert not set(files) - names, f"missing from the wheel: {sorted(set(files) - names)}"
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES), tops


def _venv_seeing_this_one(folder: Path) -> Path:
    """A venv without pip whose interpreter also sees this venv's site-packages (torch, pip, ...): a ``.pth`` line
    adds the folder, and the ``.pth`` files inside it (this checkout's editable install) are not read."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True, timeout=120)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    outer = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    Path(purelib, "outer-venv.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    return python


def test_the_installed_wheel_serves_the_demo(wheel: Path, tmp_path: Path) -> None:
    from service.model.demo_model import build_demo_model

    home = tmp_path / "home"
    build_demo_model(home / "demo-model", max_seconds=0)  # the demo's recipe, trained for one step
    python = _venv_seeing_this_one(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(LOADMASTER_HOME=str(home), HF_HUB_OFFLINE="1")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    where = subprocess.run(
        [python, "-c", "import service, loaders; print(service.__file__); print(loaders.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path / "venv") for p in where), where

    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [tmp_path / "venv" / "bin" / "loadmaster", "serve", "--demo", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        r = httpx.post(url + "/generate", json={"inputs": "The fox", "parameters": {"max_new_tokens": 4}}, timeout=120)
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["generated_text"], str)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
