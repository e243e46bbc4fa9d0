"""``--processes auto`` and the pools are sized from the CPUs a process may really use:
the affinity mask capped by the cgroup's CPU quota (a container's limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from headwater import machine
from headwater.machine import cgroup_cpu_limit, usable_cpus


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_quota_and_the_tightest_along_the_path(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cg"
    _files(
        root,
        {
            "cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "300000 100000\n",
            "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 1.5
    _files(root, {"kubepods/pod1/ctr/cpu.max": "max 100000\n"})  # the pod's limit remains
    assert cgroup_cpu_limit(root, proc) == 3.0
    _files(root, {"kubepods/pod1/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) is None


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/x\n2:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "cg"
    _files(
        root,
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 2.5
    _files(root, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n"})
    assert cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_file_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None


def test_usable_cpus_is_capped_by_the_quota_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 1.5)
    assert usable_cpus() == 2
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 0.2)
    assert usable_cpus() == 1
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: None)
    assert usable_cpus() == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 8.0)
    assert usable_cpus() == 2  # the affinity mask is tighter
