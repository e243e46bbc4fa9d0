"""Attack: a stranger floods a worker's plane port with connections that say nothing.

Before any secret is proved, each connection costs the worker a descriptor and a task.
Without a cap, a few hundred silent connections exhausted a worker's descriptors (at a
lowered limit, as a container may set), and a real frontend could no longer connect. A
worker now takes at most ``max_connections_per_address`` connections per peer address
and ``max_connections`` in all (by default half its descriptor limit), closing one more
as soon as it is accepted; one that has not finished the handshake within
``handshake_timeout`` is closed. Loopback only: the flood comes from 127.0.0.2, the
frontend from 127.0.0.1.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import trio

from headwater.cluster.recipes import start_worker as start_worker_process
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.server import ServerConfig
from headwater.wire import GenerateRequest, Role, SamplingParams
from headwater.wire.addresses import parse_tcp_address
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

MODEL = "deepseek-v4"
FLOODER = "127.0.0.2"  # another loopback address: the frontend's (127.0.0.1) is not its
#: Runs a command with a descriptor limit of its own (and execs it, so its pid is the
#: worker's): as a container's limit would.
FD_LIMIT = 200


def with_fd_limit(limit: int) -> list[str]:
    code = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code]


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(
        rid, MODEL, list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True)
    )


async def flood(address: str, count: int) -> list[trio.SocketStream]:
    """*count* connections from FLOODER that send nothing."""
    host, port = parse_tcp_address(address)
    return [await trio.open_tcp_stream(host, port, local_address=FLOODER) for _ in range(count)]


@pytest.mark.slow
async def test_a_flood_from_one_address_leaves_room_for_the_frontends(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    worker = await start_worker_process(
        nursery,
        "agg",
        log_dir=tmp_path,
        prefix_argv=with_fd_limit(FD_LIMIT),
        engine_args=["--speedup-ratio", "100000"],
    )
    instance = WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address)
    before = await connect_worker(instance, nursery)  # connected before the flood
    silent = await flood(worker.address, 300)  # more than the worker has descriptors
    with trio.fail_after(4.0):  # well within the 5 s handshake timeout of the flood
        after = await connect_worker(instance, nursery)
        for i, client in enumerate((before, after)):
            async with client.stream(request(f"r{i}")) as chunks:
                assert len([t async for c in chunks for t in c.token_ids]) == 4
        stats = await after.fetch_stats()
    assert int(stats["plane_connections_refused_total"]) >= 300 - 64
    assert int(stats["plane_connections"]) <= 64 + 2
    for stream in silent:
        await trio.aclose_forcefully(stream)


async def start_worker(nursery: trio.Nursery, server: ServerConfig) -> RunningWorker:
    config = WorkerConfig(
        role=Role.AGG, engine_config=MockerConfig(speedup_ratio=100_000.0), server=server
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


async def wait_for(condition: object, within: float = 3.0) -> None:
    with trio.fail_after(within):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.01)


@pytest.mark.slow
async def test_connections_beyond_the_total_are_closed_at_once(nursery: trio.Nursery) -> None:
    worker = await start_worker(
        nursery, ServerConfig(max_connections=6, max_connections_per_address=0)
    )
    silent = await flood(worker.address, 10)
    await wait_for(lambda: worker.server.statistics().connections_refused_total == 4)
    assert worker.server.statistics().connections == 6
    # The ones refused were closed by the worker: they read an end of stream at once.
    ended = 0
    for stream in silent:
        with trio.move_on_after(0.2):
            ended += await stream.receive_some(1) == b""
    assert ended == 4
    for stream in silent:
        await trio.aclose_forcefully(stream)


async def test_the_per_address_cap_counts_each_address_apart(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery, ServerConfig(max_connections_per_address=3))
    silent = await flood(worker.address, 5)
    await wait_for(lambda: worker.server.statistics().connections_refused_total == 2)
    instance = WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address)
    client = await connect_worker(instance, nursery)  # from 127.0.0.1: its own count
    async with client.stream(request("r")) as chunks:
        assert len([t async for c in chunks for t in c.token_ids]) == 4
    for stream in silent:
        await trio.aclose_forcefully(stream)


async def test_a_connection_that_never_completes_the_handshake_is_closed(
    nursery: trio.Nursery,
) -> None:
    worker = await start_worker(nursery, ServerConfig(handshake_timeout=0.3))
    (silent,) = await flood(worker.address, 1)
    start = trio.current_time()
    with trio.fail_after(2.0):
        assert await silent.receive_some(1) == b""
    assert 0.25 <= trio.current_time() - start < 2.0
    await wait_for(lambda: worker.server.statistics().connections == 0)
    await silent.aclose()
