"""Multi-process clusters: real etcd, worker processes and frontends, end to end.

Test policy: everything binds 127.0.0.1 (workers and frontends on port 0; etcd on
probed free ports, see etcd_fixture.py: skipped without the binary, failed under
CI=true). Tests share one etcd server and keep apart by serving a model name of
their own, so no frontend ever sees another test's workers. The mocker runs sped
up; frontends load the HF tokenizer backend (1 s instead of 4-5 s). Processes are
started with :mod:`headwater.cluster.recipes` in the test's nursery, which kills whatever
is left when a test ends or fails. What a test verifies comes from the workers
themselves (their ``stats`` frame over the request plane), not from the frontend.
Waits poll live state with a bound (``trio.fail_after``); no fixed sleeps. The
``headwater launch`` tests run the launcher itself (cluster_fixture.py) and kill its
children from outside, as a crash would: it restarts them (same id, same ports), or
gives up on one and stops. The slow tests start ~40 processes in all; the file takes
35-60 s on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from headwater.cli import build_parser
from headwater.cli.launch import ClusterPlan, add_arguments, plan_from_args
from headwater.cluster.recipes import (
    WORKER_READY_PREFIX,
    ChildProcess,
    WorkerProcess,
    frontend_urls,
    parse_worker_ready,
    start_frontend,
    start_worker,
)
from headwater.cluster.supervisor import RestartPolicy
from headwater.etcd import EtcdClient, EventType, InstanceRecord, InstanceState, model_prefix
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.wire import GenerateRequest, Role, SamplingParams
from workers.lifecycle import READY_PREFIX, ready_line

from cluster_fixture import (
    FAST,
    FRONTEND_ARGS,
    LAUNCH_SECRET,
    Worker,
    alive,
    children_of,
    debug_workers,
    launch,
    wait_dead,
    worker_stats,
)
from etcd_fixture import require_etcd
from helpers import logged_at

# Where a test checks that a worker gets *some* traffic it must not depend on the order
# of round-robin turns: random routing, and enough requests that a worker of two
# missing all of them (2**-16) does not happen.
RANDOM_ROUTER = (*FRONTEND_ARGS, "--router", "random")
SPREAD = 16
MAX_TOKENS = 6


def new_model() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"


def discovery_of(etcd_url: str) -> str:
    return "etcd://" + etcd_url.removeprefix("http://")


async def start_workers(
    nursery: trio.Nursery,
    tmp_path: Path,
    roles: Sequence[str],
    *,
    discovery: str,
    model: str,
    first_index: int = 0,
    **options: Any,
) -> list[WorkerProcess]:
    """Start one worker per role, concurrently; in the order of *roles*."""
    started: dict[int, WorkerProcess] = {}

    async def one(i: int, role: str) -> None:
        started[i] = await start_worker(
            nursery,
            role,
            log_dir=tmp_path,
            name=f"{role}-{first_index + i}",
            discovery=discovery,
            model=model,
            engine_args=["--speedup-ratio", f"{FAST:g}"],
            **options,
        )

    async with trio.open_nursery() as starting:
        for i, role in enumerate(roles):
            starting.start_soon(one, i, role)
    return [started[i] for i in range(len(roles))]


async def routing(url: str) -> dict[str, str]:
    """worker_id → state, as the frontend's router sees it (/debug/workers)."""
    async with httpx.AsyncClient() as http:
        r = await http.get(url + "/debug/workers")
    r.raise_for_status()
    return {w["worker_id"]: w["state"] for w in r.json()}


async def wait_routing(
    url: str, predicate: Callable[[dict[str, str]], bool], within: float = 10.0
) -> dict[str, str]:
    with trio.fail_after(within):
        while not predicate(view := await routing(url)):
            await trio.sleep(0.05)
    return view


def all_healthy(workers: Sequence[WorkerProcess]) -> Callable[[dict[str, str]], bool]:
    ids = {w.worker_id for w in workers}
    return lambda view: ids <= {wid for wid, state in view.items() if state == "healthy"}


def total(stats: Mapping[str, Mapping[str, Any]], key: str, ids: Sequence[str] = ()) -> int:
    return sum(int(s[key]) for wid, s in stats.items() if not ids or wid in ids)


async def chat(url: str, model: str, *, stream: bool, tag: str = "") -> str:
    """One chat completion of exactly MAX_TOKENS tokens (``ignore_eos``); returns its
    text. Fails the test on anything but success."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me about rivers {tag}"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    async with httpx.AsyncClient(timeout=30.0) as http:
        if not stream:
            r = await http.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["choices"][0]["finish_reason"] == "length"
            assert data["usage"]["completion_tokens"] == MAX_TOKENS
            return str(data["choices"][0]["message"]["content"])
        events: list[Any] = []
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append("DONE" if data == "[DONE]" else orjson.loads(data))
        assert events[-1] == "DONE", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])


async def send(url: str, model: str, count: int, concurrency: int = 1) -> None:
    """*count* requests, alternately streaming and unary, *concurrency* at a time."""
    indices = iter(range(count))

    async def client() -> None:
        for i in indices:
            await chat(url, model, stream=i % 2 == 0, tag=str(i))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)


async def stop_all(children: Sequence[ChildProcess]) -> None:
    for child in children:
        assert await child.stop(grace=15) == 0, f"{child.name}: see {child.log_path}"


# ---- tests --------------------------------------------------------------------------


@pytest.mark.slow
async def test_every_request_goes_prefill_then_decode(
    tmp_path: Path, etcd_url: str, nursery: trio.Nursery
) -> None:
    model, discovery = new_model(), discovery_of(etcd_url)
    workers = await start_workers(
        nursery,
        tmp_path,
        ["prefill", "prefill", "decode", "decode"],
        discovery=discovery,
        model=model,
    )
    prefill, decode = [w.worker_id for w in workers[:2]], [w.worker_id for w in workers[2:]]
    frontend = await start_frontend(
        nursery, log_dir=tmp_path, discovery=discovery, model=model, extra_args=FRONTEND_ARGS
    )
    await wait_routing(frontend.address, all_healthy(workers))

    requests = 16
    await send(frontend.address, model, requests, concurrency=4)

    stats = await worker_stats(workers, model)
    assert total(stats, "served_total", prefill) == requests  # one prefill leg each
    assert total(stats, "plane_kv_pulls_served_total", prefill) == requests
    assert total(stats, "kv_pulls_total", decode) == requests  # each decode leg pulled KV
    assert total(stats, "served_total", decode) == requests
    assert total(stats, "kv_pull_failures_total", decode) == 0
    assert total(stats, "failed_total") == 0
    await stop_all([frontend, *workers])


@pytest.mark.slow
async def test_two_frontends_share_the_workers_and_both_use_a_late_joiner(
    tmp_path: Path, etcd_url: str, nursery: trio.Nursery
) -> None:
    model, discovery = new_model(), discovery_of(etcd_url)
    workers = await start_workers(
        nursery, tmp_path, ["prefill", "decode"], discovery=discovery, model=model
    )
    frontends: list[ChildProcess] = []

    async def frontend(name: str) -> None:
        frontends.append(
            await start_frontend(
                nursery,
                log_dir=tmp_path,
                name=name,
                discovery=discovery,
                model=model,
                extra_args=RANDOM_ROUTER,
            )
        )

    async with trio.open_nursery() as starting:
        starting.start_soon(frontend, "frontend-a")
        starting.start_soon(frontend, "frontend-b")
    a, b = sorted(frontends, key=lambda f: f.name)
    for fe in (a, b):
        await wait_routing(fe.address, all_healthy(workers))

    async with trio.open_nursery() as both:  # concurrent traffic through both frontends
        both.start_soon(send, a.address, model, 8, 2)
        both.start_soon(send, b.address, model, 8, 2)
    stats = await worker_stats(workers, model)
    assert total(stats, "served_total", [workers[0].worker_id]) == 16
    assert total(stats, "kv_pulls_total", [workers[1].worker_id]) == 16

    (late,) = await start_workers(
        nursery, tmp_path, ["decode"], discovery=discovery, model=model, first_index=1
    )
    for fe in (a, b):
        await wait_routing(fe.address, all_healthy([*workers, late]))
    decoders = [workers[1], late]
    before = (await worker_stats([late], model))[late.worker_id]["kv_pulls_total"]
    for fe in (a, b):
        await send(fe.address, model, SPREAD, 4)
        stats = await worker_stats(decoders, model)
        now = stats[late.worker_id]["kv_pulls_total"]
        assert now > before, f"{late.worker_id} got none of {fe.name}'s requests"
        before = now
    assert total(stats, "kv_pulls_total") == 16 + 2 * SPREAD  # each request pulled KV once
    await stop_all([a, b, *workers, late])


@pytest.mark.slow
async def test_killed_decode_worker_leaves_routing_within_the_lease_ttl(
    tmp_path: Path, etcd_url: str, nursery: trio.Nursery
) -> None:
    ttl = 2  # seconds: about the shortest lease etcd grants
    model, discovery = new_model(), discovery_of(etcd_url)
    workers = await start_workers(
        nursery,
        tmp_path,
        ["prefill", "decode", "decode"],
        discovery=discovery,
        model=model,
        lease_ttl=ttl,
    )
    prefill, survivor, victim = workers
    frontend = await start_frontend(
        nursery, log_dir=tmp_path, discovery=discovery, model=model, extra_args=RANDOM_ROUTER
    )
    await wait_routing(frontend.address, all_healthy(workers))
    await send(frontend.address, model, 2)
    base = await worker_stats([prefill, survivor], model)

    victim.kill()  # SIGKILL while idle: no drain, no deregistration
    assert await victim.wait() == -signal.SIGKILL
    killed_at = trio.current_time()
    await send(frontend.address, model, 4)  # likely still listed: routed around it
    await wait_routing(
        frontend.address, lambda view: victim.worker_id not in view, within=ttl + 3.0
    )
    assert trio.current_time() - killed_at <= ttl + 2.0  # lease TTL + expiry check + watch
    await send(frontend.address, model, 4)
    stats = await worker_stats([prefill, survivor], model)
    for key, wid in (("served_total", prefill.worker_id), ("kv_pulls_total", survivor.worker_id)):
        assert stats[wid][key] - base[wid][key] == 8

    (newcomer,) = await start_workers(
        nursery,
        tmp_path,
        ["decode"],
        discovery=discovery,
        model=model,
        lease_ttl=ttl,
        first_index=2,
    )
    await wait_routing(frontend.address, all_healthy([prefill, survivor, newcomer]))
    await send(frontend.address, model, SPREAD, 4)
    after = await worker_stats([survivor, newcomer], model)
    assert after[newcomer.worker_id]["kv_pulls_total"] > 0
    assert (
        after[survivor.worker_id]["kv_pulls_total"]
        - stats[survivor.worker_id]["kv_pulls_total"]
        + after[newcomer.worker_id]["kv_pulls_total"]
    ) == SPREAD
    await stop_all([frontend, prefill, survivor, newcomer])


@pytest.mark.slow
async def test_worker_is_draining_in_etcd_before_it_stops_and_gone_after(
    tmp_path: Path, etcd_url: str, nursery: trio.Nursery
) -> None:
    """SIGTERM with a request in flight: ``draining`` is published while it still runs;
    the key disappears only after the request finished."""
    model, discovery = new_model(), discovery_of(etcd_url)
    events: list[tuple[str, float]] = []  # (state or "deleted", when)
    watching = trio.Event()

    async def watch() -> None:
        async with EtcdClient(etcd_url) as etcd, etcd.watch(model_prefix(model), prefix=True) as w:
            watching.set()
            async for event in w:
                now = trio.current_time()
                if event.type is EventType.DELETE:
                    events.append(("deleted", now))
                    return
                events.append((InstanceRecord.from_json(event.kv.value).state.value, now))

    nursery.start_soon(watch)
    await watching.wait()
    # Mocker at 1/2 of GPU time: the request below runs for about 1.5 s, far longer
    # than an etcd write takes to reach a watcher.
    worker = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        discovery=discovery,
        model=model,
        engine_args=["--speedup-ratio", "2.0"],
    )
    async with EtcdClient(etcd_url) as etcd:
        (kv,) = (await etcd.range(model_prefix(model), prefix=True)).kvs
    record = InstanceRecord.from_json(kv.value)
    assert (record.address, record.worker_id, record.pid, record.state) == (
        worker.address,
        worker.worker_id,
        worker.pid,
        InstanceState.READY,
    )

    instance = WorkerInstance(worker.worker_id, Role.AGG, model, worker.address)
    client = await connect_worker(instance, nursery, secret=None)
    request = GenerateRequest(
        "long", model, list(range(3, 67)), SamplingParams(max_tokens=500, ignore_eos=True)
    )
    async with client.stream(request) as chunks:
        received = len((await chunks.__anext__()).token_ids)
        nursery.start_soon(worker.stop)  # SIGTERM: drain
        received += sum([len(c.token_ids) async for c in chunks])
        finished_at = trio.current_time()
    assert received == 500
    with trio.fail_after(10):
        assert await worker.wait() == 0
    await client.aclose()
    states = [state for state, _ in events]
    assert states == ["ready", "draining", "deleted"]
    assert events[1][1] < finished_at < events[2][1]


async def runtime_pid(metrics_url: str) -> int:
    """The pid a worker's metrics endpoint reports from inside its process."""
    async with httpx.AsyncClient() as http:
        r = await http.get(metrics_url.removesuffix("/metrics") + "/debug/runtime")
    r.raise_for_status()
    return int(r.json()["pid"])


@pytest.mark.parametrize("role", list(Role))
def test_launcher_reads_the_line_workers_print(role: Role) -> None:
    # What `headwater worker` prints, as the launcher and the test fixtures parse it.
    line = ready_line("tcp://[::1]:7001", f"{role.value}-0a1b2c3d", role)
    assert parse_worker_ready(line) == ("tcp://[::1]:7001", f"{role.value}-0a1b2c3d", role.value)
    assert line.startswith(WORKER_READY_PREFIX + " ")


@pytest.mark.slow
async def test_launch_serves_then_stops_in_order_on_sigint(tmp_path: Path) -> None:
    etcd = require_etcd()
    async with launch(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--etcd-binary",
        etcd,
        "--drain-timeout",
        "7",
        "--",
        "--tokenizer-backend",
        "hf",  # passed through to headwater serve
    ) as cluster:
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*", cluster.url)  # the real port
        assert set(cluster.children) == {"etcd", "prefill-0", "decode-0", "frontend"}
        assert set(cluster.children.values()) == children_of(cluster.process.pid)
        # The frontend drains as long as the workers do.
        for name in ("frontend", "decode-0"):
            cmdline = trio.Path(f"/proc/{cluster.children[name]}/cmdline")
            argv = (await cmdline.read_bytes()).split(b"\0")
            assert argv[argv.index(b"--drain-timeout") + 1] == b"7", name

        assert await chat(cluster.url, "deepseek-v4", stream=True)
        assert await chat(cluster.url, "deepseek-v4", stream=False)

        cluster.process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await cluster.process.wait() == 0
    assert not [pid for pid in cluster.children.values() if alive(pid)]
    stopped = logged_at(cluster.workdir / "frontend.log", r"SIGTERM received: draining")
    for worker in ("prefill-0", "decode-0"):
        assert logged_at(cluster.workdir / f"{worker}.log", "SIGTERM: draining") >= stopped


@pytest.mark.slow
async def test_launch_restarts_a_killed_worker_with_its_id_and_port(tmp_path: Path) -> None:
    """Static discovery: the frontend's --workers list names the worker by id and port,
    so the restart must keep both; nothing else tells the frontend about it. Restart
    delays of 1.5-3 s keep the restarted worker out of the first requests after the kill.
    With --worker-metrics each worker's metrics port is its own and survives the restart."""
    async with launch(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--discovery",
        "static",
        "--restart-backoff",
        "3",
        "--restart-backoff-max",
        "3",
        "--worker-metrics",
        "--",
        *FRONTEND_ARGS,
    ) as cluster:
        model = "deepseek-v4"
        assert set(cluster.metrics) == {"prefill-0", "decode-0", "decode-1"}
        assert len(set(cluster.metrics.values())) == 3
        for name, url in cluster.metrics.items():
            assert await runtime_pid(url) == cluster.children[name]
        view = await debug_workers(cluster.url)
        survivor, victim = (
            Worker(view[cluster.addresses[name]]["worker_id"], "decode", cluster.addresses[name])
            for name in ("decode-0", "decode-1")
        )
        before = await worker_stats([survivor], model, LAUNCH_SECRET)

        os.kill(cluster.children["decode-1"], signal.SIGKILL)
        await wait_dead(cluster.children["decode-1"])
        await send(cluster.url, model, 8, concurrency=4)  # right after the kill: all succeed
        after = await worker_stats([survivor], model, LAUNCH_SECRET)
        assert total(after, "served_total") - total(before, "served_total") == 8

        with trio.fail_after(30):
            while (pid := cluster.restarted("decode-1")) is None:
                await trio.sleep(0.05)
        assert pid != cluster.children["decode-1"]
        assert pid in children_of(cluster.process.pid)
        # Same port and id: the plane's handshake at the old address checks the id.
        with trio.fail_after(30):  # the router retries it once its inhibition is over
            while not (await worker_stats([victim], model, LAUNCH_SECRET))[victim.worker_id][
                "served_total"
            ]:
                await send(cluster.url, model, 4, concurrency=2)
        view = await debug_workers(cluster.url)
        assert view[victim.address]["worker_id"] == victim.worker_id
        assert view[victim.address]["state"] == "healthy"
        log = (cluster.workdir / "decode-1.log").read_text()
        assert re.search(
            r"^----- .* decode-1 exited \(killed by SIGKILL\): restart 1 in ", log, re.M
        )
        assert log.count(f"{READY_PREFIX} {victim.address} {victim.worker_id}") == 2
        assert await runtime_pid(cluster.metrics["decode-1"]) == pid

        cluster.process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await cluster.process.wait() == 0
    assert not [p for p in [*cluster.children.values(), pid] if alive(p)]


@pytest.mark.slow
async def test_launch_restarts_etcd_and_the_frontend_on_their_ports(tmp_path: Path) -> None:
    """Both killed at once. etcd comes back on its ports with its data: the worker's key
    and lease survive (the worker never registered again); the frontend comes back on
    its port, finds the worker in etcd and serves at the URL it had."""
    async with launch(
        tmp_path, "--agg", "1", "--etcd-binary", require_etcd(), "--", *FRONTEND_ARGS
    ) as cluster:
        etcd_url, model = cluster.addresses["etcd"], "deepseek-v4"
        async with EtcdClient(etcd_url) as etcd:
            (before,) = (await etcd.range(model_prefix(model), prefix=True)).kvs
        for name in ("etcd", "frontend"):
            os.kill(cluster.children[name], signal.SIGKILL)
        with trio.fail_after(30):
            while None in (cluster.restarted("etcd"), cluster.restarted("frontend")):
                await trio.sleep(0.05)
            while True:  # the new frontend's discovery ranges etcd, then connects
                async with httpx.AsyncClient() as http:
                    if (await http.get(cluster.url + "/health")).status_code == 200:
                        break
                await trio.sleep(0.05)
        assert await chat(cluster.url, model, stream=True)
        async with EtcdClient(etcd_url) as etcd:
            (after,) = (await etcd.range(model_prefix(model), prefix=True)).kvs
        assert (after.key, after.lease, after.create_revision) == (
            before.key,
            before.lease,
            before.create_revision,
        )
        assert (
            "registered"
            not in (cluster.workdir / "agg-0.log").read_text().split("HEADWATER_WORKER_READY")[1]
        )  # once, before its READY line; never again
        cluster.process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await cluster.process.wait() == 0


@pytest.mark.slow
async def test_launch_gives_up_on_a_process_that_keeps_failing(tmp_path: Path) -> None:
    """A killed worker whose port another process takes meanwhile: each restart exits
    at start-up (address in use) until the budget of 2 is spent; then the launcher
    names it, stops the rest and exits 1. Restart delays of 1-2 s leave the test time
    to take the port first."""
    async with launch(
        tmp_path,
        "--agg",
        "1",
        "--discovery",
        "static",
        "--restart-budget",
        "2",
        "--restart-window",
        "60",
        "--restart-backoff",
        "2",
        "--restart-backoff-max",
        "2",
        "--",
        *FRONTEND_ARGS,
    ) as cluster:
        assert set(cluster.children) == {"agg-0", "frontend"}
        port = int(cluster.addresses["agg-0"].rsplit(":", 1)[1])
        os.kill(cluster.children["agg-0"], signal.SIGKILL)
        await wait_dead(cluster.children["agg-0"])
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            with trio.fail_after(40):
                assert await cluster.process.wait() == 1
    assert not [pid for pid in cluster.children.values() if alive(pid)]
    assert (cluster.workdir / "frontend.log").exists()  # kept after a failure
    err = cluster.log.read_text()
    why = (
        "agg-0 did not come back: agg-0 exited before it was ready (exit status 2); "
        f"127.0.0.1:{port} is taken by another process"
    )
    assert len(re.findall(rf"WARNING \S+: {re.escape(why)}; restarting it in ", err)) == 1
    (failure,) = re.findall(
        rf"ERROR headwater.launch: {re.escape(why)}; giving up on it: (.*)", err
    )
    assert failure.startswith("restarted 2 times in the last 60 s, its whole budget")
    assert "the port is in use" in err.split("giving up on it")[1]  # its log's last lines
    assert "stopping: frontend, then workers, then etcd" in err


def plan(*argv: str, etcd: str = "") -> ClusterPlan:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan_from_args(parser.parse_args(["--etcd-binary", etcd or "/nonexistent", *argv]))


def test_launch_plan_counts_and_pass_through() -> None:
    assert plan().roles == ("prefill", "decode")  # no count given: one pair
    assert plan("--agg", "2").roles == ("agg", "agg")
    assert plan("--prefill", "2", "--decode", "3").roles == ("prefill",) * 2 + ("decode",) * 3
    assert plan("--", "--router", "p2c").serve_args == ("--router", "p2c")
    # Several workers of a role: the KV router, unless one is given; one pair: the default.
    assert plan("--agg", "2").serve_args == ("--router", "kv")
    assert plan("--agg", "2", "--", "--router=p2c").serve_args == ("--router=p2c",)
    assert "--router" not in plan().serve_args
    assert plan().worker_metrics is False
    assert plan("--worker-metrics").worker_metrics is True
    with pytest.raises(ValueError, match="both --prefill N and --decode N"):
        plan("--prefill", "2")
    for owned in ("--port", "--discovery=etcd://x:1", "--model-name"):
        with pytest.raises(ValueError, match="the launcher sets it"):
            plan("--", owned, "1")


def test_launch_plan_discovery() -> None:
    assert plan().discovery == "static"  # no etcd binary: static --workers
    assert plan(etcd=sys.executable).discovery == "etcd"
    assert plan(etcd=sys.executable).etcd_binary == sys.executable
    assert plan("--discovery", "etcd://10.0.0.1:2379").discovery == "etcd://10.0.0.1:2379"
    with pytest.raises(ValueError, match="etcd binary not found"):
        plan("--discovery", "etcd")


def test_launch_plan_restart_policy() -> None:
    assert plan().restart == RestartPolicy()  # the options' defaults are the policy's
    given = plan(
        "--restart-backoff",
        "1",
        "--restart-backoff-max",
        "2",
        "--restart-budget",
        "0",
        "--restart-window",
        "5",
    ).restart
    assert given == RestartPolicy(backoff=1, backoff_max=2, budget=0, window=5)
    with pytest.raises(ValueError, match="--restart-backoff-max"):
        plan("--restart-backoff", "3", "--restart-backoff-max", "1")
    text = " ".join(build_parser("launch").format_help().split())
    for option, default in (
        ("backoff", "0.5"),
        ("backoff-max", "10.0"),
        ("budget", "5"),
        ("window", "60.0"),
    ):
        assert re.search(
            rf"--restart-{option} \S+ [^[]+\[env HEADWATER_RESTART_"
            rf"{option.upper().replace('-', '_')}\] \(default: {default}\)",
            text,
        )


def test_ready_lines_parse() -> None:
    assert parse_worker_ready(f"{READY_PREFIX} tcp://127.0.0.1:7 d-1 decode") == (
        "tcp://127.0.0.1:7",
        "d-1",
        "decode",
    )
    assert parse_worker_ready("HEADWATER_WORKER_READY tcp://x:1") is None
    line = "headwater: serving m on http://127.0.0.1:8123/ http://[::1]:8123"
    assert frontend_urls(line) == ["http://127.0.0.1:8123", "http://[::1]:8123"]
    assert frontend_urls("INFO something on http://127.0.0.1:1") == []
