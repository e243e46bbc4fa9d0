"""``headwater serve --processes N``: several frontend processes behind one port.

Real processes on loopback (the supervisor binds port 0; each child also opens a
private port 0). Children load the HF tokenizer backend (about 1 s instead of 4-5 s)
and run their own in-process mocker workers, sped up. Processes are started with
:mod:`headwater.cluster.recipes` in the test's nursery, which kills whatever is left when a
test ends or fails. Waits are bounded with ``trio.fail_after``; no fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from headwater.cluster.frontend_group import child_argv
from headwater.cluster.recipes import (
    FrontendMember,
    FrontendProcess,
    frontend_urls,
    member_line,
    parse_member_line,
    spawn_frontend,
    wait_healthy,
)

ARGS = ("--port", "0", "--tokenizer-backend", "hf", "--speedup-ratio", "100",
        "--log-level", "warning")  # fmt: skip
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


async def start(nursery: trio.Nursery, tmp_path: Path, *extra: str) -> FrontendProcess:
    argv = [sys.executable, "-m", "headwater", "serve", *ARGS, *extra]
    return await spawn_frontend(
        nursery, argv, name="frontend", log_path=tmp_path / "frontend.log", ready_within=90
    )


async def requests_served(url: str, http: httpx.AsyncClient) -> float:
    text = (await http.get(url + "/metrics")).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "headwater_frontend_requests_total" and s.labels.get("status") == "success"
    )


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
        while not (back := [m for line in (await log.read_text()).splitlines()
                            if (m := parse_member_line(line)) and m.index == victim.index
                            and m.pid != victim.pid]):  # fmt: skip
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


async def test_children_that_cannot_start_fail_the_supervisor(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "headwater", "serve", *ARGS, "--processes", "2",
            "--tokenizer", str(tmp_path / "missing")]  # fmt: skip
    with trio.fail_after(60):
        proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 1
    assert b"headwater: serving" not in proc.stdout
    assert b"missing" in proc.stderr
