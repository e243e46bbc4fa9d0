"""What the stall detector costs per trio task step.

Runs the same workload (``--steps`` checkpoints spread over ``--tasks`` tasks) under
each configuration, interleaved, ``--reps`` times, and prints the best CPU time per
step and the difference to no instrumentation. Process CPU time, not wall time: it
ignores the time other processes take from us on a shared machine, and it includes
the watchdog thread's own CPU. Best-of-N because noise only ever adds time; many short
runs beat a few long ones on a shared machine.

    .venv/bin/python scripts/measure/instrument_overhead.py --steps 50000 --reps 41
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from headwater.instrumentation import StallDetector, TaskTracker


class EmptyStepHook(trio.abc.Instrument):
    """The floor: trio's cost of calling one Python hook per step."""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        pass


class BeforeAfterHooks(trio.abc.Instrument):
    """The obvious design TaskTracker avoids: two hooks per step, each reading the clock."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.started = self.ended = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.task, self.started = task, time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.task, self.ended = None, time.perf_counter()


class IoWaitHooks(trio.abc.Instrument):
    """Hooks that run once per loop iteration instead of once per step."""

    def __init__(self) -> None:
        self.waited = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self.waited = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self.waited = time.perf_counter()


async def _workload(steps: int, tasks: int) -> None:
    async def worker(n: int) -> None:
        checkpoint = trio.lowlevel.checkpoint
        for _ in range(n):
            await checkpoint()

    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(worker, steps // tasks)


async def _plain(steps: int, tasks: int) -> None:
    await _workload(steps, tasks)


def _with(instrument: Callable[[], trio.abc.Instrument]) -> Callable[[int, int], Awaitable[None]]:
    async def run(steps: int, tasks: int) -> None:
        trio.lowlevel.add_instrument(instrument())
        await _workload(steps, tasks)

    return run


async def _tracker(steps: int, tasks: int) -> None:
    tracker = TaskTracker()
    tracker.start()
    trio.lowlevel.add_instrument(tracker)
    await _workload(steps, tasks)
    tracker.disable("done")


async def _detector(steps: int, tasks: int) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(StallDetector().run)
        await _workload(steps, tasks)
        nursery.cancel_scope.cancel()


CONFIGS: dict[str, Callable[[int, int], Awaitable[None]]] = {
    "no instrument": _plain,
    "io-wait hooks only": _with(IoWaitHooks),
    "empty before_task_step": _with(EmptyStepHook),
    "before+after, clock in both": _with(BeforeAfterHooks),
    "TaskTracker": _tracker,
    "StallDetector (+watchdog)": _detector,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--reps", type=int, default=31)
    args = parser.parse_args()

    best = dict.fromkeys(CONFIGS, float("inf"))
    for _ in range(args.reps):
        for name, config in CONFIGS.items():
            started = time.process_time()
            trio.run(config, args.steps, args.tasks)
            best[name] = min(best[name], time.process_time() - started)

    print(
        f"Python {platform.python_version()}, trio {trio.__version__}, {os.cpu_count()} CPUs; "
        f"{args.steps} steps over {args.tasks} tasks, best of {args.reps}",
        file=sys.stderr,
    )
    base = best["no instrument"] / args.steps * 1e6
    print(f"{'configuration':28s} {'CPU µs/step':>11s} {'added':>8s}")
    for name, seconds in best.items():
        per_step = seconds / args.steps * 1e6
        print(f"{name:28s} {per_step:11.3f} {per_step - base:+8.3f}")


if __name__ == "__main__":
    main()
