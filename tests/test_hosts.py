"""Several hosts, simulated: network namespaces as worker hosts, the root namespace as
the frontend's host with etcd, and a host that fails for real (docs/deployment.md,
"Several hosts, simulated").

Test policy as tests/test_partition.py's: root with ``ip`` and ``iptables`` (skipped
without, failed under CI=true), every address on this machine (the veth pairs the
fixture makes), processes in the test's nursery, waits bounded by the plane's and
etcd's own timeouts plus :data:`SLACK`, a shared plane secret (off loopback a worker
requires one). etcd listens on the root ends of the veths, so each worker host reaches
it as a remote one would.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import trio
from test_partition import (
    CLIENT_DETECTS,
    FRONTEND_ARGS,
    HEAL_BOUND,
    SLACK,
    largest_gap,
    plane_env,
    routing,
    stats_client,
    stream_chat,
    unary_chat,
    wait_routing,
)

from headwater.cluster.recipes import (
    DEFAULT_MODEL,
    WorkerProcess,
    start_frontend,
    start_worker,
    wait_healthy,
)
from headwater.etcd.client import EtcdClient
from headwater.etcd.records import model_prefix
from headwater.ports import free_port

from etcd_fixture import require_etcd
from netns_fixture import Netns

#: The workers' etcd lease: how long a powered-off host's workers stay registered.
LEASE_TTL = 3
#: A fixed port on each worker host: a host that comes back serves where it did.
WORKER_PORT = 7101
LONG = 3000  # tokens: ~20 s at GPU speed, still streaming when the host goes


async def _etcd_on(nursery: trio.Nursery, hosts: list[str], tmp_path: Path) -> str:
    """An etcd listening on loopback and on each address in *hosts*; its loopback URL."""
    binary = require_etcd()
    port, peer = free_port(), free_port()
    clients = ",".join(f"http://{h}:{port}" for h in ["127.0.0.1", *hosts])
    log = (tmp_path / "etcd.log").open("wb")
    argv = [
        binary,
        f"--data-dir={tmp_path / 'etcd-data'}",
        f"--listen-client-urls={clients}",
        f"--advertise-client-urls=http://127.0.0.1:{port}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=default=http://127.0.0.1:{peer}",
    ]
    process: trio.Process = await nursery.start(
        partial(trio.run_process, argv, stdout=log, stderr=log, check=False)
    )
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(15):
        while True:
            try:
                async with httpx.AsyncClient() as http:
                    if (await http.get(url + "/health")).status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)
    nursery.start_soon(_kill_at_exit, process, log)
    return f"{port}"


async def _kill_at_exit(process: trio.Process, log: BinaryIO) -> None:
    try:
        await trio.sleep_forever()
    finally:
        process.kill()
        log.close()


async def _worker_on(
    nursery: trio.Nursery,
    tmp_path: Path,
    host: Netns,
    name: str,
    etcd_port: str,
    env: dict[str, str],
    speedup: str,
) -> WorkerProcess:
    """A worker on *host*, at its fixed port, registered through etcd on a short lease."""
    worker = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        name=name,
        listen=f"{host.inner}:{WORKER_PORT}",
        prefix_argv=host.prefix,
        discovery=f"etcd://{host.outer}:{etcd_port}",
        lease_ttl=LEASE_TTL,
        env=env,
        engine_args=["--speedup-ratio", speedup],
    )
    assert worker.address == f"tcp://{host.inner}:{WORKER_PORT}"
    return worker


async def _registered(etcd_port: str) -> set[str]:
    async with EtcdClient(f"http://127.0.0.1:{etcd_port}") as etcd:
        kvs = (await etcd.range(model_prefix(DEFAULT_MODEL), prefix=True)).kvs
    return {kv.key.decode().rsplit("/", 1)[-1] for kv in kvs}


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_worker_host_powered_off_loses_no_request_and_comes_back(
    tmp_path: Path, make_netns: Callable[[], Netns], nursery: trio.Nursery
) -> None:
    """Two worker hosts and the frontend's host with etcd. Streams run on both when one
    host goes dark: its worker killed outright and its link down at once, no drain.
    Every stream finishes whole (the dead host's move), every new request is served,
    the frontend stops routing there within its heartbeat bound, and etcd's lease takes
    the dead workers out of the pool. Then the host comes back (the link up, a new
    worker on the same address) and serves again with no frontend restart."""
    hosts, secret = [make_netns(), make_netns()], secrets.token_hex(16)
    env = plane_env(secret)
    etcd_port = await _etcd_on(nursery, [h.outer for h in hosts], tmp_path)

    async def worker_on(host: Netns, name: str, speedup: str) -> str:
        worker = await _worker_on(nursery, tmp_path, host, name, etcd_port, env, speedup)
        workers[name] = worker.pid
        return worker.worker_id

    workers: dict[str, int] = {}
    dark, lit = hosts
    dark_id = await worker_on(dark, "dark", "1")  # GPU speed: its streams outlive the fault
    lit_id = await worker_on(lit, "lit", "100")
    frontend = await start_frontend(
        nursery,
        log_dir=tmp_path,
        discovery=f"etcd://127.0.0.1:{etcd_port}",
        extra_args=FRONTEND_ARGS,
        env=env,
    )
    url = frontend.address
    await wait_routing(
        url, lambda v: all(v.get(w, {}).get("state") == "healthy" for w in (dark_id, lit_id)), 30
    )
    assert await _registered(etcd_port) == {dark_id, lit_id}

    tokens: dict[int, int] = {}
    arrivals: list[list[float]] = [[] for _ in range(4)]
    served_meanwhile: list[float] = []
    done = trio.Event()
    lease_gone = trio.Event()
    lease_gone_after: list[float] = []

    async def watch_lease(off_at: float) -> None:
        """When etcd forgot the dead worker, timed from the power-off, whatever the
        streams meanwhile take on a busy machine."""
        while dark_id in await _registered(etcd_port):
            await trio.sleep(0.2)
        lease_gone_after.append(trio.current_time() - off_at)
        lease_gone.set()

    async def one(i: int) -> None:
        tokens[i] = await stream_chat(url, LONG, arrivals[i])

    async def traffic() -> None:
        while not done.is_set():
            served_meanwhile.append(await unary_chat(url))
            await trio.sleep(0.25)

    async with trio.open_nursery() as load:
        async with trio.open_nursery() as streams:
            for i in range(len(arrivals)):
                streams.start_soon(one, i)
            await wait_routing(url, lambda v: v[dark_id]["inflight"] == 2, within=30)
            with trio.fail_after(30):
                while not all(len(a) > 10 for a in arrivals):
                    await trio.sleep(0.05)
            # Power off: the process and the link at once, nothing said to anyone.
            off_at = trio.current_time()
            # The link first: a killed process's kernel would still say goodbye (FIN) to
            # its peers, and a powered-off host says nothing.
            await trio.run_process([*dark.prefix, "ip", "link", "set", dark.inner_dev, "down"])
            os.kill(workers["dark"], signal.SIGKILL)
            load.start_soon(watch_lease, off_at)
            load.start_soon(traffic)
            view = await wait_routing(
                url, lambda v: v.get(dark_id, {}).get("state") != "healthy", CLIENT_DETECTS + SLACK
            )
            left_routing = trio.current_time() - off_at
        # etcd forgets the dead worker once its lease runs out.
        with trio.fail_after(LEASE_TTL + SLACK + 5):
            await lease_gone.wait()
        await wait_routing(url, lambda v: dark_id not in v, SLACK)
        done.set()

    assert tokens == {i: LONG for i in range(len(arrivals))}  # whole: no request lost
    assert served_meanwhile  # and the new ones all answered (unary_chat asserts 200)
    assert left_routing <= CLIENT_DETECTS + SLACK, (left_routing, view[dark_id])
    (lease_after,) = lease_gone_after
    assert lease_after <= LEASE_TTL + SLACK + 5

    # The host comes back: its link up, a new worker where the old one listened.
    await trio.run_process([*dark.prefix, "ip", "link", "set", dark.inner_dev, "up"])
    back_id = await worker_on(dark, "dark-again", "100")
    served = 0
    with trio.fail_after(HEAL_BOUND + 10):
        while not served:
            await unary_chat(url)
            served = (await routing(url)).get(back_id, {}).get("served", 0)
            await trio.sleep(0.2)
    assert await _registered(etcd_port) == {back_id, lit_id}
    print(
        f"host off: left routing after {left_routing:.2f} s, lease gone after "
        f"{lease_after:.2f} s; {len(served_meanwhile)} requests served meanwhile"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_etcd_partitioned_from_the_workers_empties_no_routing_table(
    tmp_path: Path, make_netns: Callable[[], Netns], nursery: trio.Nursery
) -> None:
    """etcd's host (the frontend's) cut off from both worker hosts for longer than the
    lease, the plane between them untouched: the leases expire and etcd forgets both
    workers, but the frontend keeps routing to them (their connections are alive), no
    stream or request is lost; a worker killed meanwhile still leaves routing at its
    heartbeat bound; healed, the survivor registers again and stays."""
    hosts, secret = [make_netns(), make_netns()], secrets.token_hex(16)
    env = plane_env(secret)
    etcd_port = await _etcd_on(nursery, [h.outer for h in hosts], tmp_path)
    kept = await _worker_on(nursery, tmp_path, hosts[0], "kept", etcd_port, env, "1")
    doomed = await _worker_on(nursery, tmp_path, hosts[1], "doomed", etcd_port, env, "100")
    frontend = await start_frontend(
        nursery,
        log_dir=tmp_path,
        discovery=f"etcd://127.0.0.1:{etcd_port}",
        extra_args=FRONTEND_ARGS,
        env=env,
    )
    url, ids = frontend.address, (kept.worker_id, doomed.worker_id)
    await wait_routing(url, lambda v: all(v.get(w, {}).get("state") == "healthy" for w in ids), 30)

    tokens: list[int] = []
    arrivals: list[float] = []

    async def one() -> None:
        tokens.append(await stream_chat(url, LONG, arrivals))

    async with trio.open_nursery() as streams:
        streams.start_soon(one)
        with trio.fail_after(30):
            while len(arrivals) < 10:
                await trio.sleep(0.05)
        for host in hosts:  # etcd's port only: the plane still flows
            await host.partition(port=int(etcd_port))
        cut_at = trio.current_time()
        with trio.fail_after(LEASE_TTL + SLACK + 5):
            while await _registered(etcd_port):
                await trio.sleep(0.2)
        forgotten = trio.current_time() - cut_at
        # Discovery says nobody; the plane says both: both stay routed and serve.
        before = await routing(url)
        for _ in range(8):
            await unary_chat(url)
        view = await routing(url)
        assert {w: view[w]["state"] for w in ids} == {w: "healthy" for w in ids}
        assert all(view[w]["served"] > before[w]["served"] for w in ids), (before, view)
        # A worker that dies while unlisted still goes, at its connection's bound.
        died_at = trio.current_time()
        os.kill(doomed.pid, signal.SIGKILL)
        await wait_routing(url, lambda v: doomed.worker_id not in v, CLIENT_DETECTS + SLACK)
        dropped = trio.current_time() - died_at
        for host in hosts:
            await host.heal()
        healed_at = trio.current_time()
        with trio.fail_after(30):
            while await _registered(etcd_port) != {kept.worker_id}:
                await trio.sleep(0.2)
        registered_again = trio.current_time() - healed_at
    assert tokens == [LONG]  # the stream on the kept worker ran through it all, whole
    await unary_chat(url)
    assert set(await routing(url)) == {kept.worker_id}
    log = (tmp_path / "frontend.log").read_text()
    assert f"worker {kept.worker_id} is listed by discovery again" in log
    print(
        f"etcd partition: etcd forgot both workers after {forgotten:.2f} s, both still "
        f"served; a worker killed meanwhile left routing after {dropped:.2f} s; "
        f"registered again {registered_again:.2f} s after the heal"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_frontends_on_two_hosts_one_killed_the_other_unaffected(
    tmp_path: Path, make_netns: Callable[[], Netns], nursery: trio.Nursery
) -> None:
    """Two frontend hosts (namespaces) in front of the same two workers and etcd (the
    root namespace's host). Both serve; one frontend is killed outright mid-stream: the
    other's streams finish whole without a pause, its new requests are all served, and
    the workers free the dead frontend's requests."""
    hosts, secret = [make_netns(), make_netns()], secrets.token_hex(16)
    env = plane_env(secret)
    etcd_port = await _etcd_on(nursery, [h.outer for h in hosts], tmp_path)
    for host in hosts[1:]:  # the second host reaches the first's address through ours
        await trio.run_process([*host.prefix, "ip", "route", "add", "default", "via", host.outer])
    workers = [
        await start_worker(
            nursery,
            "agg",
            log_dir=tmp_path,
            name=f"worker-{i}",
            listen=f"{hosts[0].outer}:0",
            discovery=f"etcd://127.0.0.1:{etcd_port}",
            env=env,
            engine_args=["--speedup-ratio", "1"],
        )
        for i in range(2)
    ]
    frontends = [
        await start_frontend(
            nursery,
            log_dir=tmp_path,
            name=f"frontend-{i}",
            host=host.inner,
            prefix_argv=host.prefix,
            discovery=f"etcd://{host.outer}:{etcd_port}",
            extra_args=FRONTEND_ARGS,
            env=env,
        )
        for i, host in enumerate(hosts)
    ]
    for frontend in frontends:
        await wait_healthy(frontend.address, within=30, child=frontend)
        await wait_routing(frontend.address, lambda v: len(v) == 2, 30)
    doomed, survivor = (f.address for f in frontends)
    clients = [await stats_client(nursery, w, secret) for w in workers]

    async def inflight() -> int:
        return sum([int((await c.fetch_stats())["inflight"]) for c in clients])

    tokens: list[int] = []
    arrivals: list[list[float]] = [[], []]
    served_after: list[float] = []

    async def orphan() -> None:  # its frontend dies under it
        with suppress(httpx.HTTPError):
            await stream_chat(doomed, LONG, [])

    async def kept(i: int) -> None:
        tokens.append(await stream_chat(survivor, LONG, arrivals[i]))

    async with trio.open_nursery() as streams:
        for i in range(2):
            streams.start_soon(orphan)
            streams.start_soon(kept, i)
        with trio.fail_after(30):
            while not (all(len(a) > 10 for a in arrivals) and await inflight() == 4):
                await trio.sleep(0.05)
        killed_at = trio.current_time()
        os.kill(frontends[0].pid, signal.SIGKILL)
        with trio.fail_after(SLACK):
            while await inflight() != 2:  # the dead frontend's two, cancelled
                await trio.sleep(0.1)
        freed = trio.current_time() - killed_at
        for _ in range(4):
            served_after.append(await unary_chat(survivor))
    assert tokens == [LONG, LONG]
    gaps = [largest_gap(a) for a in arrivals]
    assert all(end - start < 2.0 for start, end in gaps), gaps  # no pause at the kill
    assert await inflight() == 0
    stats = [await c.fetch_stats() for c in clients]
    assert sum(int(s["cancelled_total"]) for s in stats) == 2
    view = await routing(survivor)
    assert {v["state"] for v in view.values()} == {"healthy"}
    for c in clients:
        await c.aclose()
    print(
        f"two frontends: one killed, its requests freed on the workers after {freed:.2f} s; "
        f"the other's streams whole, widest gap {max(e - s for s, e in gaps):.2f} s"
    )
