"""The CPU's capacity on this machine is the smaller of MemAvailable and the container's memory limit (issue 14
item 4): a container limited to 8 GiB on a 256 GiB host must not be planned 200 GiB of offloaded weights.
The cgroup and meminfo files are fake ones in a tmp dir; the reading code is the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.api import plan
from planner.hardware.device_inventory import HostPaths, build_hardware, host_memory
from tests.planner.synthetic import llama_like

GiB = 2**30


def _host(tmp_path: Path, mem_available: int, files: dict[str, str], self_cgroup: str = "0::/\n") -> HostPaths:
    (tmp_path / "meminfo").write_text(
        f"MemTotal:       {256 * GiB // 1024} kB\nMemAvailable:   {mem_available // 1024} kB\n"
    )
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self_cgroup").write_text(self_cgroup)
    return HostPaths(
        meminfo=str(tmp_path / "meminfo"), cgroup_root=str(root), self_cgroup=str(tmp_path / "self_cgroup")
    )


def test_cgroup_v2_limit_below_mem_available_bounds_cpu_and_is_named_in_reasons(tmp_path):
    paths = _host(tmp_path, 200 * GiB, {"memory.max": f"{8 * GiB}\n"})
    hw = build_hardware(gpus="1x24GiB", host_paths=paths)
    assert hw.get("cpu").capacity == 8 * GiB
    p = plan(llama_like(layers=4, hidden=128, intermediate=344, vocab=512), hardware=hw)
    assert any("container's memory limit" in r and "cgroup v2 memory.max" in r for r in p.reasons), p.reasons
    cpu_budget = next(b for b in p.budgets if b.device == "cpu")
    assert cpu_budget.capacity == 8 * GiB


def test_cgroup_v1_limit_is_read(tmp_path):
    paths = _host(tmp_path, 64 * GiB, {"memory/memory.limit_in_bytes": f"{3 * GiB}\n"}, "5:memory:/\n")
    mem = host_memory(paths)
    assert (mem.available, mem.bound) == (3 * GiB, "cgroup v1 memory.limit_in_bytes")


def test_nested_v2_cgroup_from_proc_self_cgroup(tmp_path):
    paths = _host(
        tmp_path,
        64 * GiB,
        {"memory.max": "max\n", "system.slice/app.service/memory.max": f"{2 * GiB}\n"},
        "0::/system.slice/app.service\n",
    )
    assert host_memory(paths).available == 2 * GiB


@pytest.mark.parametrize(
    "files",
    [
        {"memory.max": "max\n"},
        {"memory/memory.limit_in_bytes": "9223372036854771712\n"},  # v1's "unlimited"
        {},  # no cgroup files at all
        {"memory.max": f"{500 * GiB}\n"},  # a limit above MemAvailable does not bind
    ],
)
def test_no_or_loose_limit_leaves_mem_available(tmp_path, files):
    paths = _host(tmp_path, 12 * GiB, files)
    mem = host_memory(paths)
    assert (mem.available, mem.bound) == (12 * GiB, "MemAvailable")
    hw = build_hardware(gpus="1x24GiB", host_paths=paths)
    assert hw.get("cpu").capacity == 12 * GiB
    assert hw.notes and "MemAvailable" in hw.notes[0]


def test_max_memory_given_is_not_bounded_or_annotated(tmp_path):
    paths = _host(tmp_path, 200 * GiB, {"memory.max": f"{8 * GiB}\n"})
    hw = build_hardware({"cpu": "16GiB"}, host_paths=paths)
    assert hw.get("cpu").capacity == 16 * GiB
    assert hw.notes == ()
