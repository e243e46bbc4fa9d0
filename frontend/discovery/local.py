"""The in-process cluster: workers in the frontend's own process, as a discovery source.

``headwater serve`` without ``--workers`` or ``--discovery`` runs a disaggregated pair
(one prefill, one decode worker) or one aggregated worker here, each a
:class:`~workers.runtime.WorkerRuntime` around an engine built through the engine
registry. :class:`LocalCluster` reports them to the membership like the static and
etcd sources report remote ones, and its :meth:`~LocalCluster.connect` opens a
:class:`~headwater.plane.memory.MemoryWorkerClient` to each: the same interfaces the
TCP plane uses, so nothing downstream knows the difference.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from frontend.discovery.base import Discovery, DiscoverySink
from headwater.instrumentation.attribution import StallAttribution
from headwater.plane.base import WorkerClient, WorkerInstance
from headwater.plane.kv import KvSource
from headwater.plane.memory import MemoryWorkerClient
from headwater.wire import Role
from workers.engines import registry
from workers.engines.base import Engine, EngineContext
from workers.runtime import WorkerRuntime, load_of, open_runtime
from workers.runtime.kv_transfer import InProcessKvTransfer


class LocalCluster(Discovery):
    """Runs the in-process workers for as long as :meth:`run` runs.

    *mode* is ``disagg`` (a prefill + decode pair) or ``agg`` (one worker); *engine*
    and *engine_config* name the engine and its config (None: its defaults).
    """

    def __init__(
        self,
        *,
        model: str,
        mode: str = "disagg",
        engine: str = registry.DEFAULT_ENGINE,
        engine_config: Any = None,
        ack_timeout: float = 5.0,
    ) -> None:
        if mode not in ("disagg", "agg"):
            raise ValueError(f"mode must be disagg or agg, got {mode!r}")
        self.model = model
        self.roles = [Role.PREFILL, Role.DECODE] if mode == "disagg" else [Role.AGG]
        self.engine = engine
        self.engine_config = engine_config
        self.ack_timeout = ack_timeout
        #: The running workers by id, once :meth:`run` reported them.
        self.runtimes: dict[str, WorkerRuntime] = {}
        #: Given to the clients: excuses a missed ACK while this loop stalled.
        self.attribution: StallAttribution | None = None

    async def run(
        self,
        sink: DiscoverySink,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        kv = InProcessKvTransfer()
        workers: list[tuple[WorkerInstance, Engine]] = []
        for i, role in enumerate(self.roles):
            worker_id = f"local-{role.value}-{i}"
            address = f"memory://{worker_id}"
            context = EngineContext(role, worker_id, kv, address, beside_frontend=True)
            engine = registry.build(self.engine, self.engine_config, context)
            if isinstance(engine, KvSource):
                kv.register(worker_id, engine)
            instance = WorkerInstance(
                worker_id, role, self.model, address, capabilities=engine.capabilities
            )
            workers.append((instance, engine))
        async with trio.open_nursery() as nursery:
            # The engines start side by side: one backed by a model server takes that
            # server's start-up time (vLLM's: tens of seconds), and a pair should not
            # take twice as long. A worker is reported once every one is up.
            started = [trio.Event() for _ in workers]
            for (instance, engine), event in zip(workers, started, strict=True):
                nursery.start_soon(self._host, instance.worker_id, engine, event)
            for event in started:
                await event.wait()
            for instance, _ in workers:
                sink.worker_added(instance)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                for worker_id in self.runtimes:
                    sink.worker_removed(worker_id)
                self.runtimes.clear()

    async def _host(self, worker_id: str, engine: Engine, started: trio.Event) -> None:
        """Run one worker's runtime until cancelled; *started* once it serves."""
        async with open_runtime(engine, worker_id) as runtime:
            self.runtimes[worker_id] = runtime
            started.set()
            await trio.sleep_forever()

    async def connect(self, instance: WorkerInstance) -> WorkerClient:
        """The membership's connect for these workers: an in-process client."""
        await trio.lowlevel.checkpoint()
        runtime = self.runtimes.get(instance.worker_id)
        if runtime is None:
            raise LookupError(f"no in-process worker {instance.worker_id!r}")
        return MemoryWorkerClient(
            instance,
            runtime,
            ack_timeout=self.ack_timeout,
            load=partial(load_of, runtime),
            attribution=self.attribution,
        )
