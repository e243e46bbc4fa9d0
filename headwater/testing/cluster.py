"""The in-process server's workers: the frontend's own in-process cluster, observed.

:class:`ObservedCluster` is :class:`~frontend.discovery.LocalCluster` (the workers
``headwater serve`` runs in its own process, each a worker runtime around an engine
from the registry) with three additions a test needs: any set of roles (two decode
workers, say, so that a killed one has a stand-in), each worker reached through
:class:`~headwater.testing.faults.ObservedRuntime` (legs recorded, faults injected),
and :meth:`~ObservedCluster.kill`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from frontend.discovery import DiscoverySink, LocalCluster
from headwater.plane.base import WorkerClient, WorkerInstance
from headwater.plane.memory import MemoryWorkerClient
from headwater.testing.faults import Faults, ObservedRuntime
from headwater.wire import Role
from workers.engines.base import Engine
from workers.runtime import load_of

#: The ``workers`` a server may be given by name: the real server's two layouts.
LAYOUTS = {"disagg": ("prefill", "decode"), "agg": ("agg",)}


def roles_of(workers: str | Sequence[str]) -> list[Role]:
    """The roles of *workers*: a layout's name (``disagg``, ``agg``) or one role per
    worker (``["prefill", "decode", "decode"]``). Raises ValueError."""
    names = LAYOUTS.get(workers, (workers,)) if isinstance(workers, str) else tuple(workers)
    try:
        roles = [Role(name) for name in names]
    except ValueError:
        raise ValueError(
            f"workers must be 'disagg', 'agg' or a list of roles (prefill, decode, agg), "
            f"got {workers!r}"
        ) from None
    generating = [r for r in roles if r is not Role.PREFILL]
    if not generating:
        raise ValueError(f"workers {workers!r} has no decode or agg worker: nothing generates")
    return roles


class ObservedCluster(LocalCluster):
    """In-process workers of *roles*, observed and faulted through *faults*; their
    refusals run in *nursery*. The other arguments are :class:`LocalCluster`'s."""

    def __init__(
        self, *, roles: Sequence[Role], faults: Faults, nursery: trio.Nursery, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.roles = list(roles)
        self.faults = faults
        self._nursery = nursery
        self._scopes: dict[str, trio.CancelScope] = {}
        self._sink: DiscoverySink | None = None
        #: The workers killed so far, by id.
        self.killed: list[str] = []

    async def run(
        self, sink: DiscoverySink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self._sink = sink
        await super().run(sink, task_status=task_status)

    async def _host(self, worker_id: str, engine: Engine, started: trio.Event) -> None:
        with trio.CancelScope() as scope:  # kill() ends this worker alone
            self._scopes[worker_id] = scope
            await super()._host(worker_id, engine, started)

    async def connect(self, instance: WorkerInstance) -> WorkerClient:
        """An in-process client, as :class:`LocalCluster`'s, to the observed runtime."""
        await trio.lowlevel.checkpoint()
        runtime = self.runtimes.get(instance.worker_id)
        if runtime is None:
            raise LookupError(f"no in-process worker {instance.worker_id!r}")
        observed = ObservedRuntime(runtime, instance.role, self.faults, self._nursery)
        return MemoryWorkerClient(
            instance,
            observed,
            ack_timeout=self.ack_timeout,
            load=partial(load_of, runtime),
            attribution=self.attribution,
        )

    def kill(self, worker_id: str) -> None:
        """The worker dies now: its engine and every request on it are cancelled (their
        streams end without End, as a dead process's connections do) and it leaves the
        cluster, as discovery would report. Raises LookupError for an unknown one."""
        scope = self._scopes.pop(worker_id, None)
        if scope is None:
            raise LookupError(f"no live in-process worker {worker_id!r}")
        scope.cancel()
        self.runtimes.pop(worker_id, None)
        self.killed.append(worker_id)
        if self._sink is not None:
            self._sink.worker_removed(worker_id)
