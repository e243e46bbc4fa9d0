"""The restart policy and the supervisor of one process, on virtual time, without processes.

Test policy: a :class:`FakeChild` plays an incarnation (it exits when its script says,
in the nursery its starter was given, as a real child's watcher would); the jitter is
pinned at its upper bound by :class:`TopOfRange`, so every delay is exact and every
assert on ``trio.current_time()`` is exact too (``autojump_clock``). The restarts of
real processes are in tests/test_cluster.py.
"""

from __future__ import annotations

import itertools
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from headwater.cluster.children import LaunchError
from headwater.cluster.supervisor import RestartBudget, RestartPolicy, Supervised


class TopOfRange(random.Random):
    """Full jitter drawn at its top: every delay is the cap."""

    def uniform(self, a: float, b: float) -> float:
        return b


class FakeChild:
    """An incarnation that exits *lifetime* seconds after it came up (None: never)."""

    def __init__(self, name: str, pid: int, ports: Sequence[int], log_path: Path | None) -> None:
        self.name, self.pid, self.ports, self.log_path = name, pid, tuple(ports), log_path
        self.stopping = False
        self.status: int | None = None
        self._exited = trio.Event()

    def exit(self, status: int) -> None:
        if self.status is None:
            self.status = status
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.status is not None
        return self.status

    async def stop(self, grace: float) -> int:
        self.stopping = True
        self.exit(0)
        return await self.wait()

    def kill(self) -> None:
        self.stopping = True
        self.exit(-9)

    def log_tail(self, chars: int) -> str:
        return "the last words of the log"


@dataclass
class Script:
    """A starter: attempt n comes up after *startup* s and lives lifetimes[n] s, or
    fails when lifetimes[n] is a LaunchError; the last entry repeats."""

    lifetimes: list[float | LaunchError | None]
    startup: float = 0.0
    ports: Sequence[int] = ()
    log_path: Path | None = None
    started: list[float] = field(default_factory=list)  # when each attempt began
    previous: list[FakeChild | None] = field(default_factory=list)
    cancelled: int = 0

    async def __call__(self, nursery: trio.Nursery, previous: FakeChild | None) -> FakeChild:
        n = len(self.started)
        self.started.append(trio.current_time())
        self.previous.append(previous)
        try:
            await trio.sleep(self.startup)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        plan = self.lifetimes[min(n, len(self.lifetimes) - 1)]
        if isinstance(plan, LaunchError):
            raise plan
        child = FakeChild("p", 100 + n, self.ports, self.log_path)
        if plan is not None:
            nursery.start_soon(self._die, child, plan)
        return child

    @staticmethod
    async def _die(child: FakeChild, after: float) -> None:
        await trio.sleep(after)
        child.exit(-9)


def supervised(script: Script, **policy: Any) -> tuple[Supervised[Any], list[str]]:
    given_up: list[str] = []
    process: Supervised[Any] = Supervised(
        "p",
        script,
        RestartPolicy(**policy),
        on_give_up=lambda p: given_up.append(p.failure or ""),
        rng=TopOfRange(),
    )
    return process, given_up


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


# ---- the policy alone ------------------------------------------------------------------


def test_policy_defaults_and_validation() -> None:
    p = RestartPolicy()
    assert (p.backoff, p.backoff_max, p.budget, p.window) == (0.5, 10.0, 5, 60.0)
    assert p.describe() == "5 restarts per 60 s"
    for bad, option in (
        ({"backoff": 0}, "--restart-backoff "),
        ({"backoff": 2, "backoff_max": 1}, "--restart-backoff-max"),
        ({"budget": -1}, "--restart-budget"),
        ({"window": 0}, "--restart-window"),
    ):
        with pytest.raises(ValueError, match=option):
            RestartPolicy(**bad)


def test_budget_counts_restarts_in_a_sliding_window() -> None:
    budget = RestartBudget(
        RestartPolicy(backoff=1, backoff_max=8, budget=3, window=10), rng=TopOfRange()
    )
    assert [budget.exited(t, 0.0) for t in (0, 1, 2)] == [1, 2, 4]  # doubling
    assert budget.exited(3, 0.0) is None  # a 4th within 10 s: spent, nothing counted
    assert budget.recent(3) == 3
    assert budget.recent(10) == 2  # the one at t=0 left the window
    assert budget.exited(10, 0.0) == 8  # allowed again, and still in a row: the cap
    assert budget.total == 4
    assert budget.exited(30, 10.0) == 1  # up for a whole window: starts over


def test_jitter_stays_between_half_the_first_delay_and_the_cap() -> None:
    budget = RestartBudget(
        RestartPolicy(backoff=0.5, backoff_max=10, budget=100, window=1e9), rng=random.Random(7)
    )
    delays = [budget.exited(float(i), 0.0) for i in range(40)]
    caps = [min(10.0, 0.5 * 2**i) for i in range(40)]
    assert all(d is not None and 0.25 <= d <= cap for d, cap in zip(delays, caps, strict=True))
    assert len({round(d or 0, 6) for d in delays[6:]}) > 30  # drawn, not fixed


# ---- the supervisor on virtual time ------------------------------------------------------


async def test_restarts_back_off_and_the_budget_gives_up(autojump_clock: trio.abc.Clock) -> None:
    script = Script([0.5], startup=0.25)  # every incarnation crashes 0.5 s after it is up
    process, given_up = supervised(script, backoff=1, backoff_max=4, budget=4, window=100)
    async with trio.open_nursery() as nursery:
        first = await nursery.start(process.run)
        assert first.pid == 100
        assert trio.current_time() == 0.25
    # Each attempt: up after 0.25 s, crashes 0.5 s later, waits 1, 2, 4, 4 s (the cap).
    assert gaps(script.started) == [0.75 + 1, 0.75 + 2, 0.75 + 4, 0.75 + 4]
    assert trio.current_time() == script.started[-1] + 0.75  # gave up at the 5th exit
    assert script.previous[0] is None
    previous = [None if p is None else p.pid for p in script.previous[1:]]
    assert previous == [100, 101, 102, 103]  # the last one up
    (failure,) = given_up
    assert failure.startswith("p exited (killed by SIGKILL); giving up on it: restarted 4 times")
    assert "4 restarts per 100 s" in failure
    assert "the last words of the log" in failure
    assert process.statistics().given_up
    assert process.restarts == 4


async def test_a_process_up_for_a_window_starts_over(autojump_clock: trio.abc.Clock) -> None:
    script = Script([0.0, 0.0, 20.0, 0.0, 0.0, None])
    process, given_up = supervised(script, backoff=1, backoff_max=8, budget=3, window=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(process.run)
        with trio.fail_after(100):
            while len(script.started) < 6:
                await trio.sleep(1)
        await process.stop()
    # 1, 2; then it ran 20 s: the delays start over at 1, and the two old restarts are
    # out of the window, so three more fit in the budget of 3.
    assert gaps(script.started) == [1, 2, 20 + 1, 2, 4]
    assert given_up == []
    assert process.restarts == 5


async def test_a_restart_that_does_not_come_up_counts_and_says_the_port_is_taken(
    autojump_clock: trio.abc.Clock,
) -> None:
    with socket.socket() as holder:  # another process's listener on the port
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        no = LaunchError("p exited before it was ready (exit status 1)", "; log: ...")
        script = Script([0.0, no], ports=[port])
        process, given_up = supervised(script, backoff=1, backoff_max=1, budget=3, window=60)
        async with trio.open_nursery() as nursery:
            await nursery.start(process.run)
    assert gaps(script.started) == [1, 1, 1]  # the crash, then 3 restarts that failed
    assert all(p is process.child for p in script.previous[1:])  # the one that came up
    (failure,) = given_up
    assert failure.startswith(
        f"p did not come back: p exited before it was ready (exit status 1); 127.0.0.1:{port} "
        "is taken by another process; giving up on it: restarted 3 times in the last 60 s"
    )


async def test_budget_zero_gives_up_at_the_first_exit(autojump_clock: trio.abc.Clock) -> None:
    script = Script([3.0])
    process, given_up = supervised(script, budget=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(process.run)
    assert script.started == [0.0]
    assert trio.current_time() == 3.0
    assert given_up[0].startswith("p exited (killed by SIGKILL); giving up on it: restarted 0 ")


async def test_stop_during_the_backoff_or_a_start_restarts_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Up at 0, exits at 1, restarts at 11 and would be up at 16.
    for stop_at, attempts, cancelled in ((1.5, 1, 0), (13.0, 2, 1)):  # in the delay; starting
        script = Script([1.0], startup=0.0)
        process, given_up = supervised(script, backoff=10, backoff_max=10)
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await nursery.start(process.run)
            script.startup = 5.0
            await trio.sleep(stop_at)
            await process.stop()
            assert trio.current_time() == t0 + stop_at  # at once: nothing to wait for
        assert (len(script.started), script.cancelled, given_up) == (attempts, cancelled, [])


async def test_stop_ends_the_running_incarnation_without_a_restart(
    autojump_clock: trio.abc.Clock,
) -> None:
    script = Script([None])
    process, given_up = supervised(script)
    async with trio.open_nursery() as nursery:
        child = await nursery.start(process.run)
        await trio.sleep(5)
        await process.stop()
    assert child.stopping
    assert child.status == 0
    assert len(script.started) == 1
    assert given_up == []
    assert not process.statistics().running


async def test_the_first_start_raises_its_own_error(autojump_clock: trio.abc.Clock) -> None:
    script = Script([LaunchError("p exited before it was ready (exit status 2)")])
    process, given_up = supervised(script)
    async with trio.open_nursery() as nursery:
        with pytest.raises(LaunchError, match="exit status 2"):  # not in an ExceptionGroup
            await nursery.start(process.run)
    assert len(script.started) == 1
    assert given_up == []
    await process.stop()  # idempotent after a failed start


async def test_kill_is_an_expected_exit(autojump_clock: trio.abc.Clock) -> None:
    script = Script([None])
    process, given_up = supervised(script)
    async with trio.open_nursery() as nursery:
        child = await nursery.start(process.run)
        process.kill()
    assert child.status == -9
    assert len(script.started) == 1
    assert given_up == []


async def test_a_separator_line_goes_into_the_log_before_each_restart(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    log = tmp_path / "p.log"
    log.write_text("first run\n")
    script = Script([0.0, None], log_path=log)
    process, _ = supervised(script, backoff=2, backoff_max=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(process.run)
        with trio.fail_after(100):
            while len(script.started) < 2:
                await trio.sleep(0.5)
        await process.stop()
    first, separator = log.read_text().splitlines()
    assert first == "first run"
    assert separator.startswith("----- ")
    assert separator.endswith(" p exited (killed by SIGKILL): restart 1 in 2.00 s -----")
