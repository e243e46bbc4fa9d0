"""In-process workers: the default ``headwater serve`` topology.

Starts a disaggregated pair (one prefill, one decode worker) or one aggregated worker
in the frontend's own process, each a :class:`WorkerRuntime` around an engine, and
registers them with the router through :class:`MemoryWorkerClient` — the same
interfaces the TCP plane uses, so nothing downstream knows the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from frontend.plane.memory import MemoryWorkerClient
from frontend.router import Router
from headwater.plane.base import WorkerInstance
from headwater.wire import Role
from workers.engines.base import Engine
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.runtime import WorkerRuntime
from workers.runtime.kv_transfer import InProcessKvTransfer


@dataclass(frozen=True, slots=True)
class LocalWorkersConfig:
    model: str
    mode: str = "disagg"  # "disagg" | "agg"
    engine: str = "mocker"
    speedup_ratio: float = 1.0
    ack_timeout: float = 5.0


def make_engine(
    kind: str, role: Role, worker_id: str, speedup_ratio: float, kv: InProcessKvTransfer
) -> Engine:
    if kind != "mocker":
        raise ValueError(f"unknown engine {kind!r} (available: mocker)")
    return MockerEngine(
        MockerConfig(speedup_ratio=speedup_ratio),
        role,
        worker_id,
        kv_transfer=kv,
        transfer_address=f"memory://{worker_id}",
    )


async def run_local_workers(
    config: LocalWorkersConfig,
    router: Router,
    *,
    task_status: trio.TaskStatus[list[WorkerRuntime]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the in-process workers until cancelled; reports the runtimes once routable."""
    roles = [Role.PREFILL, Role.DECODE] if config.mode == "disagg" else [Role.AGG]
    kv = InProcessKvTransfer()
    runtimes: list[WorkerRuntime] = []
    async with trio.open_nursery() as nursery:
        for i, role in enumerate(roles):
            worker_id = f"local-{role.value}-{i}"
            engine = make_engine(config.engine, role, worker_id, config.speedup_ratio, kv)
            kv.register(worker_id, engine)
            runtime = WorkerRuntime(engine, worker_id)
            await nursery.start(runtime.run)
            instance = WorkerInstance(worker_id, role, config.model, f"memory://{worker_id}")
            router.add(MemoryWorkerClient(instance, runtime, ack_timeout=config.ack_timeout))
            runtimes.append(runtime)
        task_status.started(runtimes)
        try:
            await trio.sleep_forever()
        finally:
            for rt in runtimes:
                router.remove(rt.worker_id)
