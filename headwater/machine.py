"""Facts about the machine that size headwater's pools and processes."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota
    (a container's CPU limit, rounded up), never the machine's whole count. In a
    Kubernetes pod with ``limits.cpu: 2`` on a 64-core node this is 2, so
    ``--processes auto`` starts two frontend processes, not 64."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs this process's cgroup may use (quota ÷ period), the tightest along its
    path up to the root; None without a limit or where cgroups cannot be read.

    cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") in the unified hierarchy at
    the path ``/proc/self/cgroup``'s ``0::`` line names. cgroup v1: ``cpu.cfs_quota_us``
    (-1: none) and ``cpu.cfs_period_us`` under the ``cpu`` controller's mount."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    limits: list[float] = []
    if "" in paths:  # v2
        for directory in _up_to(root, paths[""]):
            fields = _read(directory / "cpu.max").split()
            if len(fields) == 2 and fields[0] != "max":
                limits.append(int(fields[0]) / int(fields[1]))
    if "cpu" in paths:  # v1, mounted as cpu or cpu,cpuacct
        for mount in (root / "cpu", root / "cpu,cpuacct"):
            for directory in _up_to(mount, paths["cpu"]):
                quota = _read(directory / "cpu.cfs_quota_us").strip()
                period = _read(directory / "cpu.cfs_period_us").strip()
                if quota and period and int(quota) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _up_to(root: Path, path: str) -> list[Path]:
    """*root* joined with *path* and each of its parents, up to *root* itself."""
    parts = [p for p in path.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return ""
