"""The parts of vLLM in-process that run without vLLM: the asyncio thread, the shapes of
its logprobs, and the plugin that stops an orphaned engine core.

The whole, against a real vLLM: tests/test_vllm_in_process.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from headwater.wire import TokenLogprobs
from workers.engines.vllm.asyncio_thread import AsyncioThread, open_asyncio_thread
from workers.engines.vllm.in_process import _prompt_logprobs, _token_logprobs
from workers.engines.vllm.plugin import HOST_ENV
from workers.engines.vllm.protocol import read_prompt_logprobs, read_token_logprobs


async def test_a_coroutine_runs_on_the_asyncio_loop_and_its_result_comes_back() -> None:
    async with open_asyncio_thread("test-loop") as thread:

        async def where() -> tuple[bool, str]:
            await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            return loop is thread.loop, trio_thread()

        on_loop, name = await thread.run(where)
        assert on_loop
        assert name == "test-loop"
        assert await thread.call(lambda: 6 * 7) == 42


def trio_thread() -> str:
    import threading

    return threading.current_thread().name


async def test_an_exception_on_the_loop_is_raised_here() -> None:
    async with open_asyncio_thread("test-loop") as thread:

        async def fail() -> None:
            raise ValueError("on the loop")

        with pytest.raises(ValueError, match="on the loop"):
            await thread.run(fail)


async def test_cancelled_from_trio_the_task_is_cancelled_and_its_cleanup_done_first() -> None:
    cleaned = []
    async with open_asyncio_thread("test-loop") as thread:

        async def wait_forever() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # cleanup that takes a while (vLLM's abort)
                cleaned.append("done")
                raise

        with trio.move_on_after(0.2) as scope:
            await thread.run(wait_forever)
        assert scope.cancelled_caught
        assert cleaned == ["done"]  # before run() returned, not some time later
        # The loop goes on serving.
        assert await thread.call(lambda: "still here") == "still here"


async def test_the_thread_stops_with_the_block_and_its_tasks_are_cancelled() -> None:
    ended: list[str] = []
    async with open_asyncio_thread("test-loop") as thread:
        runner: AsyncioThread = thread

        async def lingering() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                ended.append("cancelled")

        def spawn() -> None:
            thread.loop.create_task(lingering())

        await thread.call(spawn)
    assert runner.loop.is_closed()
    assert ended == ["cancelled"]


async def test_a_stream_comes_in_order_and_what_is_ready_together_in_one_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wake_ups = []
    run_sync_soon = trio.lowlevel.TrioToken.run_sync_soon

    def counted(self: trio.lowlevel.TrioToken, *args: Any, **kwargs: Any) -> None:
        wake_ups.append(threading.current_thread().name)
        run_sync_soon(self, *args, **kwargs)

    monkeypatch.setattr(trio.lowlevel.TrioToken, "run_sync_soon", counted)

    async def burst() -> AsyncGenerator[int, None]:
        for i in range(100):  # no await between them: all ready at once
            yield i
        await asyncio.sleep(0.05)
        yield 100

    async with open_asyncio_thread("test-loop") as thread:
        wake_ups.clear()
        async with aclosing(thread.stream(burst)) as items:
            got = [i async for i in items]
    assert got == list(range(101))
    # The burst crossed in one or two wake-ups (the first item's may leave before the
    # rest is in), the last item in another, the end with it or in one more: not 101.
    loop_wake_ups = [w for w in wake_ups if w == "test-loop"]
    assert 2 <= len(loop_wake_ups) <= 4


async def test_a_stream_raises_its_error_here_after_its_items() -> None:
    async def failing() -> AsyncGenerator[str, None]:
        yield "a"
        yield "b"
        raise ValueError("on the loop")

    got = []

    async def consume(thread: AsyncioThread) -> None:
        async with aclosing(thread.stream(failing)) as items:
            async for item in items:
                got.append(item)

    async with open_asyncio_thread("test-loop") as thread:
        with pytest.raises(ValueError, match="on the loop"):
            await consume(thread)
    assert got == ["a", "b"]


@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_stream_left_early_is_closed_on_the_loop_before_the_close_returns(
    how: str,
) -> None:
    closed = []

    async def endless() -> AsyncGenerator[int, None]:
        try:
            i = 0
            while True:
                yield i
                i += 1
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes a while (vLLM's abort)
            closed.append(asyncio.get_running_loop() is thread.loop)

    async with open_asyncio_thread("test-loop") as thread:
        if how == "closed":
            async with aclosing(thread.stream(endless)) as items:
                async for i in items:
                    if i == 3:
                        break
        else:
            with trio.move_on_after(0.1) as scope:
                async with aclosing(thread.stream(endless)) as items:
                    async for _ in items:
                        pass
            assert scope.cancelled_caught
        assert closed == [True]  # on the loop, before the close returned
        assert await thread.call(lambda: "still here") == "still here"


@dataclass
class _Logprob:  # vLLM's Logprob, as far as it is read
    logprob: float
    rank: int | None


def test_token_logprobs_read_as_the_token_in_api_writes_them() -> None:
    # vLLM's order: the sampled token first when it is not among the top ones, then
    # the top ones by rank; -inf clamped; a position vLLM has no entry for.
    positions = [
        {7: _Logprob(-0.1, 1), 9: _Logprob(-2.5, 2), 4: _Logprob(-3.0, 3)},
        {5: _Logprob(-4.0, 7), 7: _Logprob(-0.5, 1), 9: _Logprob(-math.inf, 2)},
        None,
    ]
    raw = {"content": _token_logprobs([7, 5, 3], positions, 2)}
    assert read_token_logprobs(raw, [7, 5, 3], 2) == (
        TokenLogprobs(-0.1, 1, (7, 9), (-0.1, -2.5)),
        # Ranked below the two asked: out of its own top list, which is one short.
        TokenLogprobs(-4.0, 7, (7,), (-0.5,)),
        TokenLogprobs(-9999.0, 0, (), ()),
    )


def test_prompt_logprobs_read_as_the_token_in_api_writes_them() -> None:
    positions = [
        None,
        {11: _Logprob(-1.5, 4), 2: _Logprob(-0.2, 1), 8: _Logprob(-math.inf, 2)},
    ]
    assert read_prompt_logprobs(_prompt_logprobs(positions), 2) == (
        TokenLogprobs(-1.5, 4, (2, 8), (-0.2, -9999.0)),
    )


CORE = """
import time
from workers.engines.vllm import plugin
plugin.POLL_S = 0.1
plugin.register()
print("watching" if plugin._watching else "not watching", flush=True)
time.sleep(60)
"""

#: A "worker": names itself in HOST_ENV (or not, with argv[2] "no"), as the in-process
#: backend does before vLLM starts its engine core, and starts a "core".
WORKER = """
import os, subprocess, sys, time
if sys.argv[2] == "yes":
    os.environ[sys.argv[3]] = str(os.getpid())
core = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(core.pid, core.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("named", [True, False])
def test_an_engine_core_whose_worker_is_killed_stops_itself(named: bool) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, CORE, "yes" if named else "no", HOST_ENV],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != HOST_ENV},
    )
    try:
        assert worker.stdout is not None
        pid, state = worker.stdout.readline().split(" ", 1)
        core = int(pid)
        assert state.strip() == ("watching" if named else "not watching")
        # Watching, it leads a session (a scheduling group) of its own.
        assert (os.getsid(core) == core) is named
    finally:
        worker.kill()  # SIGKILL: the worker cannot stop its core itself
        worker.wait(10)
        if worker.stdout is not None:
            worker.stdout.close()
    try:
        deadline = time.monotonic() + 10
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Watching, it is gone within a poll or two; not watching, it lives on.
        assert _alive(core) is not named
    finally:
        if _alive(core):
            os.kill(core, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
