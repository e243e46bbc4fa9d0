"""The two things the soak runs against, started as a user would and found again by pid.

- ``serve``: ``python -m headwater serve`` (what ``make serve`` runs: the DeepSeek-V4
  tokenizer and an in-process prefill + decode pair of mocker workers), one process;
  its trio tasks from its own ``/debug/runtime``.
- ``launch``: ``python -m headwater launch --prefill 1 --decode 1 --worker-metrics``: the
  launcher, etcd (when the binary is found, as by default), a prefill and a decode
  worker process and a frontend reaching them over the TCP request plane, the decode
  worker pulling each prompt's KV from the prefill worker. ``--restart-budget 0``: a
  process that dies stops the cluster instead of coming back unnoticed. Each process
  is found by the pid the launcher lists; the workers' tasks come from their own
  metrics endpoints (``--worker-metrics``), the frontend's from its ``/debug/runtime``.

Every listener is on 127.0.0.1 on a free port (``--port 0``, the workers' ports are
picked by the launcher). Process handles belong to the caller's nursery: cancelling
it kills what is left (:mod:`headwater.cluster.children`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import trio

from headwater.cli.launch import CLUSTER_READY_PREFIX
from headwater.cluster.children import ChildProcess, child_env, read_announcement, spawn
from headwater.cluster.recipes import start_frontend, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("serve", "launch")


@dataclass(frozen=True, slots=True)
class Watched:
    """A process the soak reads: by pid from ``/proc``; its trio tasks from
    ``http://127.0.0.1:<runtime_port>/debug/runtime`` when it has one."""

    name: str
    pid: int
    role: str  # frontend, worker, launcher, etcd
    runtime_port: int | None = None
    #: Its ``/metrics`` (workers: inflight and KV at the end).
    metrics_port: int | None = None
    #: Judged by the soak (etcd, a third-party program, is read and plotted only).
    judged: bool = True


@dataclass(slots=True)
class Target:
    name: str
    url: str
    child: ChildProcess
    processes: list[Watched] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None
        return port


def _port(url: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"no port in {url!r}")
    return port


async def start_serve(
    nursery: trio.Nursery,
    out_dir: Path,
    extra_args: Sequence[str] = (),
    env_extra: Mapping[str, str] | None = None,
) -> Target:
    """``python -m headwater serve --port 0`` as ``make serve`` runs it (its default
    group: one process per usable CPU under a supervisor) with its log in *out_dir*;
    ready once ``/health`` is 200. Each process of the group is watched on its own."""
    env = child_env({"PYTHONPATH": str(ROOT), **(env_extra or {})})
    frontend = await start_frontend(
        nursery,
        log_dir=out_dir,
        name="serve",
        extra_args=["--log-level", "info", *extra_args],
        env=env,
        processes=None,  # serve's default: the group
    )
    await wait_healthy(frontend.address, child=frontend)
    watched = [
        Watched(
            "frontend" if len(frontend.members) == 1 else f"frontend-{m.index}",
            m.pid,
            "frontend",
            runtime_port=_port(m.url),
        )
        for m in frontend.members
    ]
    if frontend.members[0].pid != frontend.pid:  # a group: its supervisor too
        watched.insert(0, Watched("supervisor", frontend.pid, "launcher"))
    return Target("serve", frontend.address, frontend, watched, [out_dir / "serve.log"])


#: ``name pid N address`` and ``name metrics URL``, as the launcher lists its processes.
_LISTED = re.compile(r"^(\S+) +pid (\d+) +(\S+)$")
_METRICS = re.compile(r"^(\S+) +metrics (\S+)$")


def parse_listing(lines: Sequence[str]) -> tuple[list[Watched], str]:
    """The processes and the URL from the launcher's announcement (lines stripped)."""
    url = ""
    pids: dict[str, tuple[int, str]] = {}
    metrics: dict[str, int] = {}
    for line in lines:
        if line.startswith(CLUSTER_READY_PREFIX):
            url = line.split()[1]
        elif m := _LISTED.match(line):
            pids[m[1]] = (int(m[2]), m[3])
        elif m := _METRICS.match(line):
            metrics[m[1]] = _port(m[2])
    watched = []
    for name, (pid, address) in pids.items():
        if name == "frontend":
            watched.append(Watched(name, pid, "frontend", runtime_port=_port(address)))
        elif name == "etcd":
            watched.append(Watched(name, pid, "etcd", judged=False))
        else:
            port = metrics.get(name)
            watched.append(Watched(name, pid, "worker", runtime_port=port, metrics_port=port))
    return watched, url


async def start_launch(
    nursery: trio.Nursery,
    out_dir: Path,
    extra_args: Sequence[str] = (),
    env_extra: Mapping[str, str] | None = None,
) -> Target:
    """``python -m headwater launch`` (1 prefill + 1 decode, worker metrics, no
    restarts), its logs under *out_dir*; ready once it printed its READY line and
    ``/health`` is 200. *extra_args* go to every worker's engine (before ``--``)."""
    workdir = out_dir / "launch-cluster"
    argv = [
        sys.executable,
        "-m",
        "headwater",
        "launch",
        "--port",
        "0",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--worker-metrics",
        "--restart-budget",
        "0",
        "--workdir",
        str(workdir),
        *extra_args,
        "--",
        "--log-level",
        "info",
    ]
    env = child_env({"PYTHONPATH": str(ROOT), **(env_extra or {})})
    child = await spawn(ChildProcess, nursery, "launch", argv, out_dir / "launch.log", env=env)
    lines: list[str] = []

    def parse(line: str) -> bool | None:
        lines.append(line)
        return True if line.startswith(CLUSTER_READY_PREFIX) else None

    await read_announcement(child, nursery, parse, 120.0)
    child.mark_ready(None)
    watched, url = parse_listing(lines)
    child.address = url
    await wait_healthy(url, child=child)
    launcher = Watched("launcher", child.pid, "launcher")
    logs = [out_dir / "launch.log", *(workdir / f"{w.name}.log" for w in watched)]
    return Target("launch", url, child, [launcher, *watched], logs)


async def start_target(
    name: str,
    nursery: trio.Nursery,
    out_dir: Path,
    extra_args: Sequence[str] = (),
    env_extra: Mapping[str, str] | None = None,
) -> Target:
    """*env_extra*: variables for every process of the target (``PYTHONTRACEMALLOC``)."""
    if name == "serve":
        return await start_serve(nursery, out_dir, extra_args, env_extra)
    if name == "launch":
        return await start_launch(nursery, out_dir, extra_args, env_extra)
    raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
