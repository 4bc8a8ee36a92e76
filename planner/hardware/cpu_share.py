"""The CPUs this process may really use, and the thread count that follows from them.

A container's ``--cpus 2`` or a Kubernetes CPU limit is a CFS quota: the kernel lets the cgroup's threads run for
``quota`` microseconds every ``period``, then stops them all until the next period. ``os.cpu_count()`` and torch
still report every core of the host, so a torch that starts a thread per core gets its team throttled mid-step,
and one straggling thread holds every parallel region up. The affinity mask (``taskset``, ``docker --cpuset-cpus``)
is the other bound. :func:`cpu_share` reads both, and ``--threads`` overrides them; the result says which bound
set the number, for ``/info``.

Pure: it reads files under :class:`~planner.hardware.device_inventory.HostPaths` (tests point them at fake ones)
and takes the affinity mask as an argument where a test gives one.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from planner.hardware.device_inventory import HostPaths


@dataclass(frozen=True)
class CpuQuota:
    """A CFS bandwidth limit: ``cpus`` = quota / period, and the file that set it."""

    cpus: float
    source: str


@dataclass(frozen=True)
class CpuShare:
    """How many threads torch and the native kernels run on, and why."""

    threads: int
    #: CPUs in the process's affinity mask.
    affinity: int
    #: The tightest cgroup CPU quota above the process, in CPUs; None when there is none.
    quota: float | None
    quota_source: str | None
    #: ``--threads`` as given; None when the server chose.
    requested: int | None
    #: ``"threads"``, ``"quota"`` or ``"affinity"``: what set :attr:`threads`.
    bound: str
    reason: str

    @property
    def usable_cpus(self) -> int:
        """The CPUs this process may keep busy at once: the affinity mask, capped by the quota rounded down (at
        least 1). What sizes any pool of the process's own (threads, grammar compilers)."""
        return usable_cpus(self.affinity, self.quota)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cpus(affinity: int, quota: float | None) -> int:
    """``affinity`` CPUs capped by a ``quota`` in CPUs, rounded down, at least 1."""
    return min(affinity, max(1, math.floor(quota))) if quota else affinity


def _cpu_cgroup_dirs(paths: HostPaths) -> list[tuple[str, str]]:
    """(directory, version) of this process's CPU controller, most specific first, from ``/proc/self/cgroup``
    (``0::/path`` for v2, ``N:cpu,cpuacct:/path`` for v1); the hierarchy roots last (inside a container the
    namespace makes the own cgroup the root)."""
    try:
        with open(paths.self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    dirs: list[tuple[str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], parts[2].strip("/")
        if parts[0] == "0" and controllers == "":
            dirs.extend((d, "v2") for d in _up_to_root(paths.cgroup_root, rel))
        elif "cpu" in controllers.split(","):
            for mount in dict.fromkeys((controllers, "cpu,cpuacct", "cpu")):
                base = os.path.join(paths.cgroup_root, mount)
                if os.path.isdir(base):
                    dirs.extend((d, "v1") for d in _up_to_root(base, rel))
                    break
    for base, version in ((paths.cgroup_root, "v2"), (os.path.join(paths.cgroup_root, "cpu"), "v1")):
        if (base, version) not in dirs:
            dirs.append((base, version))
    return dirs


def _up_to_root(base: str, rel: str) -> list[str]:
    """``base/a/b/c``, ``base/a/b``, ``base/a``, ``base``: a parent's quota bounds its children's too."""
    parts = [p for p in rel.split("/") if p]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _quota_in(directory: str, version: str) -> CpuQuota | None:
    """The quota one cgroup directory sets, or None (no file, ``max``, ``-1``, unreadable)."""
    if version == "v2":
        text = _read(os.path.join(directory, "cpu.max"))
        fields = text.split() if text else []
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota_text, period_text = fields
        source = f"cgroup v2 {os.path.join(directory, 'cpu.max')}"
    else:
        quota_text = _read(os.path.join(directory, "cpu.cfs_quota_us")) or ""
        period_text = _read(os.path.join(directory, "cpu.cfs_period_us")) or ""
        source = f"cgroup v1 {os.path.join(directory, 'cpu.cfs_quota_us')} / cpu.cfs_period_us"
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return CpuQuota(cpus=quota / period, source=source)


#: The real files; tests pass their own.
HOST = HostPaths()


def read_cpu_quota(paths: HostPaths = HOST) -> CpuQuota | None:
    """The tightest CFS quota on this process's cgroup or any cgroup above it (v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``, v2 ``cpu.max``), or None when nothing limits it."""
    found = [q for d, v in _cpu_cgroup_dirs(paths) if (q := _quota_in(d, v)) is not None]
    return min(found, key=lambda q: q.cpus) if found else None


def affinity_count() -> int:
    """CPUs in this process's affinity mask (``os.cpu_count()`` where the platform has no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_share(requested: int | None = None, *, paths: HostPaths = HOST, affinity: int | None = None) -> CpuShare:
    """The thread count for this process: ``requested`` (``--threads``) when given; else the CPUs of the affinity
    mask, capped by the cgroup quota rounded down (at least 1), so the team never needs more CPU time per period
    than the quota grants and no thread waits out a throttled period while the others spin for it."""
    cpus = affinity if affinity is not None else affinity_count()
    quota = read_cpu_quota(paths)
    q_cpus, q_source = (quota.cpus, quota.source) if quota else (None, None)
    if requested:
        over = usable_cpus(cpus, q_cpus)
        note = f"; more than the {over} CPU(s) this process may use" if requested > over else ""
        return CpuShare(
            requested, cpus, q_cpus, q_source, requested, "threads", f"--threads {requested} as given{note}"
        )
    if quota is not None and max(1, math.floor(quota.cpus)) < cpus:
        threads = max(1, math.floor(quota.cpus))
        why = f"the cgroup CPU quota of {quota.cpus:g} CPU(s) ({quota.source}), below the {cpus} CPU(s) of the mask"
        return CpuShare(threads, cpus, q_cpus, q_source, None, "quota", f"{threads} thread(s): {why}")
    why = f"{cpus} thread(s): one per CPU of the affinity mask"
    if quota is not None:
        why += f" (the cgroup quota of {quota.cpus:g} CPU(s) allows as many)"
    return CpuShare(cpus, cpus, q_cpus, q_source, None, "affinity", why)
