"""A fixture that runs a test once per native-kernel path this CPU has (avx512, avx2) and once on torch's kernels.

Each run sets ``LOADMASTER_CPU_ISA`` and resets :mod:`loaders.native.kernel_build`, so the path really is the one named
in the test id; the test asserts the loaded path, and the session summary lists every path that ran.
"""

from __future__ import annotations

import pytest

from loaders.native import kernel_build

#: The paths tests ran, for the session summary (tests/loaders/conftest.py prints it).
KERNEL_PATHS_RUN: set[str] = set()
PATHS = [*kernel_build.runnable_isas(), "torch"]
NATIVE_PATHS = [p for p in PATHS if p != "torch"]


def use_path(monkeypatch: pytest.MonkeyPatch, path: str) -> kernel_build.KernelStatus:
    """Switch the process to ``path`` and return the loaded status (asserted to be that path)."""
    monkeypatch.setenv("LOADMASTER_CPU_ISA", path)
    monkeypatch.delenv("LOADMASTER_CPU_KERNELS", raising=False)
    kernel_build.reset()
    st = kernel_build.status()
    if path == "torch":
        assert not st.available
    elif kernel_build._compiler() is not None:
        # On a capable machine with a compiler the kernels must build: a broken build is a failure, not a fallback.
        assert st.available and st.isa == path, st.reason
    KERNEL_PATHS_RUN.add(path if st.available or path == "torch" else f"{path} (not built: {st.reason})")
    print(f"kernel path: {path} ({st.reason})")
    return st


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch):
    """Every path, torch's kernels included."""
    yield use_path(monkeypatch, request.param)
    monkeypatch.undo()
    kernel_build.reset()


@pytest.fixture(params=NATIVE_PATHS or [pytest.param("none", marks=pytest.mark.skip("no native path on this CPU"))])
def native_path(request, monkeypatch):
    """Every native path this CPU runs."""
    st = use_path(monkeypatch, request.param)
    if not st.available:
        pytest.fail(f"the {request.param} path did not load: {st.reason}")
    yield st
    monkeypatch.undo()
    kernel_build.reset()
