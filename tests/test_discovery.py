"""Worker discovery: ``--workers`` parsing, the etcd client, registration, watching, membership.

Test policy: everything is on loopback. Tests marked by the ``etcd_url`` /
``private_etcd`` fixtures run a real single-member etcd (see etcd_fixture.py; skipped
without the binary, failed under CI=true); each uses its own key prefix, so they
share one server. Waits are bounded by ``trio.fail_after`` and wake on events, never
fixed sleeps; lease tests use TTL 2 s, the shortest etcd grants. Membership tests
use fake clients and virtual time (``autojump_clock``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path

import pytest
import trio

from frontend.config import FrontendConfig
from frontend.discovery import (
    Discovery,
    EtcdDiscovery,
    Membership,
    StaticDiscovery,
    discovery_from_config,
    open_membership,
    parse_workers,
    start_discovery,
)
from frontend.router import Router, WorkerState
from headwater.etcd import (
    KEY_PREFIX,
    EtcdClient,
    EtcdCompacted,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    EventType,
    InstanceRecord,
    InstanceState,
    etcd_endpoints,
    model_prefix,
    prefix_range_end,
)
from headwater.plane.base import ResponseStream, WorkerClient, WorkerInstance
from headwater.wire import GenerateRequest, KvHandle, Role
from workers.runtime.registration import EtcdRegistration

from etcd_fixture import EtcdServer

REPO = Path(__file__).resolve().parents[1]
SEEN_WITHIN = 1.0  # seconds for a registration change to reach a watcher


# -- helpers -----------------------------------------------------------------------


class RecordingSink:
    """A DiscoverySink that keeps the current view and lets a test wait on it."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerInstance] = {}
        self.draining: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self._changed = trio.Event()

    def worker_added(self, instance: WorkerInstance) -> None:
        self.workers[instance.worker_id] = instance
        self.draining.discard(instance.worker_id)
        self._record("added", instance.worker_id)

    def worker_removed(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.draining.discard(worker_id)
        self._record("removed", worker_id)

    def worker_draining(self, worker_id: str) -> None:
        self.draining.add(worker_id)
        self._record("draining", worker_id)

    def _record(self, what: str, worker_id: str) -> None:
        self.calls.append((what, worker_id))
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool], limit: float = SEEN_WITHIN) -> None:
        with trio.fail_after(limit):
            while not predicate():
                await self._changed.wait()


class FakeClient(WorkerClient):
    def __init__(self, instance: WorkerInstance) -> None:
        self.instance = instance
        self.closed = False
        self.closed_event = trio.Event()
        self.alive = False  # vouches for its connection (a TCP client's heartbeats)
        self.lost = trio.Event()
        self.silent = False  # its probes go unanswered (a host that died)

    @property
    def reachable(self) -> bool:
        return self.alive and not self.lost.is_set()

    async def wait_lost(self) -> None:
        await self.lost.wait()

    def stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[ResponseStream]:
        raise NotImplementedError

    def release_kv(self, handle: KvHandle) -> None:
        raise NotImplementedError

    async def probe(self) -> None:
        if self.silent:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.closed = True
        self.closed_event.set()


class FakeConnect:
    """A connect factory: fails the first *failures* attempts per worker, can be held."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.attempts: dict[str, int] = {}
        self.attempt_times: list[float] = []
        self.clients: list[FakeClient] = []
        self.gate: trio.Event | None = None

    async def __call__(self, instance: WorkerInstance) -> WorkerClient:
        n = self.attempts[instance.worker_id] = self.attempts.get(instance.worker_id, 0) + 1
        self.attempt_times.append(trio.current_time())
        if self.gate is not None:
            await self.gate.wait()
        if n <= self.failures:
            raise ConnectionRefusedError(f"attempt {n} refused")
        client = FakeClient(instance)
        self.clients.append(client)
        return client


async def wait_router(router: Router, predicate: Callable[[], bool], limit: float = 5.0) -> None:
    with trio.fail_after(limit):
        while not predicate():
            await router.changed.wait()


def states(router: Router) -> dict[str, WorkerState]:
    return {v.worker_id: v.state for v in router.views()}


def inst(
    worker_id: str, role: Role = Role.DECODE, model: str = "m", port: int = 7000
) -> WorkerInstance:
    return WorkerInstance(worker_id, role, model, f"tcp://127.0.0.1:{port}")


async def follow(
    nursery: trio.Nursery, discovery: Discovery, sink: RecordingSink | Membership
) -> None:
    with trio.fail_after(5):
        await nursery.start(discovery.run, sink)


# -- static --workers ------------------------------------------------------------------


def test_parse_workers_full_and_defaults() -> None:
    spec = (
        "tcp://10.0.0.5:7001?role=prefill&model=deepseek-v4&id=w1, "
        "tcp://host-b:7002?role=decode,tcp://[::1]:7003?role=agg&capacity=8,"
    )
    got = parse_workers(spec, default_model="served")
    assert [(w.worker_id, w.role, w.model, w.address, w.capacity) for w in got] == [
        ("w1", Role.PREFILL, "deepseek-v4", "tcp://10.0.0.5:7001", 256),
        ("host-b:7002", Role.DECODE, "served", "tcp://host-b:7002", 256),
        ("[::1]:7003", Role.AGG, "served", "tcp://[::1]:7003", 8),
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no worker given"),
        ("http://a:1?role=agg", "scheme must be tcp://"),
        ("tcp://a?role=agg", "missing port"),
        ("tcp://a:x?role=agg", "bad address"),
        ("tcp://a:70000?role=agg", "bad address"),
        ("tcp://:1?role=agg", "missing host"),
        ("tcp://a:1", "missing role="),
        ("tcp://a:1?role=encode", "role must be one of prefill, decode, agg"),
        ("tcp://a:1?role=agg&role=decode", "'role' given twice"),
        ("tcp://a:1?role=agg&weight=2", "unknown parameter 'weight'"),
        ("tcp://a:1?role=agg&model=", "'model' is empty"),
        ("tcp://a:1?role=agg&capacity=0", "capacity must be a positive integer"),
        ("tcp://a:1/path?role=agg", "only tcp://HOST:PORT?PARAMS"),
        ("tcp://a:1?role=agg,tcp://a:1?role=decode", "entry 2: worker id 'a:1' already used"),
    ],
)
def test_parse_workers_rejects(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="--workers") as info:
        parse_workers(spec, default_model="m")
    assert message in str(info.value)


async def test_static_discovery_reports_once() -> None:
    sink = RecordingSink()
    discovery = StaticDiscovery.from_spec(
        "tcp://127.0.0.1:1?role=prefill,tcp://127.0.0.1:2?role=decode", default_model="m"
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run, sink)
        assert sink.calls == [("added", "127.0.0.1:1"), ("added", "127.0.0.1:2")]
        await trio.testing.wait_all_tasks_blocked()
        assert len(sink.calls) == 2
        nursery.cancel_scope.cancel()


# -- records and key layout ----------------------------------------------------------------


def test_record_roundtrip_and_key_layout() -> None:
    record = InstanceRecord.from_instance(
        WorkerInstance("w/1", Role.PREFILL, "org/model", "tcp://127.0.0.1:9", capacity=4),
        pid=42,
        started_at=1.5,
    )
    assert record.key() == "headwater/v1/instances/org%2Fmodel/prefill/w%2F1"
    assert record.key().startswith(model_prefix("org/model"))
    back = InstanceRecord.from_json(record.to_json())
    assert back == record
    assert back.instance().metadata == {"pid": "42", "started_at": "1.5"}
    assert (back.instance().worker_id, back.instance().capacity) == ("w/1", 4)


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b"[]",
        b'{"worker_id": "w", "role": "x", "model": "m", "address": "a"}',
        b'{"role": "decode", "model": "m", "address": "a"}',
        b'{"worker_id": "w", "role": "decode", "model": "m", "address": "a", "state": "gone"}',
    ],
)
def test_record_rejects_malformed(value: bytes) -> None:
    with pytest.raises(ValueError, match="bad instance record"):
        InstanceRecord.from_json(value)


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"a/") == b"a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"


# -- the etcd client --------------------------------------------------------------------------


@pytest.mark.slow
async def test_client_kv_leases_and_errors(etcd_url: str, etcd_prefix: str) -> None:
    async with EtcdClient(etcd_url) as etcd:
        await etcd.put(etcd_prefix + "a", b"1")
        await etcd.put(etcd_prefix + "b", b"2")
        await etcd.put(etcd_prefix[:-1] + "X", b"outside")  # sorts after the prefix
        got = await etcd.range(etcd_prefix, prefix=True)
        assert [(kv.key, kv.value) for kv in got.kvs] == [
            ((etcd_prefix + "a").encode(), b"1"),
            ((etcd_prefix + "b").encode(), b"2"),
        ]
        assert got.revision >= max(kv.mod_revision for kv in got.kvs)
        assert await etcd.delete(etcd_prefix, prefix=True) == 2

        lease = await etcd.lease_grant(5)
        assert lease.ttl == 5
        await etcd.put(etcd_prefix + "leased", b"x", lease=lease.id)
        kv = await etcd.get(etcd_prefix + "leased")
        assert kv is not None
        assert kv.lease == lease.id
        assert await etcd.lease_keepalive(lease.id) == 5
        assert await etcd.lease_revoke(lease.id) is True
        assert await etcd.get(etcd_prefix + "leased") is None  # revoking deletes its keys
        assert await etcd.lease_keepalive(lease.id) == 0
        assert await etcd.lease_revoke(lease.id) is False
        with pytest.raises(EtcdLeaseNotFound):
            await etcd.put(etcd_prefix + "leased", b"x", lease=lease.id)


async def test_client_unreachable_is_unavailable() -> None:
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with EtcdClient(f"127.0.0.1:{port}", timeout=2) as etcd:
        with pytest.raises(EtcdUnavailable):
            await etcd.range("x")
        with pytest.raises(EtcdUnavailable):
            async with etcd.watch("x"):
                pass


@pytest.mark.slow
async def test_client_watch_and_compaction(etcd_url: str, etcd_prefix: str) -> None:
    async with EtcdClient(etcd_url) as etcd:
        first = await etcd.put(etcd_prefix + "k", b"1")
        async with etcd.watch(etcd_prefix, prefix=True) as events:
            await etcd.put(etcd_prefix + "k", b"2")
            await etcd.delete(etcd_prefix + "k")
            with trio.fail_after(SEEN_WITHIN):
                put = await events.__anext__()
                deleted = await events.__anext__()
        assert (put.type, put.kv.value) == (EventType.PUT, b"2")
        assert (deleted.type, deleted.kv.key) == (EventType.DELETE, (etcd_prefix + "k").encode())
        # History from `first` on replays the first put too.
        async with etcd.watch(etcd_prefix, prefix=True, start_revision=first) as events:
            with trio.fail_after(SEEN_WITHIN):
                replay = await events.__anext__()
        assert (replay.type, replay.kv.value) == (EventType.PUT, b"1")
        assert replay.kv.mod_revision == first
        latest = (await etcd.range("x")).revision
        await etcd.compact(latest)
        with pytest.raises(EtcdCompacted) as info:
            async with etcd.watch(etcd_prefix, prefix=True, start_revision=first) as events:
                await events.__anext__()
        assert info.value.compact_revision == latest


# -- registration + discovery against etcd ---------------------------------------------------


@pytest.mark.slow
async def test_register_seen_then_deregister_removed(etcd_url: str, etcd_prefix: str) -> None:
    sink = RecordingSink()
    worker = inst("w1", Role.PREFILL, port=7101)
    async with trio.open_nursery() as nursery:
        await follow(nursery, EtcdDiscovery(etcd_url, prefix=etcd_prefix), sink)
        assert sink.workers == {}
        registration = EtcdRegistration(etcd_url, worker, ttl=2, prefix=etcd_prefix, pid=7)
        async with registration:
            await sink.wait_for(lambda: "w1" in sink.workers)
            seen = sink.workers["w1"]
            assert (seen, seen.metadata["pid"]) == (worker, "7")
        # Leaving the block revoked the lease: removal is prompt, not a TTL later.
        await sink.wait_for(lambda: "w1" not in sink.workers)
        assert sink.calls == [("added", "w1"), ("removed", "w1")]
        async with EtcdClient(etcd_url) as etcd:
            assert await etcd.get(registration.key) is None
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_registration_context_propagates_body_error(etcd_url: str, etcd_prefix: str) -> None:
    registration = EtcdRegistration(etcd_url, inst("w1"), ttl=2, prefix=etcd_prefix)
    with pytest.raises(KeyError, match="boom"):
        async with registration:
            raise KeyError("boom")
    async with EtcdClient(etcd_url) as etcd:
        assert await etcd.get(registration.key) is None


@pytest.mark.slow
async def test_draining_reaches_router(etcd_url: str, etcd_prefix: str) -> None:
    router = Router()
    connect = FakeConnect()
    worker = inst("d1", Role.DECODE, model="m1", port=7102)
    async with open_membership(router, connect) as membership, trio.open_nursery() as nursery:
        await follow(nursery, EtcdDiscovery(etcd_url, model="m1", prefix=etcd_prefix), membership)
        async with EtcdRegistration(etcd_url, worker, ttl=2, prefix=etcd_prefix) as registration:
            await wait_router(router, lambda: states(router) == {"d1": WorkerState.HEALTHY})
            assert router.pick(Role.DECODE, "m1").instance == worker
            await registration.mark_draining()
            await wait_router(router, lambda: states(router) == {"d1": WorkerState.DRAINING})
            assert router.routable(Role.DECODE, "m1") == 0
            assert registration.record.state is InstanceState.DRAINING
        await wait_router(router, lambda: states(router) == {})
        assert len(connect.clients) == 1
        with trio.fail_after(5):
            await connect.clients[0].closed_event.wait()
        nursery.cancel_scope.cancel()


_KILLABLE_WORKER = textwrap.dedent(
    """
    import sys, trio
    from headwater.plane.base import WorkerInstance
    from headwater.wire import Role
    from workers.runtime.registration import EtcdRegistration

    async def main():
        url, prefix, wid = sys.argv[1:4]
        worker = WorkerInstance(wid, Role.DECODE, "m", "tcp://127.0.0.1:7103")
        async with EtcdRegistration(url, worker, ttl=2, prefix=prefix):
            print("registered", flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


@pytest.mark.slow
async def test_lease_expires_when_worker_is_killed(etcd_url: str, etcd_prefix: str) -> None:
    ttl = 2
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await follow(nursery, EtcdDiscovery(etcd_url, prefix=etcd_prefix), sink)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", _KILLABLE_WORKER, etcd_url, etcd_prefix, "k1"],
            stdout=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert proc.stdout is not None
            with trio.fail_after(20):
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some(64)
                    assert chunk, "worker exited before registering"
                    line += chunk
            assert line == b"registered\n"
            await sink.wait_for(lambda: "k1" in sink.workers)
        finally:
            proc.send_signal(signal.SIGKILL)  # no revoke, no goodbye
            await proc.wait()
        killed_at = trio.current_time()
        key = InstanceRecord.from_instance(sink.workers["k1"]).key(etcd_prefix)
        async with EtcdClient(etcd_url) as etcd:
            assert await etcd.get(key) is not None  # still there: only the lease can remove it
        await sink.wait_for(lambda: "k1" not in sink.workers, limit=ttl + 2.0)
        # It lived out the rest of its lease: at least TTL minus one keep-alive interval.
        assert trio.current_time() - killed_at >= ttl * 2 / 3 - 0.2
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_reregisters_after_lease_revoked_behind_its_back(
    etcd_url: str, etcd_prefix: str
) -> None:
    sink = RecordingSink()
    async with trio.open_nursery() as nursery, EtcdClient(etcd_url) as etcd:
        await follow(nursery, EtcdDiscovery(etcd_url, prefix=etcd_prefix), sink)
        async with EtcdRegistration(etcd_url, inst("r1"), ttl=2, prefix=etcd_prefix) as reg:
            await sink.wait_for(lambda: "r1" in sink.workers)
            old_lease = reg.lease_id
            assert old_lease is not None
            assert await etcd.lease_revoke(old_lease) is True
            await sink.wait_for(lambda: sink.calls.count(("removed", "r1")) == 1)
            # The next keep-alive finds the lease gone: new lease, key written again.
            await sink.wait_for(lambda: "r1" in sink.workers, limit=2.0)
            new_lease = reg.lease_id  # granted before the put the watcher just saw
            assert new_lease not in (None, old_lease)
            kv = await etcd.get(reg.key)
            assert kv is not None
            assert kv.lease == new_lease

            # A key deleted (lease still alive) is written again too, on the same lease.
            assert await etcd.delete(reg.key) == 1
            await sink.wait_for(lambda: sink.calls.count(("removed", "r1")) == 2)
            await sink.wait_for(lambda: "r1" in sink.workers, limit=2.0)
            assert reg.lease_id == new_lease
            kv = await etcd.get(reg.key)
            assert kv is not None
            assert kv.lease == new_lease
        await sink.wait_for(lambda: sink.calls.count(("removed", "r1")) == 3)
        assert sink.calls == [("added", "r1"), ("removed", "r1")] * 3
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_watch_follows_changes_made_in_etcd(etcd_url: str, etcd_prefix: str) -> None:
    sink = RecordingSink()
    a = InstanceRecord.from_instance(inst("a", model="m1", port=7201))
    moved = InstanceRecord.from_instance(inst("a", model="m1", port=7202))
    other_model = InstanceRecord.from_instance(inst("b", model="m1x", port=7203))
    async with trio.open_nursery() as nursery, EtcdClient(etcd_url) as etcd:
        await etcd.put(a.key(etcd_prefix), a.to_json())
        discovery = EtcdDiscovery(etcd_url, model="m1", prefix=etcd_prefix)
        await follow(nursery, discovery, sink)
        assert sink.calls == [("added", "a")]  # the initial range, before started()

        await etcd.put(other_model.key(etcd_prefix), other_model.to_json())
        await etcd.put(moved.key(etcd_prefix), moved.to_json())
        await sink.wait_for(lambda: sink.workers["a"].address == "tcp://127.0.0.1:7202")
        drain = InstanceRecord.from_instance(moved.instance(), state=InstanceState.DRAINING)
        await etcd.put(moved.key(etcd_prefix), drain.to_json())
        await sink.wait_for(lambda: "a" in sink.draining)
        await etcd.put(moved.key(etcd_prefix), moved.to_json())  # back to ready
        await sink.wait_for(lambda: "a" not in sink.draining)
        await etcd.put(moved.key(etcd_prefix), b"{garbage")
        await sink.wait_for(lambda: "a" not in sink.workers)
        await etcd.put(moved.key(etcd_prefix), moved.to_json())
        await sink.wait_for(lambda: "a" in sink.workers)
        await etcd.delete(moved.key(etcd_prefix))
        await sink.wait_for(lambda: "a" not in sink.workers)
        assert "b" not in {wid for _, wid in sink.calls}  # another model: never reported
        assert sink.calls == [
            ("added", "a"),
            ("added", "a"),  # moved
            ("draining", "a"),
            ("added", "a"),  # ready again
            ("removed", "a"),  # unreadable value
            ("added", "a"),
            ("removed", "a"),
        ]
        assert discovery.resyncs == 1  # all of it through one watch
        nursery.cancel_scope.cancel()


async def wait_all(sinks: list[RecordingSink], predicate: Callable[[RecordingSink], bool]) -> None:
    """Waits on each sink in turn until *predicate* holds of it."""
    for sink in sinks:
        await sink.wait_for(partial(predicate, sink))


@pytest.mark.slow
async def test_two_watchers_see_the_same_set(etcd_url: str, etcd_prefix: str) -> None:
    sinks = [RecordingSink(), RecordingSink()]
    workers = [inst(f"w{i}", role, port=7300 + i) for i, role in enumerate(Role)]
    async with trio.open_nursery() as nursery:
        for sink in sinks:
            await follow(nursery, EtcdDiscovery(etcd_url, prefix=etcd_prefix), sink)
        async with trio.open_nursery() as regs:
            registrations = [
                EtcdRegistration(etcd_url, w, ttl=2, prefix=etcd_prefix) for w in workers
            ]
            for reg in registrations:
                await regs.start(reg.run)
            await wait_all(sinks, lambda s: len(s.workers) == 3)
            assert sinks[0].workers == sinks[1].workers == {w.worker_id: w for w in workers}
            await registrations[0].deregister()
            await wait_all(sinks, lambda s: set(s.workers) == {"w1", "w2"})
            regs.cancel_scope.cancel()  # each run() revokes its lease on the way out
        await wait_all(sinks, lambda s: not s.workers)
        assert sorted(sinks[0].calls) == sorted(sinks[1].calls)
        assert {wid for _, wid in sinks[0].calls} == {"w0", "w1", "w2"}
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_discovery_and_registration_survive_etcd_wipe(
    private_etcd: EtcdServer, etcd_prefix: str
) -> None:
    sink = RecordingSink()
    url = private_etcd.url
    discovery = EtcdDiscovery(url, prefix=etcd_prefix)
    async with trio.open_nursery() as nursery, EtcdClient(url) as etcd:
        stale = InstanceRecord.from_instance(inst("stale", port=7401))
        await etcd.put(stale.key(etcd_prefix), stale.to_json())  # no lease, gone with the wipe
        await follow(nursery, discovery, sink)
        async with EtcdRegistration(url, inst("live", port=7402), ttl=2, prefix=etcd_prefix) as reg:
            await sink.wait_for(lambda: set(sink.workers) == {"stale", "live"})
            old_lease = reg.lease_id
            await trio.to_thread.run_sync(lambda: private_etcd.restart(wipe=True))
            # Discovery re-ranges the wiped store and drops the stale worker; the
            # registration's next keep-alive finds its lease unknown and registers again.
            await sink.wait_for(lambda: "stale" not in sink.workers, limit=10)
            # The wiped store's history starts at 1: this replays the registration's
            # put if it already happened, or waits for it.
            async with etcd.watch(reg.key, start_revision=1) as events:
                with trio.fail_after(5):
                    put = await events.__anext__()
            assert put.type is EventType.PUT
            assert put.kv.lease == reg.lease_id != old_lease
            await sink.wait_for(lambda: set(sink.workers) == {"live"})
            assert discovery.resyncs >= 2
        nursery.cancel_scope.cancel()


# -- membership -----------------------------------------------------------------------------


@pytest.fixture
async def membership_parts() -> AsyncIterator[tuple[Router, FakeConnect, Membership]]:
    router = Router()
    connect = FakeConnect()
    async with open_membership(router, connect, retry_initial=0.5, retry_max=4.0) as membership:
        yield router, connect, membership


async def test_membership_add_drain_remove(
    membership_parts: tuple[Router, FakeConnect, Membership],
) -> None:
    router, connect, membership = membership_parts
    membership.worker_added(inst("p", Role.PREFILL))
    membership.worker_added(inst("d", Role.DECODE))
    await wait_router(router, lambda: len(states(router)) == 2)
    assert states(router) == {"p": WorkerState.HEALTHY, "d": WorkerState.HEALTHY}
    membership.worker_draining("d")
    assert states(router)["d"] is WorkerState.DRAINING
    membership.worker_added(inst("d", Role.DECODE))  # re-announced ready
    assert states(router)["d"] is WorkerState.HEALTHY
    membership.worker_removed("p")
    assert set(states(router)) == {"d"}
    await trio.testing.wait_all_tasks_blocked()
    assert {c.instance.worker_id: c.closed for c in connect.clients} == {"p": True, "d": False}
    assert membership.statistics().connected == 1


async def test_membership_keeps_a_reachable_worker_discovery_lost(
    membership_parts: tuple[Router, FakeConnect, Membership],
) -> None:
    """Discovery going stale (a lease expired behind a partition from etcd) does not
    empty the router: a worker whose connection is alive stays routed until that
    connection is lost or discovery lists it again; a goodbye (drained first) or a
    client that cannot vouch for its connection still removes at once."""
    router, connect, membership = membership_parts
    for wid in ("w", "bye", "mute"):
        membership.worker_added(inst(wid))
    await wait_router(router, lambda: len(states(router)) == 3)
    clients = {c.instance.worker_id: c for c in connect.clients}
    w, bye = clients["w"], clients["bye"]
    w.alive = bye.alive = True  # "mute" cannot tell: the base class's answer

    membership.worker_removed("w")
    membership.worker_draining("bye")
    membership.worker_removed("bye")
    membership.worker_removed("mute")
    await trio.testing.wait_all_tasks_blocked()
    assert states(router) == {"w": WorkerState.HEALTHY}
    assert (membership.statistics().unlisted, w.closed) == (1, False)

    membership.worker_added(inst("w"))  # registered again: the same connection, listed
    await trio.testing.wait_all_tasks_blocked()
    assert membership.statistics().unlisted == 0
    w.lost.set()  # a listed worker's lost connection is the client's to retry
    await trio.testing.wait_all_tasks_blocked()
    assert (states(router), w.closed) == ({"w": WorkerState.HEALTHY}, False)

    w.lost = trio.Event()
    membership.worker_removed("w")
    await trio.testing.wait_all_tasks_blocked()
    assert "w" in states(router)
    w.lost.set()  # and an unlisted one's is the end of it
    await wait_router(router, lambda: not states(router))
    await trio.testing.wait_all_tasks_blocked()
    assert [c.closed for c in connect.clients] == [True, True, True]
    assert membership.statistics().unlisted == 0


async def test_membership_drops_an_unlisted_worker_that_does_not_answer_a_probe(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A host that died: its lease ran out before the heartbeats noticed, so its client
    still says connected. The probe membership sends an unlisted worker goes unanswered,
    and it leaves routing at the probe's deadline, not the heartbeats'."""
    router = Router()
    connect = FakeConnect()
    async with open_membership(router, connect, confirm_timeout=2.0) as membership:
        membership.worker_added(inst("dead"))
        await wait_router(router, lambda: "dead" in states(router))
        (client,) = connect.clients
        client.alive = client.silent = True
        removed_at = trio.current_time()
        membership.worker_removed("dead")
        await wait_router(router, lambda: not states(router), limit=60)
        assert trio.current_time() - removed_at == pytest.approx(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert client.closed
        assert membership.statistics().unlisted == 0


async def test_membership_retries_failed_connect(autojump_clock: trio.abc.Clock) -> None:
    router = Router()
    connect = FakeConnect(failures=3)
    async with open_membership(router, connect, retry_initial=0.5, retry_max=4.0) as membership:
        membership.worker_added(inst("w"))
        await wait_router(router, lambda: "w" in states(router), limit=60)
        assert connect.attempts == {"w": 4}
        assert membership.statistics().connect_failures_total == 3
        gaps = [b - a for a, b in itertools.pairwise(connect.attempt_times)]
        assert min(gaps) > 0.24  # backed off (at least retry_initial / 2): never a hot loop


async def test_membership_removed_or_draining_while_connecting(
    membership_parts: tuple[Router, FakeConnect, Membership],
) -> None:
    router, connect, membership = membership_parts
    connect.gate = trio.Event()
    membership.worker_added(inst("gone"))
    membership.worker_added(inst("slow"))
    await trio.testing.wait_all_tasks_blocked()
    membership.worker_removed("gone")
    membership.worker_draining("slow")
    connect.gate.set()
    await wait_router(router, lambda: "slow" in states(router))
    await trio.testing.wait_all_tasks_blocked()
    assert states(router) == {"slow": WorkerState.DRAINING}
    assert [c.instance.worker_id for c in connect.clients] == ["slow"]
    assert membership.statistics().connecting == 0


async def test_membership_replaces_moved_worker_and_closes_all_on_exit() -> None:
    router = Router()
    connect = FakeConnect()
    async with open_membership(router, connect) as membership:
        membership.worker_added(inst("w", port=1))
        await wait_router(router, lambda: "w" in states(router))
        membership.worker_added(inst("w", port=2))  # restarted elsewhere
        await wait_router(
            router, lambda: [v.address for v in router.views()] == ["tcp://127.0.0.1:2"]
        )
        membership.worker_added(inst("x", port=3))
        await wait_router(router, lambda: len(states(router)) == 2)
    assert [(c.instance.address, c.closed) for c in connect.clients] == [
        ("tcp://127.0.0.1:1", True),
        ("tcp://127.0.0.1:2", True),
        ("tcp://127.0.0.1:3", True),
    ]
    assert states(router) == {}


async def test_membership_refuses_work_after_its_block() -> None:
    async with open_membership(Router(), FakeConnect()) as membership:
        pass
    with pytest.raises(RuntimeError, match="block ended"):
        membership.worker_added(inst("w"))


# -- wiring from the frontend's configuration -------------------------------------------------


def test_etcd_endpoints() -> None:
    assert etcd_endpoints("etcd://127.0.0.1:2379") == ["http://127.0.0.1:2379"]
    assert etcd_endpoints("etcd://a:1,b:2/") == ["http://a:1", "http://b:2"]
    assert etcd_endpoints("etcds://a:1,http://b:2") == ["https://a:1", "http://b:2"]
    for bad, message in [("zk://a:1", "unknown scheme"), ("etcd://a:1/x", "expected"), ("", "no")]:
        with pytest.raises(ValueError, match=message):
            etcd_endpoints(bad)


def test_discovery_from_config() -> None:
    static = discovery_from_config(
        FrontendConfig(model_name="served", workers="tcp://127.0.0.1:1?role=agg")
    )
    assert isinstance(static, StaticDiscovery)
    assert [(w.worker_id, w.model) for w in static.instances] == [("127.0.0.1:1", "served")]
    etcd = discovery_from_config(FrontendConfig(model_name="served", discovery="etcd://h:2379"))
    assert isinstance(etcd, EtcdDiscovery)
    # Every model registered is followed: each is served (frontend/catalog.py).
    assert (etcd.endpoints, etcd.watch_prefix) == (["http://h:2379"], KEY_PREFIX)
    with pytest.raises(ValueError, match="not both"):
        discovery_from_config(FrontendConfig(workers="tcp://a:1?role=agg", discovery="etcd://h:1"))


async def test_start_discovery_feeds_the_router() -> None:
    router = Router()
    config = FrontendConfig(
        model_name="m", workers="tcp://127.0.0.1:1?role=prefill,tcp://127.0.0.1:2?role=decode"
    )
    async with trio.open_nursery() as nursery:
        membership = await start_discovery(nursery, config, router, connect=FakeConnect())
        await wait_router(router, lambda: len(states(router)) == 2)
        assert router.pick(Role.PREFILL, "m").instance.address == "tcp://127.0.0.1:1"
        assert router.pick(Role.DECODE, "m").instance.address == "tcp://127.0.0.1:2"
        assert membership.statistics().connected == 2
        nursery.cancel_scope.cancel()
