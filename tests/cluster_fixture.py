"""Helpers for tests that run clusters of processes: ``headwater launch`` as a child,
worker counters over the request plane, process state from /proc.

Policy as in tests/test_cluster.py: everything on 127.0.0.1, ports 0 or probed, waits
bounded by ``trio.fail_after``; the launcher's stdout is read until its READY line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from headwater.cli.launch import CLUSTER_READY_PREFIX
from headwater.cluster.recipes import WorkerProcess
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.wire import Role
from headwater.wire.handshake import generate_secret

FAST = 100.0  # mocker speedup
FRONTEND_ARGS = ("--tokenizer-backend", "hf", "--log-level", "warning")


def alive(pid: int) -> bool:
    """Whether *pid* runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(pid: int) -> set[int]:
    """The pids whose parent is *pid*."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@dataclass
class Launched:
    process: trio.Process
    url: str
    children: dict[str, int]  # name → pid, as the launcher lists them
    addresses: dict[str, str]  # name → address, as the launcher lists them
    workdir: Path
    log: Path  # the launcher's stderr
    metrics: dict[str, str]  # worker name → its /metrics URL (with --worker-metrics)

    def restarted(self, name: str) -> int | None:
        """The pid of *name*'s latest restart, from the launcher's log; None if none yet."""
        found = re.findall(
            rf"supervisor: {re.escape(name)} is back \(pid (\d+)\)", self.log.read_text()
        )
        return int(found[-1]) if found else None


#: The plane secret :func:`launch` gives its cluster (launch makes one per run when the
#: caller has none; the tests that talk to its workers need to know it).
LAUNCH_SECRET = generate_secret().encode()


@asynccontextmanager
async def launch(tmp_path: Path, *args: str, speedup: float = FAST) -> AsyncIterator[Launched]:
    """``headwater launch --port 0 --speedup-ratio SPEEDUP ARGS`` until the block ends
    (then killed if still up); its logs in ``tmp_path``."""
    workdir = tmp_path / "cluster"
    with (tmp_path / "launch.log").open("wb") as log:
        launcher = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "headwater",
                "launch",
                "--port",
                "0",
                "--speedup-ratio",
                f"{speedup:g}",
                "--workdir",
                str(workdir),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")},
                "HEADWATER_PLANE_SECRET": LAUNCH_SECRET.decode(),
            },
        )
    try:
        assert launcher.stdout is not None
        output = b""
        with trio.fail_after(60):
            while CLUSTER_READY_PREFIX.encode() not in output:
                data = await launcher.stdout.receive_some(4096)
                assert data, f"launcher exited; see {tmp_path / 'launch.log'}"
                output += data
        text = output.decode()
        url = text.splitlines()[-1].split()[1]
        listed = re.findall(r"^  (\S+) +pid (\d+) +(\S+)$", text, re.M)
        children = {name: int(pid) for name, pid, _ in listed}
        addresses = {name: address for name, _, address in listed}
        metrics = dict(re.findall(r"^  (\S+) +metrics (\S+)$", text, re.M))
        yield Launched(
            launcher, url, children, addresses, workdir, tmp_path / "launch.log", metrics
        )
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()
        assert launcher.stdout is not None
        await trio.aclose_forcefully(launcher.stdout)


async def wait_dead(pid: int, within: float = 10.0) -> None:
    """Until *pid* has exited (its sockets are closed then)."""
    with trio.fail_after(within):
        while alive(pid):
            await trio.sleep(0.005)


async def debug_workers(url: str) -> dict[str, dict[str, Any]]:
    """address → the frontend's view of the worker there (/debug/workers)."""
    async with httpx.AsyncClient() as http:
        r = await http.get(url + "/debug/workers")
    r.raise_for_status()
    return {w["address"]: w for w in r.json()}


@dataclass(frozen=True)
class Worker:
    """What a test knows of a worker it did not start itself (a launched one)."""

    worker_id: str
    role: str
    address: str


async def worker_stats(
    workers: Sequence[WorkerProcess | Worker], model: str, secret: bytes | None = None
) -> dict[str, dict[str, Any]]:
    """Each worker's own counters, over a plane connection of the test's (with *secret*:
    :data:`LAUNCH_SECRET` for the workers of :func:`launch`)."""
    out: dict[str, dict[str, Any]] = {}
    async with trio.open_nursery() as nursery:
        for w in workers:
            instance = WorkerInstance(w.worker_id, Role(w.role), model, w.address)
            client = await connect_worker(instance, nursery, secret=secret)
            out[w.worker_id] = await client.fetch_stats()
            await client.aclose()
    return out
