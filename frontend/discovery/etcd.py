"""Worker discovery through etcd: the frontend follows the workers registered there.

Each worker owns one key under ``headwater/v1/instances/<model>/<role>/<worker_id>``
attached to a lease it keeps alive (:mod:`headwater.etcd.records` has the layout and
the record, :mod:`headwater.etcd.client` the client; the workers' side is
``workers.runtime.registration``).

:class:`EtcdDiscovery` ranges the prefix, reports that set, then watches from the
range's revision + 1, so no change between the two is lost; when the watch breaks
(etcd restarted, history compacted) it ranges again and reports only the difference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import trio

from frontend.discovery.base import Discovery, DiscoverySink
from headwater.backoff import Backoff
from headwater.etcd.client import (
    EtcdClient,
    EtcdCompacted,
    EtcdCredentials,
    EtcdError,
    EventType,
    KeyValue,
    WatchEvent,
)
from headwater.etcd.records import KEY_PREFIX, InstanceRecord, InstanceState, model_prefix

log = logging.getLogger(__name__)


class EtcdDiscovery(Discovery):
    """Follows the workers registered under the instance prefix (one model, or all).

    ``run`` reports the registered set, signals ``started()`` (after the first
    successful range: if etcd is down it waits, retrying, so bound it with
    ``trio.fail_after`` if that matters), then follows a watch. A lost watch is
    retried with backoff; a malformed record is logged and treated as absent.
    The client is created per ``run`` unless one is passed in.

    With *secret* (the plane secret) a record counts only if it is signed with it and
    stored under the key its own fields name: whoever can write to etcd without the
    secret cannot add a worker, or send a known worker's traffic elsewhere
    (:mod:`headwater.etcd.records`). *credentials* authenticate to etcd.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        model: str | None = None,
        *,
        prefix: str = KEY_PREFIX,
        timeout: float = 5.0,  # seconds per etcd request
        client: EtcdClient | None = None,
        backoff: Backoff | None = None,
        secret: bytes | None = None,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.secret = secret
        self.credentials = credentials
        self.model = model
        self.prefix = prefix
        self.timeout = timeout
        self._client = client
        self._backoff = backoff or Backoff(0.1, 5.0)
        self.resyncs = 0  # ranges done: 1 + one per lost watch

    @property
    def watch_prefix(self) -> str:
        return model_prefix(self.model, self.prefix) if self.model else self.prefix

    async def run(
        self,
        sink: DiscoverySink,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        client = self._client or EtcdClient(
            self.endpoints, timeout=self.timeout, credentials=self.credentials
        )
        members = _Members(sink, self.model, self.secret, self.prefix)
        started = False
        try:
            while True:
                delay = 0.0
                try:
                    snapshot = await client.range(self.watch_prefix, prefix=True)
                    self.resyncs += 1
                    members.resync(snapshot.kvs)
                    if not started:
                        task_status.started()
                        started = True
                    async with client.watch(
                        self.watch_prefix, prefix=True, start_revision=snapshot.revision + 1
                    ) as events:
                        self._backoff.reset()
                        async for event in events:
                            members.apply(event)
                except EtcdCompacted as exc:
                    log.info("etcd watch on %s compacted (%s); ranging again", self.prefix, exc)
                except EtcdError as exc:
                    delay = self._backoff.next()
                    log.warning("etcd discovery: %s; retrying in %.2f s", exc, delay)
                await trio.sleep(delay)
        finally:
            if self._client is None:
                with trio.move_on_after(1, shield=True):
                    await client.aclose()


class _Members:
    """What the sink was told, by key, so that a resync reports only differences."""

    def __init__(
        self,
        sink: DiscoverySink,
        model: str | None,
        secret: bytes | None = None,
        prefix: str = KEY_PREFIX,
    ) -> None:
        self.sink = sink
        self.model = model
        self.secret = secret
        self.prefix = prefix
        self.known: dict[bytes, InstanceRecord] = {}
        self.refused = 0  # records ignored: malformed, unsigned, forged or misplaced

    def resync(self, kvs: Sequence[KeyValue]) -> None:
        fresh = {kv.key: rec for kv in kvs if (rec := self._parse(kv)) is not None}
        for key in [k for k in self.known if k not in fresh]:
            self._set(key, None)
        for key, rec in fresh.items():
            self._set(key, rec)

    def apply(self, event: WatchEvent) -> None:
        rec = self._parse(event.kv) if event.type is EventType.PUT else None
        self._set(event.kv.key, rec)

    def _parse(self, kv: KeyValue) -> InstanceRecord | None:
        try:
            rec = InstanceRecord.from_json(kv.value, self.secret)
            if rec.key(self.prefix).encode() != kv.key:  # a signed record copied elsewhere
                raise ValueError(f"stored under another key than its own, {rec.key(self.prefix)}")
        except ValueError as exc:
            self.refused += 1
            log.warning("ignoring etcd key %r: %s", kv.key, exc)
            return None
        if self.model is not None and rec.model != self.model:
            return None  # a model whose name extends ours, e.g. "m" vs "m/x"
        return rec

    def _set(self, key: bytes, rec: InstanceRecord | None) -> None:
        old = self.known.pop(key, None) if rec is None else self.known.get(key)
        if rec is None:
            if old is not None:
                self._tell(self.sink.worker_removed, old.worker_id)
            return
        self.known[key] = rec
        if old is not None and old.worker_id != rec.worker_id:
            self._tell(self.sink.worker_removed, old.worker_id)
            old = None
        draining = rec.state is InstanceState.DRAINING
        changed = old is None or replace(old, state=rec.state) != rec
        if changed or (old is not None and old.state is InstanceState.DRAINING and not draining):
            # New, moved or restarted, or back from draining: (re)announce it.
            self._tell(self.sink.worker_added, rec.instance())
            if draining:
                self._tell(self.sink.worker_draining, rec.worker_id)
        elif draining and old is not None and old.state is not InstanceState.DRAINING:
            self._tell(self.sink.worker_draining, rec.worker_id)

    @staticmethod
    def _tell(method: Any, arg: Any) -> None:
        # A sink bug must not stop discovery: every later change would be lost.
        try:
            method(arg)
        except Exception:
            log.exception("discovery sink %s(%r) failed", getattr(method, "__name__", "?"), arg)
