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


def _host(
    tmp_path: Path, mem_available: int, files: dict[str, str], self_cgroup: str = "0::/\n", status: str = ""
) -> HostPaths:
    (tmp_path / "meminfo").write_text(
        f"MemTotal:       {256 * GiB // 1024} kB\nMemAvailable:   {mem_available // 1024} kB\n"
    )
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self_cgroup").write_text(self_cgroup)
    (tmp_path / "status").write_text(status)
    return HostPaths(
        meminfo=str(tmp_path / "meminfo"),
        cgroup_root=str(root),
        self_cgroup=str(tmp_path / "self_cgroup"),
        self_status=str(tmp_path / "status"),
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


STATUS = "Name:\tpython\nVmRSS:\t  700000 kB\nRssAnon:\t  300000 kB\nRssFile:\t  400000 kB\n"


def test_what_the_box_already_holds_is_taken_off_its_limit_v2(tmp_path):
    """The process's own interpreter, torch and tokenizer (and whatever else runs in the box) are measured:
    the cgroup's anonymous memory plus this process's mapped files."""
    paths = _host(
        tmp_path, 200 * GiB, {"memory.max": f"{3 * GiB}\n", "memory.stat": "anon 314572800\nfile 999\n"}, status=STATUS
    )
    host = host_memory(paths)
    assert host.available == 3 * GiB - 314572800 - 400000 * 1024
    assert "anon" in host.reason and "mapped files" in host.reason and "3.0GiB" in host.reason


def test_what_the_box_already_holds_is_taken_off_its_limit_v1(tmp_path):
    files = {
        "memory/memory.limit_in_bytes": f"{3 * GiB}\n",
        "memory/memory.stat": "cache 5\nrss 7\ntotal_rss 200000000\n",
    }
    paths = _host(tmp_path, 200 * GiB, files, self_cgroup="4:memory:/\n", status=STATUS)
    assert host_memory(paths).available == 3 * GiB - 200000000 - 400000 * 1024


def test_without_memory_stat_the_process_rss_is_taken_off(tmp_path):
    paths = _host(tmp_path, 200 * GiB, {"memory.max": f"{3 * GiB}\n"}, status=STATUS)
    host = host_memory(paths)
    assert host.available == 3 * GiB - 700000 * 1024 and "VmRSS" in host.reason


def test_the_real_box_counts_this_process(tmp_path):
    """On this machine: a real cgroup file set, read by the real code, takes off at least this process's RSS."""
    import os

    paths = HostPaths(meminfo="/proc/meminfo", self_status="/proc/self/status")
    status = Path("/proc/self/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
    assert rss > 0
    fake = _host(tmp_path, 200 * GiB, {"memory.max": f"{64 * GiB}\n"}, status=status)
    assert host_memory(fake).available <= 64 * GiB - rss // 2  # RSS moves a little between the two reads
    assert host_memory(paths).available > 0 and os.path.exists(paths.self_status)
