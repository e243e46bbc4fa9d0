"""No process outlives its supervisor: headwater.orphans, the guard etcd runs under,
and a ``headwater launch`` killed outright (SIGKILL) whose whole tree then stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from headwater.orphans import SUPERVISOR_ENV, supervisor_pid, terminate_when_orphaned

from cluster_fixture import FRONTEND_ARGS, alive, children_of, launch
from etcd_fixture import require_etcd


def descendants(pid: int) -> set[int]:
    """Every process below *pid*."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


async def wait_all_dead(pids: set[int], within: float) -> None:
    with trio.fail_after(within):
        while any(alive(pid) for pid in pids):
            await trio.sleep(0.1)


def test_the_supervisor_is_read_from_the_environment() -> None:
    assert supervisor_pid({SUPERVISOR_ENV: "1234"}) == 1234
    assert supervisor_pid({}) is None
    assert supervisor_pid({SUPERVISOR_ENV: "not a pid"}) is None


async def test_a_child_whose_supervisor_is_gone_signals_itself(autojump_clock: object) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        # Our parent is alive: polled, never signalled, until shutdown.
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(terminate_when_orphaned, os.getppid(), shutdown)
            await trio.sleep(30)
            shutdown.set()
        with trio.move_on_after(1) as waited:
            await signals.__anext__()
        assert waited.cancelled_caught
        # A supervisor that is not our parent (any more): SIGTERM, as from a person.
        with trio.fail_after(5):
            await terminate_when_orphaned(os.getppid() + 1_000_000)
            assert await signals.__anext__() == signal.SIGTERM


GUARDED = """
import os, subprocess, sys
env = {**os.environ, "HEADWATER_SUPERVISOR_PID": str(os.getpid())}
guard = subprocess.Popen([sys.executable, "-m", "headwater.cluster.guard", "sleep", "120"],
                         env=env)
print(guard.pid, flush=True)
guard.wait()
"""


def wait_until(condition: Callable[[], object], within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_guard_stops_its_program_when_the_supervisor_is_killed() -> None:
    with subprocess.Popen([sys.executable, "-c", GUARDED], stdout=subprocess.PIPE) as supervisor:
        try:
            assert supervisor.stdout is not None
            guard = int(supervisor.stdout.readline())
            wait_until(lambda: children_of(guard), within=10)
            program = children_of(guard)
            supervisor.kill()
            supervisor.wait()
            # The guard polls once a second, then sends SIGTERM.
            wait_until(lambda: not any(alive(pid) for pid in {guard, *program}), within=10)
        finally:
            supervisor.kill()


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ("exit 3", 3),
        ("kill -TERM $$", -signal.SIGTERM),
        ("kill -KILL $$", -signal.SIGKILL),
    ],
)
@pytest.mark.slow
def test_the_guard_exits_as_its_program_did(script: str, status: int) -> None:
    guard = [sys.executable, "-m", "headwater.cluster.guard", "sh", "-c", script]
    assert subprocess.run(guard, timeout=30).returncode == status


@pytest.mark.slow
def test_the_guard_passes_a_stop_on_and_names_a_missing_program() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "headwater.cluster.guard", "sleep", "60"]
    ) as guard:
        try:
            wait_until(lambda: children_of(guard.pid), within=10)
            guard.send_signal(signal.SIGTERM)
            assert guard.wait(timeout=10) == -signal.SIGTERM  # sleep died of it; so did the guard
        finally:
            guard.kill()
    missing = subprocess.run(
        [sys.executable, "-m", "headwater.cluster.guard", "/no/such"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 127
    assert "cannot run /no/such" in missing.stderr


@pytest.mark.slow
async def test_a_launch_killed_outright_leaves_no_process_behind(tmp_path: Path) -> None:
    """etcd (under its guard), a prefill and a decode worker, a frontend group of two
    processes (its supervisor, the zygote, the forked processes): all stop once the
    launcher is SIGKILLed, the workers and frontends by draining."""
    async with launch(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--etcd-binary",
        require_etcd(),
        "--",
        *FRONTEND_ARGS,
        "--processes",
        "2",
    ) as cluster:
        tree = descendants(cluster.process.pid)
        assert len(tree) >= 8  # guard, etcd, 2 workers, group supervisor, zygote, 2 processes
        cluster.process.kill()
        await cluster.process.wait()
        await wait_all_dead(tree, within=45)
    for name in ("prefill-0", "decode-0"):
        log = (cluster.workdir / f"{name}.log").read_text()
        assert "is gone: shutting down" in log, name
        assert "SIGTERM: draining" in log, name
    assert "is gone: shutting down" in (cluster.workdir / "frontend.log").read_text()
    assert "is gone: stopping" in (cluster.workdir / "etcd.log").read_text()


VLLM_PROCESS = """
import subprocess, sys
# As vLLM starts its engine core: the launcher imported again as __mp_main__, here in a
# group of its own as the worker starts vLLM (start_new_session).
child = subprocess.Popen([sys.executable, "-c", "import runpy, time; runpy.run_module("
                          "'workers.engines.vllm.launcher', run_name='__mp_main__'); "
                          "time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.slow
def test_a_process_vllm_started_stops_once_the_api_server_is_gone() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", VLLM_PROCESS],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    ) as api_server:
        try:
            assert api_server.stdout is not None
            engine_core = int(api_server.stdout.readline())
            time.sleep(0.5)  # imported, watching
            assert alive(engine_core)
            api_server.kill()  # outright: nobody stops the group for it
            api_server.wait()
            wait_until(lambda: not alive(engine_core), within=15)
        finally:
            api_server.kill()
