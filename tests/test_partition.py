"""Network partitions: a worker or a frontend that vanishes without closing its connections.

Test policy: every address is on this machine — loopback, or the two ends of a veth
pair to a network namespace the test makes itself (``netns_fixture.py``: skipped
unless root with ``ip`` and ``iptables``, failed under CI=true; everything it made is
removed when the test ends). A partition is iptables inside that namespace dropping
every packet on its veth, both ways: nothing is reset and nothing is refused, so only
timeouts can notice (heartbeats, a write that blocks). Processes are started with
:mod:`headwater.cluster.recipes` in the test's nursery, so they are gone before their
namespace is. Off loopback a worker requires the plane secret, so every worker and
frontend here shares one. Waits poll live state with a bound; the bounds are derived
from the plane's own timeouts (client: a ping every 5 s and a break after 10 s without
a pong; worker: a break after 15 s without a byte) plus :data:`SLACK` for a loaded
machine. Each test takes 20-50 s, most of it waiting for a heartbeat to time out.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from frontend.router.health import HealthConfig
from headwater.cluster.children import child_env
from headwater.cluster.recipes import (
    DEFAULT_MODEL,
    ChildProcess,
    WorkerProcess,
    start_frontend,
    start_worker,
    wait_healthy,
)
from headwater.plane.base import WorkerInstance
from headwater.plane.client import TcpWorkerClient, connect_worker
from headwater.plane.connection import PlaneConfig
from headwater.plane.server import ServerConfig
from headwater.wire import Role

from helpers import logged_at
from netns_fixture import Netns, require_netns

log = logging.getLogger(__name__)


PLANE, SERVER = PlaneConfig(), ServerConfig()
#: Longest a frontend takes to notice a silent worker: the next ping is due at most
#: one interval after the partition, and breaks the connection unanswered.
CLIENT_DETECTS = PLANE.heartbeat_interval + PLANE.heartbeat_timeout
#: Longest a worker takes to notice a silent frontend.
WORKER_DETECTS = SERVER.heartbeat_timeout
SLACK = 5.0  # s: process scheduling on a shared 2-core machine
#: The frontend probes an inhibited worker at most this far apart (its default is 30 s).
PROBE_BACKOFF_MAX = 4.0
FRONTEND_ARGS = (
    "--tokenizer-backend",
    "hf",
    "--log-level",
    "info",
    "--probe-backoff-max",
    f"{PROBE_BACKOFF_MAX:g}",
)
#: A request still streaming when the partition comes: ~170 tokens/s at GPU speed,
#: so about 20 s on the worker it starts on, longer than any detection here.
LONG = 3000
SHORT = 4
#: Seconds the partition lasts after the streams moved: a few of the frontend's
#: reconnect attempts (each bounded by connect_timeout) time out meanwhile.
HOLD = 10.0
#: From the heal until the partitioned worker serves again: its client's next connect
#: attempt (after at most one backoff period), the router's next probe of it (at most
#: PROBE_BACKOFF_MAX after the last one) and the probes in a row that let it back.
_HEALTH = HealthConfig(probe_backoff_max=PROBE_BACKOFF_MAX)
HEAL_BOUND = (
    PLANE.connect_timeout
    + PLANE.backoff_max
    + _HEALTH.probe_backoff_max
    + _HEALTH.recover_after * _HEALTH.probe_interval
    + SLACK
)


def plane_env(secret: str) -> dict[str, str]:
    return child_env({"HEADWATER_PLANE_SECRET": secret})


async def stream_chat(url: str, max_tokens: int, arrivals: list[float]) -> int:
    """One streamed chat completion; records when each content event arrived and returns
    ``usage.completion_tokens``. Fails the test on an error event or a cut stream."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Tell me about rivers"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[Any] = []
    async with (
        httpx.AsyncClient(timeout=60.0) as http,
        http.stream("POST", url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append("DONE" if data == "[DONE]" else orjson.loads(data))
            if events[-1] != "DONE" and events[-1].get("choices"):
                arrivals.append(trio.current_time())
    assert events[-1] == "DONE", events[-3:]
    assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), events[-3:]
    finishes = [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])]
    assert finishes[-1] == "length"
    return int(events[-2]["usage"]["completion_tokens"])


async def unary_chat(url: str, max_tokens: int = SHORT) -> float:
    """One unary chat completion that must succeed; returns how long it took."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "And about lakes"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    start = trio.current_time()
    async with httpx.AsyncClient(timeout=60.0) as http:
        r = await http.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return trio.current_time() - start


async def routing(url: str) -> dict[str, dict[str, Any]]:
    """worker_id → the router's view of it (state, inflight, served, ...): /debug/workers."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        r = await http.get(url + "/debug/workers")
    r.raise_for_status()
    return {w["worker_id"]: w for w in r.json()}


async def wait_routing(
    url: str, predicate: Callable[[dict[str, dict[str, Any]]], bool], within: float
) -> dict[str, dict[str, Any]]:
    with trio.fail_after(within):
        while not predicate(view := await routing(url)):
            await trio.sleep(0.1)
    return view


async def stats_client(
    nursery: trio.Nursery, worker: WorkerProcess, secret: str
) -> TcpWorkerClient:
    """The test's own plane connection to *worker*, for its counters."""
    instance = WorkerInstance(worker.worker_id, Role(worker.role), DEFAULT_MODEL, worker.address)
    return await connect_worker(instance, nursery, secret=secret.encode(), client_id="test")


def largest_gap(arrivals: Sequence[float]) -> tuple[float, float]:
    """(start, end) of the longest wait between two events of a stream."""
    return max(itertools.pairwise(arrivals), key=lambda p: p[1] - p[0])


async def stop_all(children: Sequence[ChildProcess]) -> None:
    for child in children:
        assert await child.stop(grace=15) == 0, f"{child.name}: see {child.log_path}"


def counters(stats: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: stats[k] for k in keys}


# ---- a worker behind a partition -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_streams_leave_a_partitioned_worker_and_it_comes_back(
    tmp_path: Path, make_netns: Callable[[], Netns], nursery: trio.Nursery
) -> None:
    """Two aggregated workers, one in a namespace: partition it with streams in flight
    there. They continue on the other worker, whole; new requests are served there
    meanwhile; after the heal the partitioned worker takes requests again."""
    ns, secret = make_netns(), secrets.token_hex(16)
    env = plane_env(secret)
    # The far worker at GPU speed (its streams are still running when the partition
    # comes), the near one 100x faster (what migrates there finishes at once).
    far = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        name="far",
        listen=f"{ns.inner}:0",
        prefix_argv=ns.prefix,
        env=env,
        engine_args=["--speedup-ratio", "1"],
    )
    near = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        name="near",
        env=env,
        engine_args=["--speedup-ratio", "100"],
    )
    assert far.address.startswith(f"tcp://{ns.inner}:")
    frontend = await start_frontend(
        nursery,
        log_dir=tmp_path,
        workers=f"{far.static_url()},{near.static_url()}",
        extra_args=FRONTEND_ARGS,
        env=env,
    )
    url, fid, nid = frontend.address, far.worker_id, near.worker_id
    await wait_routing(
        url,
        lambda v: all(v.get(w, {}).get("state") == "healthy" for w in (fid, nid)),
        within=30,
    )

    arrivals: list[list[float]] = [[] for _ in range(4)]
    tokens: dict[int, int] = {}
    latencies: list[float] = []  # of the requests sent during the partition
    stop_traffic = trio.Event()

    async def one(i: int) -> None:
        tokens[i] = await stream_chat(url, LONG, arrivals[i])

    async def traffic() -> None:
        while not stop_traffic.is_set():
            latencies.append(await unary_chat(url))
            await trio.sleep(0.25)

    async with trio.open_nursery() as during:
        async with trio.open_nursery() as streams:
            for i in range(len(arrivals)):  # round-robin: two of them on each worker
                streams.start_soon(one, i)
            await wait_routing(url, lambda v: v[fid]["inflight"] == 2, within=30)
            with trio.fail_after(30):
                while not all(len(a) > 10 for a in arrivals):  # every one is streaming
                    await trio.sleep(0.05)
            before = await routing(url)
            partitioned_at, partitioned_wall = trio.current_time(), datetime.now()
            await ns.partition()
            during.start_soon(traffic)
        # Stay partitioned a while longer: the frontend's reconnects time out, the
        # router keeps the far worker out, the requests keep coming.
        await trio.sleep(HOLD)
        stop_traffic.set()
    at_heal = await routing(url)

    assert tokens == {i: LONG for i in range(len(arrivals))}  # whole, no client-visible error
    gaps, stall = [largest_gap(a) for a in arrivals], PLANE.heartbeat_timeout / 2
    # A stream that stalled for half a heartbeat timeout was on the far worker.
    moved = [end - partitioned_at for start, end in gaps if end - start > stall]
    assert len(moved) == 2, gaps  # the far worker's two streams stalled, then moved
    assert max(moved) <= CLIENT_DETECTS + SLACK, moved
    # Every request sent meanwhile was served, by the near worker; one that was routed to
    # the far worker first waited out its ACK timeout or a connect attempt.
    assert at_heal[fid]["served"] == before[fid]["served"]
    assert at_heal[nid]["served"] >= before[nid]["served"] + len(latencies)
    assert max(latencies) <= max(PLANE.ack_timeout, PLANE.connect_timeout) + SLACK, latencies
    log.info(
        "partition: streams moved %s s after it; %d requests meanwhile, slowest %.2f s; "
        "the far worker at the heal: %s",
        [round(m, 2) for m in moved],
        len(latencies),
        max(latencies),
        at_heal[fid],
    )

    healed_at, healed_wall = trio.current_time(), datetime.now()
    await ns.heal()
    # Requests until the far worker serves one. Its client reconnects within one
    # connect attempt and one backoff period; the router routes to it again once its
    # probes are answered (the next one at most PROBE_BACKOFF_MAX away).
    served, probes = at_heal[fid]["served"], 0
    with trio.fail_after(HEAL_BOUND):
        while (await routing(url))[fid]["served"] == served:
            await unary_chat(url)
            probes += 1
            await trio.sleep(0.2)
    back_after = trio.current_time() - healed_at
    assert frontend.log_path is not None
    reconnected = logged_at(frontend.log_path, f"reconnected to {fid} ")
    reconnect_after = (reconnected - healed_wall).total_seconds()
    assert reconnect_after <= PLANE.connect_timeout + PLANE.backoff_max + SLACK
    log.info(
        "heal: the frontend reconnected %.2f s after it; the far worker served again "
        "%.2f s after it (%d probes)",
        reconnect_after,
        back_after,
        probes,
    )

    # The far worker let go too: it dropped the frontend's connection and cancelled the
    # two streams (their KV freed) instead of generating into the void. Streaming at GPU
    # speed its writes fill the socket and block, so here the write timeout beats the
    # heartbeat timeout to it (the next test has a worker with little to write).
    client = await stats_client(nursery, far, secret)
    stats = await client.fetch_stats()
    await client.aclose()
    assert counters(stats, "cancelled_total", "inflight", "engine_kv_blocks_used") == {
        "cancelled_total": 2,
        "inflight": 0,
        "engine_kv_blocks_used": 0,
    }
    dropped = counters(stats, "plane_peer_timeouts_total", "plane_write_timeouts_total")
    assert sum(dropped.values()) == 1, dropped
    assert far.log_path is not None
    let_go = logged_at(far.log_path, "stopped reading for|nothing from")
    log.info(
        "partition: the far worker dropped the frontend's connection %.2f s after it (%s)",
        (let_go - partitioned_wall).total_seconds(),
        dropped,
    )
    await stop_all([frontend, far, near])


# ---- a frontend behind a partition -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_worker_frees_the_requests_of_a_frontend_that_vanished(
    tmp_path: Path, make_netns: Callable[[], Netns], nursery: trio.Nursery
) -> None:
    """A frontend in a namespace streams from a worker outside it; partition the
    frontend: the worker drops its connection within its heartbeat timeout, cancels
    the requests and frees their KV."""
    ns, secret = make_netns(), secrets.token_hex(16)
    env = plane_env(secret)
    # The mocker at 1/50 of GPU speed: a token every ~0.3 s per stream, so its writes
    # never fill the socket buffers and only the silence can give the frontend away.
    worker = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        listen=f"{ns.outer}:0",
        env=env,
        engine_args=["--speedup-ratio", "0.02"],
    )
    frontend = await start_frontend(
        nursery,
        log_dir=tmp_path,
        host=ns.inner,
        prefix_argv=ns.prefix,
        workers=worker.static_url(),
        extra_args=FRONTEND_ARGS,
        env=env,
    )
    await wait_healthy(frontend.address, within=30, child=frontend)
    # Ours reaches the worker's address from the root namespace: never over the veth.
    client = await stats_client(nursery, worker, secret)

    arrivals: list[list[float]] = [[], []]
    async with trio.open_nursery() as streams:
        for a in arrivals:
            streams.start_soon(stream_chat, frontend.address, LONG, a)
        with trio.fail_after(30):
            while not all(arrivals):  # both are streaming
                await trio.sleep(0.05)
        stats = await client.fetch_stats()
        assert stats["inflight"] == 2
        assert int(stats["engine_kv_blocks_used"]) > 0
        assert stats["plane_connections"] == 2  # the frontend's and ours
        partitioned_at = trio.current_time()
        await ns.partition()
        with trio.fail_after(WORKER_DETECTS + SLACK):
            while (stats := await client.fetch_stats())["plane_peer_timeouts_total"] == 0:
                await trio.sleep(0.1)
        detected = trio.current_time() - partitioned_at
        streams.cancel_scope.cancel()  # their frontend is unreachable: nothing will come

    log.info("partition: the worker dropped the silent frontend %.2f s after it", detected)
    # The last byte from the frontend (a ping) came at most one interval before.
    assert WORKER_DETECTS - PLANE.heartbeat_interval - 1 <= detected, detected
    with trio.fail_after(5):
        while (stats := await client.fetch_stats())["inflight"]:
            await trio.sleep(0.1)
    assert counters(
        stats,
        "inflight",
        "engine_kv_blocks_used",
        "cancelled_total",
        "plane_connections",
        "plane_peer_timeouts_total",
        "plane_write_timeouts_total",
    ) == {
        "inflight": 0,
        "engine_kv_blocks_used": 0,
        "cancelled_total": 2,
        "plane_connections": 1,
        "plane_peer_timeouts_total": 1,
        "plane_write_timeouts_total": 0,
    }
    await client.aclose()
    await ns.heal()
    await stop_all([frontend, worker])


# ---- the fixture's own contract ----------------------------------------------------------


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_root_partition_tests_skip_or_fail_under_ci(
    monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="need root"):
        require_netns()
