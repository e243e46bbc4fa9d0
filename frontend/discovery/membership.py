"""Membership: turns what discovery reports into connected clients in the router.

:class:`Membership` is the frontend's :class:`DiscoverySink`. Discovery calls it
synchronously; the slow parts run in tasks of the nursery :func:`open_membership`
owns:

* ``worker_added`` → connect (retried with backoff until it works or the worker is
  removed; failures are logged, never raised) → ``router.add(client)``. If the
  worker was known under another address or incarnation, the old client is
  removed and closed first.
* ``worker_removed`` → ``router.remove`` now, close the client in the background
  (bounded by ``close_timeout``, shielded) — unless the worker is *unlisted but
  reachable*, below.
* ``worker_draining`` → ``router.set_draining`` (also applied when a pending
  connection completes later).

Wiring::

    async with open_membership(router, connect_worker) as membership:
        await nursery.start(discovery.run, membership)

Discovery going stale must not empty the routing table. A worker cut off from etcd
(a partition between its host and etcd's) loses its lease and its key while it
serves on: discovery reports it removed, though its plane connection, checked by
heartbeats every second, says it is there. So a removal of a worker that was not
draining (a goodbye drains first) and whose client is ``reachable`` leaves it
routed, *unlisted*, if it answers a probe at once (within ``confirm_timeout``), until
that connection is lost (then it goes, as a removal would have) or discovery lists it
again (it re-registers when etcd is back). Discovery decides who may join; the
connection decides who is still there. The probe keeps a host that died (whose lease
ran out before the heartbeats noticed) from staying routed until the heartbeats do.

Sink calls do only bookkeeping and ``start_soon``, so a burst of changes costs no
buffer beyond one task per connecting worker. *connect* is called from a task of
that nursery, so a transport that runs per-client tasks in the caller's nursery
(``headwater.plane.client.connect_worker`` does) keeps them exactly as long as the
membership. Leaving the block stops pending connections and closes every client it
connected.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from trio_util import AsyncValue

from frontend.router.router import Router
from headwater.backoff import Backoff
from headwater.plane.base import PlaneError, WorkerClient, WorkerInstance

log = logging.getLogger(__name__)

#: Opens a client for a discovered worker; raises (any Exception) when it cannot.
Connect = Callable[[WorkerInstance], Awaitable[WorkerClient]]


@dataclass(frozen=True, slots=True)
class MembershipStats:
    connected: int  # clients in the router that this membership opened
    connecting: int  # workers whose connection is pending or being retried
    draining: int
    unlisted: int  # removed by discovery, still routed while their connection lives
    connect_failures_total: int


@asynccontextmanager
async def open_membership(
    router: Router, connect: Connect, **options: Any
) -> AsyncIterator[Membership]:
    """A :class:`Membership` (*options* are its keyword arguments) whose connection and
    close tasks live until the block ends; then every client it connected is closed
    (each bounded by ``close_timeout``) and removed from the router."""
    async with trio.open_nursery() as nursery:
        membership = Membership(router, connect, nursery, **options)
        try:
            yield membership
        finally:
            await membership._close_all()
            nursery.cancel_scope.cancel()


class Membership:
    """The DiscoverySink that keeps *router* in step with discovery; see the module doc.

    Made by :func:`open_membership`, whose nursery hosts its tasks.
    """

    def __init__(
        self,
        router: Router,
        connect: Connect,
        nursery: trio.Nursery,
        *,
        connect_timeout: float = 10.0,  # seconds per attempt
        close_timeout: float = 5.0,  # seconds to close a removed worker's client
        confirm_timeout: float = 2.0,  # seconds an unlisted worker has to answer a probe
        retry_initial: float = 0.2,  # seconds before the first retry
        retry_max: float = 10.0,  # seconds between retries at most
    ) -> None:
        self.router = router
        self.connect = connect
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.confirm_timeout = confirm_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self._nursery: trio.Nursery | None = nursery
        self._clients: dict[str, WorkerClient] = {}
        self._pending: dict[str, tuple[WorkerInstance, trio.CancelScope]] = {}
        self._draining: set[str] = set()
        self._unlisted: dict[str, trio.CancelScope] = {}  # id → its watch on the connection
        self._failures = 0
        #: Workers whose connection is pending: ``await connecting.wait_value(0)``
        #: waits until every reported worker is in the router (or was removed).
        self.connecting = AsyncValue(0)

    async def _close_all(self) -> None:
        """Stop pending connections; close and remove every client, while the nursery
        (where a transport may run its connection tasks) is still open."""
        self._nursery = None
        for _, scope in self._pending.values():
            scope.cancel()
        self._pending.clear()
        self._count_pending()
        clients = list(self._clients.items())
        self._clients.clear()
        with trio.move_on_after(self.close_timeout, shield=True):
            for worker_id, client in clients:
                if self.router.remove(worker_id) not in (client, None):
                    log.warning("router held another client for %s", worker_id)
                await _close_quietly(client)

    def _count_pending(self) -> None:
        self.connecting.value = len(self._pending)

    def statistics(self) -> MembershipStats:
        return MembershipStats(
            connected=len(self._clients),
            connecting=len(self._pending),
            draining=len(self._draining),
            unlisted=len(self._unlisted),
            connect_failures_total=self._failures,
        )

    # -- DiscoverySink --

    def worker_added(self, instance: WorkerInstance) -> None:
        nursery = self._require_nursery()
        wid = instance.worker_id
        self._draining.discard(wid)
        self._relist(wid)
        pending = self._pending.get(wid)
        if pending is not None:
            if _same(pending[0], instance):
                return  # already connecting to exactly this
            pending[1].cancel()
            del self._pending[wid]
            self._count_pending()
        current = self._clients.get(wid)
        if current is not None:
            if _same(current.instance, instance):
                self.router.set_draining(wid, False)  # a re-announcement: ready again
                return
            self._drop(wid)  # moved or restarted: the old connection is stale
        scope = trio.CancelScope()
        self._pending[wid] = (instance, scope)
        self._count_pending()
        nursery.start_soon(self._connect, instance, scope, name=f"connect {wid}")

    def worker_removed(self, worker_id: str) -> None:
        nursery = self._require_nursery()
        said_goodbye = worker_id in self._draining
        self._draining.discard(worker_id)
        pending = self._pending.pop(worker_id, None)
        self._count_pending()
        if pending is not None:
            pending[1].cancel()
        client = self._clients.get(worker_id)
        if client is not None and not said_goodbye and client.reachable:
            if worker_id not in self._unlisted:
                log.warning(
                    "worker %s left discovery without draining (its lease expired?) but "
                    "its connection is alive: still routed until that connection is lost",
                    worker_id,
                )
                scope = self._unlisted[worker_id] = trio.CancelScope()
                nursery.start_soon(self._route_while_reachable, client, scope)
            return
        self._drop(worker_id)

    def worker_draining(self, worker_id: str) -> None:
        self._draining.add(worker_id)
        self.router.set_draining(worker_id, True)

    # -- internals --

    def _require_nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("Membership used after its open_membership() block ended")
        return self._nursery

    def _relist(self, worker_id: str) -> None:
        scope = self._unlisted.pop(worker_id, None)
        if scope is not None:
            scope.cancel()
            log.info("worker %s is listed by discovery again", worker_id)

    async def _route_while_reachable(self, client: WorkerClient, scope: trio.CancelScope) -> None:
        """An unlisted worker (module doc): drop it unless it answers a probe now, then
        once its connection is lost; unless *scope* is cancelled first (listed again, or
        dropped for another reason)."""
        wid = client.instance.worker_id
        with scope:
            try:
                with trio.fail_after(self.confirm_timeout):
                    await client.probe()
            except (trio.TooSlowError, PlaneError) as exc:
                log.warning("unlisted worker %s did not answer a probe (%r): removed", wid, exc)
            else:
                await client.wait_lost()
                log.warning("unlisted worker %s lost its connection: removed", wid)
            self._unlisted.pop(wid, None)
            self._drop(wid)

    def _drop(self, worker_id: str) -> None:
        nursery = self._require_nursery()
        scope = self._unlisted.pop(worker_id, None)
        if scope is not None:
            scope.cancel()
        ours = self._clients.pop(worker_id, None)
        routed = self.router.remove(worker_id)  # may be another owner's: ours to close now
        for client in (ours, routed if routed is not ours else None):
            if client is not None:
                nursery.start_soon(self._close, client, name=f"close {worker_id}")

    async def _connect(self, instance: WorkerInstance, scope: trio.CancelScope) -> None:
        """Connect (retrying) unless *scope* is cancelled, i.e. the worker went away."""
        wid = instance.worker_id
        client: WorkerClient | None = None
        with scope:
            client = await self._connect_until_done(instance)
        if client is None:
            return  # removed or replaced while connecting
        if scope.cancel_called:
            # Cancelled after the factory's last checkpoint: the client arrived anyway.
            await self._close(client)
            return
        del self._pending[wid]
        self._count_pending()
        self._clients[wid] = client
        self.router.add(client)
        if wid in self._draining:
            self.router.set_draining(wid, True)
        log.info("worker %s (%s) connected at %s", wid, instance.role.value, instance.address)

    async def _connect_until_done(self, instance: WorkerInstance) -> WorkerClient:
        backoff = Backoff(self.retry_initial, self.retry_max)
        while True:
            try:
                with trio.fail_after(self.connect_timeout):
                    return await self.connect(instance)
            except Exception as exc:  # whatever the factory raises: log and retry
                self._failures += 1
                delay = backoff.next()
                log.warning(
                    "connecting to worker %s at %s failed (attempt %d): %r; retrying in %.2f s",
                    instance.worker_id,
                    instance.address,
                    backoff.failures,
                    exc,
                    delay,
                )
            await trio.sleep(delay)

    async def _close(self, client: WorkerClient) -> None:
        with trio.move_on_after(self.close_timeout, shield=True):
            await _close_quietly(client)


async def _close_quietly(client: WorkerClient) -> None:
    try:
        await client.aclose()
    except Exception:
        log.exception("closing the client of worker %s failed", client.instance.worker_id)


def _same(a: WorkerInstance, b: WorkerInstance) -> bool:
    # metadata (pid, start time) is excluded from ==, but a new incarnation
    # at the same address still needs a fresh connection.
    return a == b and a.metadata == b.metadata
