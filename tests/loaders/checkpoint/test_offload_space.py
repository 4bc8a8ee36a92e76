"""A full offload disk (issue 38): the free space is checked against the bytes the write needs before anything is
written, the refusal names the folder, the bytes needed and the bytes free, and a write that fails anyway (here a
real file-size limit, ``RLIMIT_FSIZE``) leaves no temporary file behind. The full disk is a real, small tmpfs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import loaders
from loaders.checkpoint.offload_folder import DATA, INDEX, OffloadSpaceError, free_bytes

BF16_DISK = {"model.layers.3": "disk", "model.layers.2": "disk", "": "cpu"}
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own (needs the right to mount; skipped where there is none)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_without_room_is_refused_before_writing(tiny_llama: Path, small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (free_bytes(small_disk) - 32 * 1024))  # leave 32 KiB
    folder = small_disk / "offload"
    free = free_bytes(small_disk)
    with pytest.raises(OffloadSpaceError) as caught:
        loaders.load_model(
            tiny_llama, device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False
        )
    message = str(caught.value)
    assert str(folder) in message and f"({free} bytes) free" in message and "needs" in message
    needed = int(message.split("needs ")[1].split("(")[1].split(" bytes")[0])
    assert needed > free
    assert list(folder.iterdir()) == []  # nothing written
    filler.unlink()  # with room again, the same load works and the folder is complete
    loaders.load_model(tiny_llama, device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False)
    assert {p.name for p in folder.iterdir()} == {DATA, INDEX}


WRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
import loaders
from loaders.checkpoint.offload_folder import OffloadSpaceError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))
try:
    loaders.load_model(sys.argv[1], device_map={"model.layers.3": "disk", "model.layers.2": "disk", "": "cpu"},
                       dtype="bfloat16", offload_folder=sys.argv[2], show_progress=False)
except OffloadSpaceError as exc:
    print("REFUSED", exc)
    sys.exit(3)
"""


def test_a_write_that_fails_leaves_no_temporary_file(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "offload"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOADMASTER_CPU_KERNELS": "torch"}
    done = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_A_SIZE_LIMIT, str(tiny_llama), str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert str(folder) in done.stdout and "writing failed" in done.stdout
    assert list(folder.iterdir()) == [], list(folder.iterdir())
