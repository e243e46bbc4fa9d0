"""A worker's registration in etcd: one key on a lease, kept alive for the worker's life.

The key and value are the ones :mod:`headwater.etcd.records` documents
(``headwater/v1/instances/<model>/<role>/<worker_id>`` → an ``InstanceRecord``).
The key is attached to a lease, so a worker that dies without saying goodbye
disappears from every frontend by itself, at most ``ttl`` seconds after its last
keep-alive. Two ways to use it:

As an async context manager — registered on entry, deregistered on exit::

    async with EtcdRegistration("http://127.0.0.1:2379", instance) as registration:
        ...                                   # serve
        await registration.mark_draining()    # on SIGTERM, before draining requests
    # leaving the block revokes the lease: frontends drop the worker at once

As a task — ``await nursery.start(registration.run)`` returns once the key is
written; cancelling the task (or ``await registration.deregister()``) revokes.

A worker process uses it through :class:`RegistrationHooks` (``--discovery``), which
ties those steps to the worker's ready / drain / exit lifecycle.

While running it renews the lease every ``ttl / 3`` seconds and repairs what it
finds: a lost lease (keep-alive answers TTL 0 — etcd was wiped, or someone revoked
it) gets a new lease and the key again; a deleted or overwritten key is written
again. etcd being unreachable is logged and retried; it never stops the worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from types import TracebackType

import trio

from headwater.backoff import Backoff
from headwater.etcd.client import (
    EtcdClient,
    EtcdCredentials,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    EventType,
    Lease,
)
from headwater.etcd.records import KEY_PREFIX, InstanceRecord, InstanceState, model_prefix
from headwater.plane.base import WorkerInstance
from headwater.plane.kv import KvPeers
from headwater.wire import Role
from headwater.wire.capabilities import Capabilities

log = logging.getLogger(__name__)


class EtcdRegistration:
    """Keeps *instance* registered in etcd; see the module docstring.

    ``run`` waits (retrying with backoff, logging each failure) until the first
    registration succeeds: wrap it in ``trio.fail_after`` to bound that.
    Deregistration is best effort within ``deregister_timeout`` seconds; if it
    fails the lease expires on its own. The etcd client is created per ``run``
    unless one is passed in (then it stays the caller's to close).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        instance: WorkerInstance,
        *,
        ttl: int = 10,  # seconds; etcd raises values below its minimum (~2 s)
        prefix: str = KEY_PREFIX,
        timeout: float = 5.0,  # seconds per etcd request
        deregister_timeout: float = 2.0,  # seconds
        client: EtcdClient | None = None,
        backoff: Backoff | None = None,
        pid: int | None = None,
        started_at: float | None = None,  # unix time; default: now
        secret: bytes | None = None,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        """*secret* (the plane secret) signs the record, so frontends trust it
        (:mod:`headwater.etcd.records`); *credentials* authenticate to etcd."""
        if ttl < 1:
            raise ValueError("ttl must be at least 1 second")
        self.endpoints = endpoints
        self.ttl = ttl
        self.prefix = prefix
        self.timeout = timeout
        self.deregister_timeout = deregister_timeout
        self._record = InstanceRecord.from_instance(
            instance,
            pid=os.getpid() if pid is None else pid,
            started_at=time.time() if started_at is None else started_at,
        )
        self._client = client
        self._secret = secret
        self._credentials = credentials
        self._active: EtcdClient | None = None
        self._backoff = backoff or Backoff(0.1, max(0.2, ttl / 3))
        self._lease: Lease | None = None
        self._lock = trio.Lock()
        self._scope: trio.CancelScope | None = None
        self._nursery_cm: AbstractAsyncContextManager[trio.Nursery] | None = None
        self.registrations = 0  # successful grant+put rounds (1 + re-registrations)

    @property
    def key(self) -> str:
        return self._record.key(self.prefix)

    def _value(self) -> bytes:
        """The record as stored: signed with the plane secret, when there is one."""
        return self._record.to_json(self._secret)

    @property
    def record(self) -> InstanceRecord:
        """The value as currently published (or about to be)."""
        return self._record

    @property
    def lease_id(self) -> int | None:
        """The lease the key is attached to, or None when not registered."""
        return self._lease.id if self._lease else None

    # -- as a task --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register, signal ``started()``, keep the registration alive until cancelled.

        Returns normally after :meth:`deregister`. On the way out the lease is revoked.
        """
        if self._scope is not None:
            raise RuntimeError("EtcdRegistration.run() is already running")
        client = self._client or EtcdClient(
            self.endpoints, timeout=self.timeout, credentials=self._credentials
        )
        self._active = client
        try:
            with trio.CancelScope() as self._scope:
                await self._register_first(client)
                task_status.started()
                await self._keep_alive(client)
        finally:
            self._scope = None
            with trio.move_on_after(self.deregister_timeout, shield=True):
                await self._revoke(client)
                if self._client is None:
                    await client.aclose()
            self._active = None

    async def _register_first(self, client: EtcdClient) -> None:
        while True:
            try:
                async with self._lock:
                    await self._register(client)
            except EtcdError as exc:
                delay = self._backoff.next()
                log.warning("registering %s in etcd: %s; retrying in %.2f s", self.key, exc, delay)
            else:
                self._backoff.reset()
                return
            await trio.sleep(delay)

    async def _keep_alive(self, client: EtcdClient) -> None:
        interval = max(0.1, (self._lease.ttl if self._lease else self.ttl) / 3)
        delay = interval
        while True:
            await trio.sleep(delay)
            try:
                async with self._lock:
                    await self._refresh(client)
            except EtcdError as exc:
                # Retry sooner than the interval: the lease is running out meanwhile.
                delay = min(interval, self._backoff.next())
                log.warning("etcd keep-alive for %s: %s; retrying in %.2f s", self.key, exc, delay)
            else:
                self._backoff.reset()
                interval = max(0.1, (self._lease.ttl if self._lease else self.ttl) / 3)
                delay = interval

    async def _refresh(self, client: EtcdClient) -> None:
        """One keep-alive round; re-registers or rewrites the key when needed."""
        if self._lease is None or await client.lease_keepalive(self._lease.id) <= 0:
            log.warning("etcd lease for %s was lost; registering again", self.key)
            await self._register(client)
            return
        kv = await client.get(self.key)
        if kv is None or kv.lease != self._lease.id or kv.value != self._value():
            log.warning("etcd key %s was deleted or changed; writing it again", self.key)
            try:
                await client.put(self.key, self._value(), lease=self._lease.id)
            except EtcdLeaseNotFound:
                await self._register(client)

    async def _register(self, client: EtcdClient) -> None:
        lease = await client.lease_grant(self.ttl)
        self._lease = lease
        await client.put(self.key, self._value(), lease=lease.id)
        self.registrations += 1
        log.info("registered %s in etcd (lease %x, ttl %d s)", self.key, lease.id, lease.ttl)

    async def _revoke(self, client: EtcdClient) -> None:
        async with self._lock:
            lease, self._lease = self._lease, None
            if lease is None:
                return
            try:
                await client.lease_revoke(lease.id)
            except EtcdError as exc:
                log.warning("revoking lease of %s: %s (it expires by itself)", self.key, exc)

    # -- state changes --

    async def mark_draining(self) -> None:
        """Publish ``state: "draining"``: frontends stop sending new requests here.

        The state sticks across re-registrations. A failed write is logged, not
        raised; the keep-alive loop writes it again on its next round.
        """
        self._record = replace(self._record, state=InstanceState.DRAINING)
        client = self._active
        if client is None:
            return  # not running: the first registration carries the state
        try:
            async with self._lock:
                if self._lease is not None:
                    await client.put(self.key, self._value(), lease=self._lease.id)
        except EtcdError as exc:
            log.warning("publishing draining for %s: %s; will retry", self.key, exc)

    async def deregister(self) -> None:
        """Revoke the lease now (the key disappears at once) and end :meth:`run`.

        Idempotent; bounded by ``deregister_timeout`` and shielded, so it completes
        during a shutdown that is itself being cancelled.
        """
        if self._scope is not None:
            self._scope.cancel()
        client = self._active
        if client is not None:
            with trio.move_on_after(self.deregister_timeout, shield=True):
                await self._revoke(client)

    # -- as an async context manager --

    async def __aenter__(self) -> EtcdRegistration:
        # The nursery is entered here and left in __aexit__ with no exception, so
        # the body's own exception propagates as itself, not wrapped in a group.
        nursery_cm = trio.open_nursery()
        nursery = await nursery_cm.__aenter__()
        try:
            await nursery.start(self.run)
        except BaseException as exc:
            nursery.cancel_scope.cancel()
            await nursery_cm.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._nursery_cm = nursery_cm
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        nursery_cm, self._nursery_cm = self._nursery_cm, None
        await self.deregister()
        if nursery_cm is not None:
            await nursery_cm.__aexit__(None, None, None)


class RegistrationHooks:
    """A worker's etcd registration tied to :func:`workers.lifecycle.serve_worker`'s lifecycle.

    The order matters to frontends: a worker must be gone from routing before it
    stops taking requests, and must stay known until what it accepted is done.

    * :meth:`on_ready` (an ``on_ready`` hook): registers the advertised address and the
      engine's declaration, and keeps the lease alive in a task of *nursery*. Raises
      :class:`~headwater.etcd.EtcdUnavailable` if the first registration does not
      succeed within *register_timeout* seconds (a worker no frontend can find is
      useless, so that is fatal).
    * :meth:`on_stop` (an ``on_stop`` hook, run before the goaway): publishes
      ``draining``, so frontends stop routing new requests here.
    * :meth:`deregister`, to call after the drain: revokes the lease.

    A hard stop that cancels *nursery* revokes the lease too (shielded, bounded).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        nursery: trio.Nursery,
        *,
        worker_id: str,
        role: str,
        model: str,
        capacity: int = 256,
        ttl: int = 10,  # seconds
        register_timeout: float = 30.0,  # seconds
        secret: bytes | None = None,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.secret = secret
        self.credentials = credentials
        self.worker_id = worker_id
        self.role = role
        self.model = model
        self.capacity = capacity
        self.ttl = ttl
        self.register_timeout = register_timeout
        self.registration: EtcdRegistration | None = None
        self._nursery = nursery

    async def on_ready(self, address: str, capabilities: Capabilities | None = None) -> None:
        instance = WorkerInstance(
            self.worker_id,
            Role(self.role),
            self.model,
            address,
            capacity=self.capacity,
            capabilities=capabilities,
        )
        registration = EtcdRegistration(
            self.endpoints,
            instance,
            ttl=self.ttl,
            secret=self.secret,
            credentials=self.credentials,
        )
        with trio.move_on_after(self.register_timeout) as scope:
            await self._nursery.start(registration.run)
        if scope.cancelled_caught:
            raise EtcdUnavailable(
                f"could not register {instance.worker_id} in etcd at {self.endpoints} "
                f"within {self.register_timeout:g} s"
            )
        self.registration = registration

    async def on_stop(self) -> None:
        if self.registration is not None:
            await self.registration.mark_draining()

    async def deregister(self) -> None:
        """Revoke the lease (idempotent; bounded and shielded, see EtcdRegistration)."""
        if self.registration is not None:
            await self.registration.deregister()


async def follow_prefill_workers(
    endpoints: str | Sequence[str],
    model: str,
    peers: KvPeers,
    *,
    secret: bytes | None = None,
    credentials: EtcdCredentials | None = None,
    prefix: str = KEY_PREFIX,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep *peers* to the prefill workers of *model* registered in etcd, until cancelled:
    a decode worker pulls KV only from those (the SSRF bound of
    :class:`~headwater.plane.kv.KvPeers`). A record counts as the frontends' do: signed
    with *secret* when there is one, under its own key. Reports started after the first
    range (or at once if etcd is down: it retries with backoff meanwhile)."""
    watched = f"{model_prefix(model, prefix)}prefill/"
    by_key: dict[bytes, str] = {}  # key → worker id

    def apply(key: bytes, value: bytes | None) -> None:
        if (old := by_key.pop(key, None)) is not None:
            peers.unregister(old)
        if value is None:
            return
        try:
            rec = InstanceRecord.from_json(value, secret)
            if rec.key(prefix).encode() != key:
                raise ValueError("stored under another key than its own")
        except ValueError as exc:
            log.warning("not a KV peer: etcd key %r: %s", key, exc)
            return
        by_key[key] = rec.worker_id
        peers.register(rec.worker_id, rec.address)

    backoff = Backoff(0.1, 5.0)
    started = False
    async with EtcdClient(endpoints, credentials=credentials) as client:
        while True:
            try:
                snapshot = await client.range(watched, prefix=True)
                for key in list(by_key):
                    apply(key, None)
                for kv in snapshot.kvs:
                    apply(kv.key, kv.value)
                if not started:
                    started = True
                    task_status.started()
                async with client.watch(
                    watched, prefix=True, start_revision=snapshot.revision + 1
                ) as events:
                    backoff.reset()
                    async for event in events:
                        apply(event.kv.key, event.kv.value if event.type is EventType.PUT else None)
            except EtcdError as exc:
                if not started:
                    started = True
                    task_status.started()
                delay = backoff.next()
                log.warning("following prefill workers in etcd: %s; retrying in %.2f s", exc, delay)
                await trio.sleep(delay)
