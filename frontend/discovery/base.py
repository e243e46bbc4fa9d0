"""The discovery interface: how the frontend learns which workers exist.

A :class:`Discovery` source (a static ``--workers`` list, an etcd prefix) reports
the current set of workers to a :class:`DiscoverySink` and then every change, for
as long as its ``run`` task lives. The sink — in the frontend, :class:`Membership`
— turns those reports into connections and router entries. The split keeps each
source free of transport and routing concerns, and lets tests drive the sink by hand.

Sink calls are *synchronous* and made from the discovery task: a slow sink would
stall discovery, so a sink only records the change and does the slow part
(connecting, closing) in tasks of its own.
"""

from __future__ import annotations

import abc
from typing import Protocol

import trio

from headwater.plane.base import WorkerInstance


class DiscoverySink(Protocol):
    """Receives what a :class:`Discovery` source sees. Methods must not block or raise.

    * ``worker_added(instance)`` — the worker is there and ready. Called again for a
      known ``worker_id`` when its record changed (a new address after a restart,
      or back to ready after draining): the new instance replaces the old one.
    * ``worker_removed(worker_id)`` — the worker is gone; unknown ids are ignored.
    * ``worker_draining(worker_id)`` — the worker still serves what it has but takes
      no new requests. It is reported after ``worker_added`` for the same id.
    """

    def worker_added(self, instance: WorkerInstance) -> None: ...

    def worker_removed(self, worker_id: str) -> None: ...

    def worker_draining(self, worker_id: str) -> None: ...


class Discovery(abc.ABC):
    """A source of worker membership."""

    @abc.abstractmethod
    async def run(
        self,
        sink: DiscoverySink,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Report the current workers to *sink*, signal ``started()``, then report changes.

        ``task_status.started()`` is called once the initial set has been reported, so
        ``await nursery.start(discovery.run, sink)`` returns with the sink up to date.
        Runs until cancelled. Transient failures of the backing store are retried and
        logged, never raised; only misuse (e.g. a malformed configuration) raises.
        """
