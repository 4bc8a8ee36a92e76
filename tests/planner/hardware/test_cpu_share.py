"""The thread count from the affinity mask, the cgroup CPU quota (v1 and v2, at the root or above the process) and
``--threads``, read from fake files; and, where this machine lets a test make one, from a real v1 cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from planner.hardware.cpu_share import cpu_share, read_cpu_quota
from planner.hardware.device_inventory import HostPaths


def _host(tmp_path: Path, files: dict[str, str], self_cgroup: str = "0::/\n") -> HostPaths:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(parents=True, exist_ok=True)
    (tmp_path / "self_cgroup").write_text(self_cgroup)
    return HostPaths(cgroup_root=str(root), self_cgroup=str(tmp_path / "self_cgroup"))


def test_no_quota_one_thread_per_cpu_of_the_mask(tmp_path: Path) -> None:
    share = cpu_share(paths=_host(tmp_path, {"cpu.max": "max 100000\n"}), affinity=6)
    assert (share.threads, share.bound, share.quota) == (6, "affinity", None)
    assert "affinity mask" in share.reason


def test_a_v2_quota_at_the_namespace_root_caps_the_threads(tmp_path: Path) -> None:
    share = cpu_share(paths=_host(tmp_path, {"cpu.max": "150000 100000\n"}), affinity=8)
    assert (share.threads, share.bound, share.quota) == (1, "quota", 1.5)
    assert "cpu.max" in share.reason and "1.5" in share.reason


def test_a_v2_quota_on_a_parent_cgroup_bounds_the_child(tmp_path: Path) -> None:
    files = {"kubepods/pod1/cpu.max": "200000 100000\n", "kubepods/pod1/c1/cpu.max": "max 100000\n"}
    share = cpu_share(paths=_host(tmp_path, files, "0::/kubepods/pod1/c1\n"), affinity=16)
    assert (share.threads, share.quota) == (2, 2.0)
    assert "kubepods/pod1/cpu.max" in (share.quota_source or "")


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
    }
    files |= {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    paths = _host(tmp_path, files, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    quota = read_cpu_quota(paths)
    assert quota is not None and quota.cpus == 3.0 and "cfs_quota_us" in quota.source
    assert cpu_share(paths=paths, affinity=8).threads == 3


def test_v1_unlimited_and_a_quota_above_the_mask_leave_the_mask(tmp_path: Path) -> None:
    unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert read_cpu_quota(_host(tmp_path / "a", unlimited, "1:cpu:/\n")) is None
    generous = {"cpu/cpu.cfs_quota_us": "800000\n", "cpu/cpu.cfs_period_us": "100000\n"}
    share = cpu_share(paths=_host(tmp_path / "b", generous, "1:cpu:/\n"), affinity=2)
    assert (share.threads, share.bound, share.quota) == (2, "affinity", 8.0)


def test_a_quota_below_one_cpu_still_gets_one_thread(tmp_path: Path) -> None:
    assert cpu_share(paths=_host(tmp_path, {"cpu.max": "50000 100000"}), affinity=4).threads == 1


def test_unreadable_or_odd_files_mean_no_quota(tmp_path: Path) -> None:
    assert read_cpu_quota(_host(tmp_path / "a", {"cpu.max": "lots 100000"})) is None
    assert read_cpu_quota(_host(tmp_path / "b", {})) is None


def test_threads_given_win_and_say_so_when_they_oversubscribe(tmp_path: Path) -> None:
    paths = _host(tmp_path, {"cpu.max": "100000 100000"})
    share = cpu_share(3, paths=paths, affinity=2)
    assert (share.threads, share.bound, share.requested) == (3, "threads", 3)
    assert "--threads 3" in share.reason and "more than the 1 CPU" in share.reason
    assert "more than" not in cpu_share(1, paths=paths, affinity=2).reason


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(not (V1_CPU / "cpu.cfs_quota_us").exists(), reason="no cgroup v1 cpu controller here")
def test_a_real_v1_quota_cgroup_gives_one_thread() -> None:
    """A process moved into a real 1-CPU quota cgroup sees it through /proc/self/cgroup."""
    group = V1_CPU / f"loadmaster-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here ({e})")
    code = (
        f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
        "from planner.hardware.cpu_share import cpu_share; s = cpu_share(affinity=2);"
        "print(s.threads, s.bound, s.quota)"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
        assert out.stdout.split() == ["1", "quota", "1.0"], out
    finally:
        group.rmdir()
