"""``headwater serve --processes N``: several frontend processes behind one port.

Real processes on loopback (the supervisor binds port 0; each child also opens a
private port 0). The supervisor loads the HF tokenizer backend (about 1 s instead of
4-5 s) before it forks the zygote, and the children, forked from it, run their own
in-process mocker workers, sped up. Processes are started with
:mod:`headwater.cluster.recipes` in the test's nursery, which kills whatever is left when a
test ends or fails. Waits are bounded with ``trio.fail_after``; no fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from frontend.choices import Backend
from frontend.config import FrontendConfig
from headwater.cluster.frontend_group import child_argv, preload
from headwater.cluster.recipes import (
    FrontendMember,
    FrontendProcess,
    frontend_urls,
    member_line,
    parse_member_line,
    spawn_frontend,
    wait_healthy,
)

ARGS = (
    "--port",
    "0",
    "--tokenizer-backend",
    "hf",
    "--speedup-ratio",
    "100",
    "--log-level",
    "warning",
)
CHAT = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_member_lines_round_trip() -> None:
    line = member_line(1, 4242, "http://127.0.0.1:39001")
    assert parse_member_line(line) == FrontendMember(1, 4242, "http://127.0.0.1:39001")
    assert parse_member_line("headwater: process x pid 1 at http://a") is None
    assert parse_member_line("headwater: serving m on http://127.0.0.1:1") is None
    serving = "headwater: serving m on http://127.0.0.1:8000 http://127.0.0.1:39001/"
    assert frontend_urls(serving) == ["http://127.0.0.1:8000", "http://127.0.0.1:39001"]
    assert frontend_urls(line) == []


def test_a_child_is_the_same_command_with_the_shared_socket() -> None:
    argv = child_argv(["--port", "9000", "--processes", "4", "--router", "p2c"], fd=7)
    assert argv[:4] == [sys.executable, "-m", "headwater", "serve"]
    # argparse keeps the last value: the child serves alone, on fd 7, same router
    assert argv[-4:] == ["--processes", "1", "--listen-fd", "7"]
    assert argv[4:-4] == ["--port", "9000", "--processes", "4", "--router", "p2c"]
    grouped = child_argv(["--router", "p2c"], fd=7, group_url="http://127.0.0.1:9")
    assert grouped[-2:] == ["--group-url", "http://127.0.0.1:9"]


@pytest.mark.slow  # ~10 s: the tokenizer loaded twice
def test_the_shared_tokenizer_is_loaded_with_the_groups_options() -> None:
    # The zygote's tokenizer is every process's: it must carry --tokenizer-cache-mb.
    config = FrontendConfig(tokenizer_backend=Backend.FASTOKENS, tokenizer_cache_mb=0)
    assert preload(config).segment_cache_statistics() is None
    cached = preload(replace(config, tokenizer_cache_mb=1)).segment_cache_statistics()
    assert cached is not None
    assert cached.max_bytes == 1 << 20


async def start(nursery: trio.Nursery, tmp_path: Path, *extra: str) -> FrontendProcess:
    argv = [sys.executable, "-m", "headwater", "serve", *ARGS, *extra]
    return await spawn_frontend(
        nursery, argv, name="frontend", log_path=tmp_path / "frontend.log", ready_within=90
    )


async def requests_served(url: str, http: httpx.AsyncClient) -> float:
    return await sample(url, http, "headwater_frontend_requests_total", status="success")


async def sample(url: str, http: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The sum of *name*'s samples with *labels* on ``url/metrics``."""
    r = await http.get(url + "/metrics")
    assert r.status_code == 200, r.text
    return sum(
        s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def chat(http: httpx.AsyncClient, url: str, n: int = 1) -> None:
    for _ in range(n):
        r = await http.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_processes_share_the_port_and_stop_together(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    frontend = await start(nursery, tmp_path, "--processes", "2")
    members = frontend.members
    assert [m.index for m in members] == [0, 1]
    assert len({m.pid for m in members}) == 2
    assert frontend.pid not in {m.pid for m in members}
    assert len({m.url for m in members} | {frontend.address}) == 3
    await wait_healthy(frontend.address, within=60, child=frontend)

    n = 12
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(n):  # a new connection each: each goes to whichever process accepts
            async with httpx.AsyncClient(timeout=30) as fresh:
                r = await fresh.post(frontend.address + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
        for m in members:  # every process serves on its own port too
            r = await http.post(m.url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        served = [await requests_served(m.url, http) for m in members]
    assert sum(served) == n + len(members)  # every request counted by exactly one process
    assert all(s >= 1 for s in served)

    with trio.fail_after(30):
        assert await frontend.stop(grace=25, sig=signal.SIGTERM) == 0
    assert not any(alive(m.pid) for m in members)


@pytest.mark.slow
async def test_keep_alive_clients_are_shared_between_the_processes(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # The kernel hands a connection to whichever process accepts first: 4 clients came
    # out 3:1 or 4:0 most of the time. The processes take turns (balance.py): 2:2.
    frontend = await start(nursery, tmp_path, "--processes", "2")
    await wait_healthy(frontend.address, within=60, child=frontend)
    clients = [
        httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) for _ in range(4)
    ]
    try:
        for http in clients:  # one after the other: each connection is held when the next comes
            await chat(http, frontend.address)
        for http in clients:
            await chat(http, frontend.address, n=3)
        async with httpx.AsyncClient(timeout=30) as probe:
            served = [await requests_served(m.url, probe) for m in frontend.members]
    finally:
        for http in clients:
            await http.aclose()
    assert served == [8, 8]  # two connections of four requests each, per process


@pytest.mark.slow
async def test_a_lost_process_is_restarted_while_the_others_serve(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    frontend = await start(nursery, tmp_path, "--processes", "2", "--restart-backoff", "1")
    victim, other = frontend.members
    await wait_healthy(frontend.address, within=60, child=frontend)
    os.kill(victim.pid, signal.SIGKILL)
    # The shared port keeps answering: the other process takes every connection.
    for _ in range(6):
        async with httpx.AsyncClient(timeout=30) as fresh:
            r = await fresh.post(frontend.address + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
    log = trio.Path(tmp_path / "frontend.log")
    with trio.fail_after(90):  # restarted: a new member line, its new pid and private URL
        while not (
            back := [
                m
                for line in (await log.read_text()).splitlines()
                if (m := parse_member_line(line))
                and m.index == victim.index
                and m.pid != victim.pid
            ]
        ):
            await trio.sleep(0.2)
    assert alive(other.pid)
    assert frontend.returncode is None
    async with httpx.AsyncClient(timeout=30) as http:
        await wait_healthy(back[0].url, within=60)
        r = await http.post(back[0].url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
    assert "frontend process 0 exited (killed by SIGKILL); restarting it" in await log.read_text()
    with trio.fail_after(60):
        assert await frontend.stop(grace=50, sig=signal.SIGTERM) == 0
    assert not alive(back[0].pid)
    assert not alive(other.pid)


@pytest.mark.slow
async def test_a_process_out_of_restarts_takes_the_frontend_down(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    frontend = await start(nursery, tmp_path, "--processes", "2", "--restart-budget", "0")
    victim, other = frontend.members
    os.kill(victim.pid, signal.SIGKILL)
    with trio.fail_after(60):
        assert await frontend.wait() == 1
    assert not alive(other.pid)
    assert "giving up on it" in frontend.log_tail()
    assert "stopping the other frontend processes" in frontend.log_tail()


@pytest.mark.slow
async def test_processes_stop_when_the_supervisor_is_killed(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    frontend = await start(nursery, tmp_path, "--processes", "2")
    frontend.kill()  # SIGKILL: the supervisor cannot stop its children itself
    await frontend.wait()
    with trio.fail_after(30):
        while any(alive(m.pid) for m in frontend.members):
            await trio.sleep(0.2)


@pytest.mark.slow
async def test_children_that_cannot_start_fail_the_supervisor(tmp_path: Path) -> None:
    # A tokenizer.json that is there (the start-up check passes) but cannot be loaded.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    argv = [
        sys.executable,
        "-m",
        "headwater",
        "serve",
        *ARGS,
        "--processes",
        "2",
        "--tokenizer",
        str(broken),
    ]
    with trio.fail_after(60):
        proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 1
    assert b"headwater: serving" not in proc.stdout
    assert b"broken" in proc.stderr


@pytest.mark.slow
async def test_the_shared_port_shows_the_group_and_keeps_counting_across_a_restart(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    frontend = await start(nursery, tmp_path, "--processes", "2", "--restart-backoff", "0.2")
    first, second = frontend.members
    await wait_healthy(frontend.address, within=60, child=frontend)
    # Forked by one zygote, the supervisor's child, which runs a single thread.
    zygote = parent(first.pid)
    assert parent(second.pid) == zygote
    assert parent(zygote) == frontend.pid
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1
    ok = "headwater_frontend_requests_total"
    durations = "headwater_frontend_request_duration_seconds_count"
    async with httpx.AsyncClient(timeout=30) as http:
        # Each private port reaches one process: 3 requests on one, 2 on the other.
        await chat(http, first.url, 3)
        await chat(http, second.url, 2)
        assert await sample(first.url, http, ok, status="success") == 3
        assert await sample(frontend.address, http, ok, status="success") == 5
        assert await sample(frontend.address, http, durations) == 5  # a histogram, merged
        assert await sample(frontend.address, http, "headwater_frontend_group_processes_up") == 2

        # The group's dashboard: every process, and the memory of the whole group.
        data = (await http.get(frontend.address + "/dashboard/data")).json()
        assert data["group"] == {"processes": 2, "up": 2}
        assert [p["finished"] for p in data["processes"]] == [3, 2]
        assert len(data["loop"]["processes"]) == 2
        roles = {m["role"]: m for m in data["memory"]}
        assert set(roles) == {"supervisor", "zygote", "process 0", "process 1"}
        for m in roles.values():  # the tokenizer's pages are shared: PSS well under RSS
            assert m["uss_mb"] < m["pss_mb"] < 0.8 * m["rss_mb"]
        own = (await http.get(first.url + "/dashboard/data")).json()
        assert "group" not in own
        assert [m["role"] for m in own["memory"]] == ["frontend"]

        # Process 0 dies; its counts stay in the group's total, and its restart adds its own.
        os.kill(first.pid, signal.SIGKILL)
        log = trio.Path(tmp_path / "frontend.log")
        with trio.fail_after(60):
            while not (
                back := [
                    m
                    for line in (await log.read_text()).splitlines()
                    if (m := parse_member_line(line)) and m.index == 0 and m.pid != first.pid
                ]
            ):
                await trio.sleep(0.1)
        restarted = back[0]
        assert parent(restarted.pid) == zygote  # forked again from the same zygote
        await wait_healthy(restarted.url, within=60)
        assert await sample(restarted.url, http, ok, status="success") == 0
        assert await sample(frontend.address, http, ok, status="success") == 5
        await chat(http, restarted.url)
        assert await sample(frontend.address, http, ok, status="success") == 6
        assert await sample(frontend.address, http, durations) == 6
        assert await sample(frontend.address, http, "headwater_frontend_group_restarts_total") == 1
    with trio.fail_after(60):
        assert await frontend.stop(grace=50, sig=signal.SIGTERM) == 0
    assert not alive(zygote)
    assert not alive(second.pid)


@pytest.mark.slow
async def test_a_groups_keys_file_rotates_on_every_process_and_on_the_shared_view(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """With keys from a followed file only, the shared port's group pages (relayed to the
    supervisor, which asks every process with the client's key) work with the file's key,
    and with the next one once the file changes; the old one then gets 401 everywhere."""
    keys = tmp_path / "keys"
    keys.write_text("k-old\n")
    frontend = await start(
        nursery, tmp_path, "--processes", "2", "--api-keys-file", str(keys), "--metrics-auth"
    )
    await wait_healthy(frontend.address, within=60, child=frontend)
    up = "headwater_frontend_group_processes_up"

    async def group_up(key: str) -> float | None:
        auth = {"Authorization": f"Bearer {key}"}
        r = await http.get(frontend.address + "/metrics", headers=auth)
        if r.status_code != 200:
            return None
        return sum(
            s.value
            for f in text_string_to_metric_families(r.text)
            for s in f.samples
            if s.name == up
        )

    async with httpx.AsyncClient(timeout=30) as http:
        assert await group_up("k-old") == 2  # both processes answered the supervisor
        assert await group_up("k-new") is None
        keys.write_text("k-new\n")
        with trio.fail_after(20):  # each process and the supervisor poll every 2 s
            while await group_up("k-new") != 2 or await group_up("k-old") is not None:
                await trio.sleep(0.2)
        r = await http.get(
            frontend.address + "/dashboard/data", headers={"Authorization": "Bearer k-new"}
        )
        assert r.status_code == 200
        assert r.json()["group"] == {"processes": 2, "up": 2}
