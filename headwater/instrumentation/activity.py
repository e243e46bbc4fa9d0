"""Whether a process has work in flight, so that its loop monitor can rest when it has none.

Why: the canary wakes the loop every 10 ms, and the stall watchdog thread wakes as often.
On an idle frontend that was most of its CPU: 6.6% of a core on the 2-core benchmark VM,
against 1.05% resting (docs/observability.md, "What the instrumentation costs").
Idle processes take that CPU from busy neighbours on the same machine, and an idle loop
has nothing to delay anyway.

So the frontend wraps every HTTP request, and a worker every generate request, in
``with activity:``. Once nothing has been in flight for ``idle_after_s``, the canary
*rests*: it ticks every ``rest_interval_s``, and the watchdog polls as seldom, until the
next request, whose ``__enter__`` wakes both at once.

What resting gives up, and only while nothing is in flight: a GIL stall shorter than the
rest interval goes unseen, because the loop is not due back from its I/O wait sooner;
and a loop stall shorter than it is recorded with the stack where its step ended, as the
watchdog may not sample it. Stall durations stay exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import trio


class Activity:
    """Counts work in flight on one loop; the canary and watchdog rest while there is none.

    Enter and exit on the loop thread (``with activity: ...``), from as many tasks as
    there are requests: it is a counter, not a lock. Cheap: an increment, and on the
    first request after a rest one ``Event.set`` for the canary and one for the watchdog.

    Args:
      idle_after_s: how long nothing must have been in flight before the monitor rests.
      rest_interval_s: the canary's tick and the watchdog's poll while resting.
    """

    __slots__ = (
        "_clock",
        "_inflight",
        "_last_busy",
        "_rest",
        "idle_after_s",
        "rest_interval_s",
        "started",
        "woken",
    )

    def __init__(self, *, idle_after_s: float = 1.0, rest_interval_s: float = 0.1) -> None:
        if idle_after_s < 0 or rest_interval_s <= 0:
            raise ValueError("idle_after_s must be >= 0 and rest_interval_s positive")
        self.idle_after_s = idle_after_s
        self.rest_interval_s = rest_interval_s
        self._inflight = 0
        self._clock: Callable[[], float] = time.perf_counter
        self._last_busy = self._clock()  # a process that just started counts as just busy
        self._rest: trio.Event | None = None
        #: Set when work ends a rest; the watchdog thread waits on it while resting.
        self.woken = threading.Event()
        #: Work items begun since the start: a change tells that work came and went.
        self.started = 0

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure idleness with *clock* from now on (the loop monitor's: trio's own
        under a MockClock, :func:`headwater.instrumentation.canary.loop_clock`)."""
        self._clock = clock
        self._last_busy = clock()

    @property
    def inflight(self) -> int:
        """Work items in flight right now."""
        return self._inflight

    @property
    def resting(self) -> bool:
        """Whether the canary is resting (read by the watchdog thread too)."""
        return self._rest is not None

    def __enter__(self) -> None:
        self._inflight += 1
        self.started += 1
        rest = self._rest
        if rest is not None:
            self._rest = None  # before waking the watchdog: it reads `resting` next
            rest.set()
            self.woken.set()

    def __exit__(self, *exc_info: object) -> None:
        self._inflight -= 1
        self._last_busy = self._clock()

    def idle(self) -> bool:
        """Nothing in flight now, and nothing for the last ``idle_after_s``."""
        return self._inflight == 0 and self._clock() - self._last_busy >= self.idle_after_s

    async def rest(self) -> bool:
        """Wait ``rest_interval_s``, or less if work arrives: then return ``True``.

        Cancellation: stops at the wait; the rest ends with it.
        """
        self._rest = arrived = trio.Event()
        try:
            with trio.move_on_after(self.rest_interval_s):
                await arrived.wait()
                return True
            return False
        finally:
            if self._rest is arrived:
                self._rest = None
