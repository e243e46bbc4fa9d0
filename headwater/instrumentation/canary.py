"""The event-loop canary: a task that asks to sleep 10 ms and measures how late it woke.

Why: the overshoot is exactly what every other task on this loop suffered at that moment,
so it is the loop's latency as users feel it, at the cost of ~100 tiny task steps per
second. Dynamo exports the same signal (``event_loop_delay_seconds``). The canary also
keeps trio's I/O-wait timeout at ≤ 10 ms, which lets the stall detector see a loop that
could not come back from the wait because another thread held the GIL.

Given an :class:`~headwater.instrumentation.activity.Activity`, it rests while the
process is idle: one tick per ``rest_interval_s`` (100 ms) instead of 100 per second,
back to 10 ms as soon as a request arrives.

It measures with the real monotonic clock, except under trio's ``MockClock`` (a test's
virtual time, where a sleep takes no real time at all): there it measures on trio's
clock (:func:`loop_clock`), so a stall is the clock moving on while no task runs, which
is what a test makes with ``MockClock.jump`` (``headwater.testing``'s loop stall), and
it ticks every :data:`VIRTUAL_INTERVAL_S` at the most often.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import trio
import trio.testing

if TYPE_CHECKING:
    from headwater.instrumentation.activity import Activity
    from headwater.instrumentation.attribution import StallLog
    from headwater.instrumentation.loop_metrics import LoopMetrics


class DelaySeries:
    """Loop delay over time for a chart: the maximum delay per bucket over a window.

    The default keeps the last 60 s in 250 ms buckets (240 points). Written by the
    canary on the loop thread; :meth:`recent` copies, so readers never see it change
    under them.
    """

    def __init__(self, *, window_s: float = 60.0, bucket_s: float = 0.25) -> None:
        if window_s <= 0 or bucket_s <= 0:
            raise ValueError("window_s and bucket_s must be positive")
        self.window_s = window_s
        self.bucket_s = bucket_s
        # (bucket index, max delay); a bucket index is floor(wall time / bucket_s)
        self._buckets: deque[tuple[int, float]] = deque(maxlen=math.ceil(window_s / bucket_s))

    def add(self, wall_time: float, delay_s: float) -> None:
        """Fold one sample taken at ``wall_time`` (unix seconds) into its bucket."""
        index = math.floor(wall_time / self.bucket_s)
        buckets = self._buckets
        if buckets and buckets[-1][0] == index:
            if delay_s > buckets[-1][1]:
                buckets[-1] = (index, delay_s)
        elif not buckets or index > buckets[-1][0]:
            buckets.append((index, delay_s))
        # an older index means the wall clock stepped back: drop the sample

    def recent(self, now: float | None = None) -> list[tuple[float, float]]:
        """``(bucket start in unix seconds, max delay in seconds)`` pairs, oldest first.

        Only buckets that started within ``window_s`` of ``now`` (default: the current
        wall time); buckets without samples (the loop was stalled, or not running) are
        absent rather than zero.
        """
        if now is None:
            now = time.time()
        oldest = now - self.window_s
        return [
            (start, delay)
            for index, delay in list(self._buckets)
            if (start := index * self.bucket_s) >= oldest
        ]


#: The canary's tick under a MockClock. Each tick there is a jump of the clock and a
#: pass of the loop: real work (~0.1 ms) for no real time, 100 of them per virtual
#: second at 10 ms. And a virtual stall is a test's jump of the clock, of seconds: a
#: tenth of one measures it closely enough (the start of a stall is known to a tick).
VIRTUAL_INTERVAL_S = 0.1


def virtual_time() -> bool:
    """Whether this trio run's clock is a ``MockClock`` (a test's virtual time)."""
    return isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)


def loop_clock() -> Callable[[], float]:
    """The clock the loop's measurements use in the current trio run: trio's own under
    a ``MockClock`` (virtual time, where real time says nothing of the loop), else the
    monotonic performance counter."""
    return trio.current_time if virtual_time() else time.perf_counter


async def run_canary(
    metrics: LoopMetrics,
    *,
    interval: float = 0.010,
    threshold: float = 0.020,
    series: DelaySeries | None = None,
    activity: Activity | None = None,
    stall_log: StallLog | None = None,
    task_status: trio.TaskStatus[DelaySeries] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Sleep ``interval`` seconds in a loop and record each overshoot until cancelled.

    Each overshoot (observed − requested, never negative) goes into ``metrics``' delay
    histogram and max gauge, and counts as a stall when it exceeds ``threshold``; it is
    also folded into ``series`` (a fresh :class:`DelaySeries` when ``None``), which is
    what ``nursery.start(run_canary, metrics)`` returns.

    With ``activity``, while :meth:`Activity.idle` it sleeps ``activity.rest_interval_s``
    instead; a rest that work cut short is not a sample (nothing was late). Each stall
    also goes into ``stall_log`` (in trio time), the witness that stall-aware
    attribution asks (:mod:`headwater.instrumentation.attribution`).

    Cancellation: stops at the sleep; nothing to clean up.
    """
    if interval <= 0:
        raise ValueError("interval must be positive")
    if series is None:
        series = DelaySeries()
    task_status.started(series)
    clock = loop_clock()
    if virtual_time():
        interval = max(interval, VIRTUAL_INTERVAL_S)
    wall = time.time
    while True:
        asked = clock()
        if activity is not None and activity.idle():
            if await activity.rest():
                continue
            delay = max(0.0, clock() - asked - activity.rest_interval_s)
        else:
            await trio.sleep(interval)
            delay = max(0.0, clock() - asked - interval)
        stalled = delay > threshold
        metrics.observe_delay(delay, stalled=stalled)
        if stalled and stall_log is not None:
            stall_log.add(trio.current_time(), delay)
        series.add(wall(), delay)
