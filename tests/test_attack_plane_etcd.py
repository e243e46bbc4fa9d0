"""Attack: a fake registrant in etcd.

Frontends route to whatever workers etcd lists, so anyone who could write to etcd could
add a worker of their own (and receive prompts) or point a real worker's key at their
address. Two fixes, tested here:

* a worker's record is signed with the plane secret, and a frontend with the secret
  routes only to records signed with it and stored under their own key (the discovery
  layer, with an in-memory store: no etcd needed);
* etcd itself can require a user and password (and TLS client certificates): the
  client authenticates, and an unauthenticated writer is refused (a real etcd with auth
  enabled; skipped without the etcd binary, failed under CI).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import httpx
import pytest
import trio

from frontend.discovery.etcd import EtcdDiscovery, _Members
from headwater.etcd.client import (
    EtcdClient,
    EtcdCredentials,
    EtcdError,
    EventType,
    KeyValue,
    WatchEvent,
)
from headwater.etcd.records import KEY_PREFIX, InstanceRecord
from headwater.plane.base import WorkerInstance
from headwater.wire import Role
from headwater.wire.handshake import PlaneSecret
from workers.runtime.registration import EtcdRegistration

from etcd_fixture import EtcdServer

MODEL = "deepseek-v4"
SECRET = b"etcd-test-secret-5d0e8c2a71f3"
ATTACKER = "tcp://203.0.113.66:7001"  # never dialled: the tests only read records


@dataclass
class Sink:
    """A discovery sink that records what it was told."""

    added: list[WorkerInstance] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)

    def worker_added(self, instance: WorkerInstance) -> None:
        self.added.append(instance)

    def worker_removed(self, worker_id: str) -> None:
        self.removed.append(worker_id)

    def worker_draining(self, worker_id: str) -> None:
        self.draining.append(worker_id)


def record(worker_id: str = "w1", address: str = "tcp://127.0.0.1:7001") -> InstanceRecord:
    return InstanceRecord(worker_id, Role.AGG, MODEL, address, 256)


def put(key: str, value: bytes, revision: int = 1) -> WatchEvent:
    return WatchEvent(EventType.PUT, KeyValue(key.encode(), value, revision, revision, 1, 0))


def members(secret: bytes | None = SECRET) -> tuple[_Members, Sink]:
    sink = Sink()
    return _Members(sink, MODEL, secret), sink


def test_a_signed_record_is_routed_to() -> None:
    m, sink = members()
    genuine = record()
    m.apply(put(genuine.key(), genuine.to_json(SECRET)))
    assert [i.address for i in sink.added] == [genuine.address]
    assert m.refused == 0


@pytest.mark.parametrize(
    "forged",
    [
        pytest.param(record("evil", ATTACKER).to_json(), id="unsigned-new-worker"),
        pytest.param(record("w1", ATTACKER).to_json(), id="unsigned-replacement"),
        pytest.param(record("evil", ATTACKER).to_json(b"a-guess-at-the-secret!"), id="wrong-key"),
        pytest.param(
            record().to_json(SECRET).replace(b"127.0.0.1:7001", b"203.0.113.66:7001"),
            id="address-altered-after-signing",
        ),
    ],
)
def test_a_fake_registrant_is_never_routed_to(forged: bytes) -> None:
    m, sink = members()
    genuine = record()
    m.apply(put(genuine.key(), genuine.to_json(SECRET)))
    key = InstanceRecord.from_json(forged).key()
    m.apply(put(key, forged, 2))
    assert ATTACKER not in [i.address for i in sink.added]
    assert m.refused == 1


def test_a_signed_record_copied_under_another_key_is_refused() -> None:
    """A writer without the secret can still copy a genuine record: to another key it
    does not count (the key must be the one its fields name)."""
    m, sink = members()
    genuine = record()
    m.apply(put(f"{KEY_PREFIX}{MODEL}/agg/evil", genuine.to_json(SECRET)))
    assert sink.added == []
    assert m.refused == 1


def test_records_signed_with_an_earlier_secret_count_during_a_rotation() -> None:
    rotated = PlaneSecret(b"the-new-secret-after-rotation", [SECRET])
    m, sink = members(rotated)
    old = record("w-old")
    m.apply(put(old.key(), old.to_json(SECRET)))  # a worker not yet restarted
    assert [i.worker_id for i in sink.added] == ["w-old"]


def test_without_a_secret_records_are_unsigned_as_before() -> None:
    m, sink = members(secret=None)
    plain = record()
    m.apply(put(plain.key(), plain.to_json()))
    assert len(sink.added) == 1


def test_a_registration_with_the_secret_writes_a_signed_record() -> None:
    instance = WorkerInstance("w1", Role.AGG, MODEL, "tcp://127.0.0.1:7001")
    registration = EtcdRegistration("http://127.0.0.1:1", instance, secret=SECRET)
    stored = registration._value()
    assert InstanceRecord.from_json(stored, SECRET) == registration.record
    with pytest.raises(ValueError, match="bad signature"):
        InstanceRecord.from_json(stored, b"another-secret-entirely")


def test_credentials_come_in_pairs_and_never_show(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("USERNAME", "PASSWORD", "PASSWORD_FILE", "CA_FILE", "CERT_FILE", "KEY_FILE"):
        monkeypatch.delenv(f"HEADWATER_ETCD_{name}", raising=False)
    assert EtcdCredentials.load() is None
    with pytest.raises(ValueError, match="username and a password"):
        EtcdCredentials.load(username="root")
    monkeypatch.setenv("HEADWATER_ETCD_PASSWORD", "pw-from-env")
    credentials = EtcdCredentials.load(username="root")
    assert credentials == EtcdCredentials("root", "pw-from-env")
    assert "pw-from-env" not in repr(credentials)


# ---- a real etcd with auth enabled ------------------------------------------------------------


async def enable_auth(url: str, password: str) -> None:
    """etcd's ``user add root``, ``user grant-role root root``, ``auth enable``."""
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
        for path, body in [
            ("/v3/auth/user/add", {"name": "root", "password": password}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ]:
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text


@pytest.mark.slow
async def test_etcd_with_auth_refuses_a_writer_without_credentials_and_serves_one_with(
    private_etcd: EtcdServer,
) -> None:
    password = "etcd-root-password-31f9"
    await enable_auth(private_etcd.url, password)
    credentials = EtcdCredentials("root", password)
    key = f"{KEY_PREFIX}{MODEL}/agg/evil"
    async with EtcdClient(private_etcd.url, credentials=EtcdCredentials()) as stranger:
        with pytest.raises(EtcdError):
            await stranger.put(key, record("evil", ATTACKER).to_json())
    async with EtcdClient(private_etcd.url, credentials=credentials) as etcd:
        genuine = record()
        await etcd.put(genuine.key(), genuine.to_json(SECRET))
        sink = Sink()
        discovery = EtcdDiscovery(private_etcd.url, MODEL, secret=SECRET, credentials=credentials)
        async with trio.open_nursery() as nursery:
            with trio.fail_after(5):
                await nursery.start(discovery.run, sink)
            assert [i.worker_id for i in sink.added] == ["w1"]
            # A watch with the same token sees a change too.
            moved = replace(genuine, address="tcp://127.0.0.1:7002")
            await etcd.put(moved.key(), moved.to_json(SECRET))
            with trio.fail_after(5):
                while len(sink.added) < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert sink.added[-1].address == "tcp://127.0.0.1:7002"
