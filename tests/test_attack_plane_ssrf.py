"""Attack: a KV handle that sends a decode worker anywhere (SSRF).

A decode request carries the prefill worker's KV handle, whose address the decode
worker dials to pull the KV. Whoever can send it a request could put any address there
and have the decode worker connect to it, from where it sits. A decode worker now pulls
only from the prefill workers it knows: those registered in etcd (signed records), those
in ``--kv-peers``, and, with neither (a one-host cluster), loopback ones. Here the
"internal service" is a listener of the test's on loopback, and the worker is told
its peers, so it must not dial the service. Nothing leaves loopback.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio

from headwater.etcd.client import EtcdClient
from headwater.etcd.records import InstanceRecord
from headwater.plane.base import WorkerError, WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.kv import KvPeers
from headwater.wire import ErrorCode, GenerateRequest, KvHandle, Role, SamplingParams
from headwater.wire.addresses import format_tcp_address
from workers.engines.mocker import MockerConfig
from workers.lifecycle import WorkerConfig, serve_worker
from workers.runtime.registration import follow_prefill_workers

from etcd_fixture import EtcdServer

MODEL = "deepseek-v4"
SECRET = b"ssrf-test-secret-a41c09be7d23"


def handle(address: str, worker_id: str = "p1") -> KvHandle:
    return KvHandle(worker_id, address, "t-1", 37)


async def internal_service(nursery: trio.Nursery) -> tuple[str, list[object]]:
    """A loopback listener standing for a service the decode worker can reach; returns
    its address and the connections it got."""
    connections: list[object] = []

    async def accept(stream: trio.SocketStream) -> None:
        connections.append(stream)
        async with stream:
            await stream.receive_some(65536)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(partial(trio.serve_listeners, accept, listeners))
    return format_tcp_address("127.0.0.1", listeners[0].socket.getsockname()[1]), connections


async def test_a_decode_worker_does_not_dial_an_address_no_prefill_worker_has(
    nursery: trio.Nursery,
) -> None:
    service, connections = await internal_service(nursery)
    config = WorkerConfig(
        role=Role.DECODE,
        engine_config=MockerConfig(speedup_ratio=100_000.0),
        secret=SECRET,
        kv_peers=("tcp://127.0.0.1:1",),  # its one known prefill worker
    )
    worker = await nursery.start(partial(serve_worker, config))
    instance = WorkerInstance(worker.worker_id, Role.DECODE, MODEL, worker.address)
    client = await connect_worker(instance, nursery, secret=SECRET)
    request = GenerateRequest(
        "r1", MODEL, list(range(3, 40)), SamplingParams(max_tokens=4), kv_handle=handle(service)
    )
    with pytest.raises(WorkerError) as failed:
        async with client.stream(request) as chunks:
            [c async for c in chunks]
    assert failed.value.code is ErrorCode.KV_TRANSFER_FAILED
    assert "not a known prefill worker" in failed.value.message
    await trio.sleep(0.1)  # a dial, had there been one, would have landed by now
    assert connections == []
    assert worker.kv_transfer.peers.refused_total == 1


def test_the_peers_a_decode_worker_knows() -> None:
    peers = KvPeers(("tcp://10.0.0.7:7001",))
    peers.check(handle("tcp://10.0.0.7:7001"))  # listed
    with pytest.raises(WorkerError):
        peers.check(handle("tcp://127.0.0.1:2379"))  # loopback is not, once peers are known
    peers.register("p2", "tcp://10.0.0.8:7001")
    peers.check(handle("tcp://10.0.0.8:7001", "p2"))
    with pytest.raises(WorkerError):
        peers.check(handle("tcp://10.0.0.8:7001", "p3"))  # the address under another id
    peers.unregister("p2")
    with pytest.raises(WorkerError):
        peers.check(handle("tcp://10.0.0.8:7001", "p2"))
    one_host = KvPeers(loopback=True)
    one_host.check(handle("tcp://127.0.0.1:7001"))
    with pytest.raises(WorkerError):
        one_host.check(handle("tcp://10.0.0.7:7001"))
    assert one_host.refused_total == 1


@pytest.mark.slow
async def test_the_prefill_workers_registered_in_etcd_are_the_peers(
    private_etcd: EtcdServer, nursery: trio.Nursery
) -> None:
    peers = KvPeers()
    genuine = InstanceRecord("p1", Role.PREFILL, MODEL, "tcp://127.0.0.1:7001", 256)
    fake = InstanceRecord("p2", Role.PREFILL, MODEL, "tcp://127.0.0.1:2379", 256)
    async with EtcdClient(private_etcd.url) as etcd:
        await etcd.put(genuine.key(), genuine.to_json(SECRET))
        await nursery.start(
            partial(follow_prefill_workers, private_etcd.url, MODEL, peers, secret=SECRET)
        )
        peers.check(handle(genuine.address, "p1"))
        await etcd.put(fake.key(), fake.to_json())  # unsigned: a fake registrant
        later = InstanceRecord("p3", Role.PREFILL, MODEL, "tcp://127.0.0.1:7003", 256)
        await etcd.put(later.key(), later.to_json(SECRET))
        with trio.fail_after(5):
            while True:
                try:
                    peers.check(handle(later.address, "p3"))
                    break
                except WorkerError:
                    await trio.sleep(0.01)
        with pytest.raises(WorkerError):
            peers.check(handle(fake.address, "p2"))
        await etcd.delete(genuine.key())
        with trio.fail_after(5):
            while True:
                try:
                    peers.check(handle(genuine.address, "p1"))
                    await trio.sleep(0.01)
                except WorkerError:
                    break
