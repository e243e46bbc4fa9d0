"""What a process holds: trio tasks by name, open descriptors, threads, RSS.

Policy: in-process and deterministic; each test compares the counts against a
baseline taken in the same task a moment earlier, so the test runner's own tasks and
descriptors cancel out. Tasks are started with ``nursery.start`` (they exist once it
returns) and are gone once their nursery block has exited.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import trio

from headwater.instrumentation.runtime import (
    MAX_TASK_NAMES,
    count_tasks,
    open_fd_count,
    runtime_snapshot,
)


def _root() -> trio.lowlevel.Task:
    root = trio.lowlevel.current_root_task()
    assert root is not None
    return root


async def _parked(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await trio.sleep_forever()


async def _parent(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as inner:
        for _ in range(2):
            await inner.start(_parked, name="leaf")
        task_status.started()


async def test_every_task_is_counted_once_nested_nurseries_included() -> None:
    before = count_tasks(_root())
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            await nursery.start(_parked, name="sleeper")
        await nursery.start(_parent, name="parent")
        during = count_tasks(_root())
        nursery.cancel_scope.cancel()
    after = count_tasks(_root())
    assert during - before == {"sleeper": 3, "parent": 1, "leaf": 2}
    assert sum(during.values()) == sum(before.values()) + 6
    assert after == before  # ended tasks are not counted: a leak would stay
    assert before[_root().name] == 1  # the walk starts at trio's root task


async def test_snapshot_counts_this_process_and_sees_a_descriptor_come_and_go() -> None:
    base = runtime_snapshot()
    assert base.pid == os.getpid()
    assert base.trio_tasks == sum(base.tasks_by_name.values())
    assert base.threads >= 1
    status = Path("/proc/self/status").read_text()  # noqa: ASYNC240 - /proc never blocks
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    assert base.rss_bytes is not None
    assert abs(base.rss_bytes - rss_kb * 1024) < 16 * 2**20
    sock = socket.socket()
    try:
        held = runtime_snapshot()
    finally:
        sock.close()
    assert base.open_fds is not None
    assert held.open_fds == base.open_fds + 1
    assert runtime_snapshot().open_fds == base.open_fds
    assert open_fd_count(os.getpid()) == base.open_fds


async def test_task_names_are_capped_and_the_rest_summed() -> None:
    async with trio.open_nursery() as nursery:
        for i in range(MAX_TASK_NAMES + 5):
            await nursery.start(_parked, name=f"distinct-{i}")
        snap = runtime_snapshot()
        nursery.cancel_scope.cancel()
    assert len(snap.tasks_by_name) == MAX_TASK_NAMES + 1
    assert snap.tasks_by_name["<other>"] >= 5
    assert sum(snap.tasks_by_name.values()) == snap.trio_tasks
    assert snap.to_dict()["tasks_by_name"] == snap.tasks_by_name
