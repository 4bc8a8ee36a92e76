"""A real memory cgroup to run a server in: a box smaller than the model, as ``docker run --memory`` makes one.

The one definition for both its users: the cgroup tests (``tests/service/cli/test_bigger_than_box.py``) and
``bench/bigbox.py``. It lives in ``bench`` because nothing outside ``tests`` may import from ``tests``
(``tests/test_import_graph.py``).

cgroup v2 (``memory.max``, ``memory.events``' ``oom_kill``) where the unified hierarchy has the memory controller,
else v1 (``memory.limit_in_bytes``, ``memory.oom_control``'s ``oom_kill``). Needs root; :func:`cgroup_unavailable`
says why not where a box cannot be made, so a test can skip with that reason.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class MemoryBox:
    """One memory cgroup: its folder, its limit, and which cgroup version it is."""

    path: Path
    limit: int
    v2: bool

    def join(self) -> Callable[[], None]:
        """A ``preexec_fn`` that moves the child into the box before it runs anything."""
        procs = str(self.path / "cgroup.procs")
        return lambda: Path(procs).write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        """Processes the kernel killed for memory in this box."""
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def peak(self) -> int:
        """The most memory the box held (v1 ``max_usage_in_bytes``, v2 ``memory.peak`` where the kernel has it)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        path = self.path / name
        return int(path.read_text()) if path.exists() else -1

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:  # its last process is still exiting
                time.sleep(0.1)


def _v2_has_memory() -> bool:
    controllers = V2 / "cgroup.controllers"
    return controllers.exists() and "memory" in controllers.read_text().split()


def cgroup_unavailable() -> str | None:
    """Why no memory box can be made here, or None where one can."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    if not _v2_has_memory() and not (V1 / "memory.limit_in_bytes").exists():
        return "no memory cgroup controller is mounted (neither v2 memory.max nor v1 memory.limit_in_bytes)"
    return None


def make_box(limit: int) -> MemoryBox:
    """A fresh memory cgroup limited to ``limit`` bytes, swap included where the kernel accounts it."""
    name = f"loadmaster-test-{uuid.uuid4().hex[:8]}"
    if _v2_has_memory():
        path = V2 / name
        path.mkdir()
        (path / "memory.max").write_text(str(limit))
        swap = path / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")
        return MemoryBox(path, limit, v2=True)
    path = V1 / name
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(limit))
    memsw = path / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        memsw.write_text(str(limit))
    return MemoryBox(path, limit, v2=False)
