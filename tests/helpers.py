"""Small helpers the tests share (each written once)."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import trio

from workers.engines.base import Engine
from workers.runtime import WorkerRuntime, open_runtime


async def start_runtime(nursery: trio.Nursery, engine: Engine, worker_id: str) -> WorkerRuntime:
    """A runtime serving *engine* for as long as *nursery* runs (a test's nursery)."""

    async def host(*, task_status: trio.TaskStatus[WorkerRuntime]) -> None:
        async with open_runtime(engine, worker_id) as runtime:
            task_status.started(runtime)
            await trio.sleep_forever()

    runtime: WorkerRuntime = await nursery.start(host)
    return runtime


def logged_at(log: Path, pattern: str) -> datetime:
    """Time of the first log line matching *pattern* (the logging module's asctime)."""
    for line in log.read_text().splitlines():
        if re.search(pattern, line):
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"{pattern!r} not in {log}")
