"""Small helpers the tests share (each written once)."""

from __future__ import annotations

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
