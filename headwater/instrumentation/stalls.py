"""Name, while it happens, the task and the line that stall the event loop.

Why: NVIDIA Dynamo's frontend tokenized huge prompts on its event loop; the loop
stalled for seconds, its request-plane timeouts marked healthy workers down, and
nothing said which code was to blame. Here every stall becomes a :class:`StallRecord`
with the task, the stack and the cause.

This module is what users of the detector see: :class:`StallDetector`, the trio-facing
object that runs in a nursery and keeps the records, and the records it hands out. It
wires together two halves, one per thread, each in its own module:

* :mod:`headwater.instrumentation.tracker`, **the loop thread**: :class:`TaskTracker`,
  the trio instrument whose hooks run on every task step, so they only publish the
  current phase and queue the phases that overran, at about a microsecond per step.
* :mod:`headwater.instrumentation.watchdog`, **the watchdog thread**: it samples the
  loop thread's stack while a phase is overdue and turns each overrun into a record with
  its cause (``loop``, ``gil`` or ``contention``: see that module). A thread that holds
  the GIL freezes the watchdog too, which is why durations come from the tracker's
  timestamps and only the stack depends on sampling.

The records are kept here, behind a lock: the watchdog thread adds them, the loop thread
(or any other) reads them with :meth:`StallDetector.records` and
:meth:`StallDetector.statistics`.

Limits: GIL stalls are only visible while the I/O-wait timeout is short (the canary
keeps it ≤ 10 ms); only ``trio.run`` is supported, not guest mode.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from headwater.instrumentation.activity import Activity
from headwater.instrumentation.loop_metrics import STALL_CAUSES, StallCause
from headwater.instrumentation.record import StallRecord
from headwater.instrumentation.tracker import _STEP, TaskTracker, _clock, logger
from headwater.instrumentation.watchdog import Watchdog, _ThreadTimes

__all__ = ["StallDetector", "StallRecord", "StallStatistics"]


@dataclass(frozen=True, slots=True)
class StallStatistics:
    """Counters of a :class:`StallDetector` since it was created."""

    stalls_total: int
    loop_stalls_total: int
    gil_stalls_total: int
    contention_stalls_total: int
    last_duration_s: float | None
    max_duration_s: float
    tracking: bool  # the instrument is installed, healthy and the watchdog runs


class StallDetector:
    """Owns a :class:`TaskTracker` and the watchdog thread; keeps the stall records.

    Args:
      threshold_s: a phase ending this much later than due is a stall.
      poll_s: how often the watchdog wakes while a phase is overdue or about to be;
        while none is, it sleeps until the current one could first count as a stall
        (at most ``threshold_s``): see :meth:`Watchdog._nap`.
      activity: the process's work in flight; while its canary rests (nothing in
        flight), the watchdog polls every ``activity.rest_interval_s`` instead, and the
        first request wakes it (see :mod:`headwater.instrumentation.activity`).
      max_records: how many records to keep (oldest dropped).
      on_stall: called with each new record **on the watchdog thread**: keep it quick
        and thread-safe (prometheus counters are; for trio code use
        ``trio.lowlevel.TrioToken.run_sync_soon``). Its exceptions are logged.
      log_after_s: completed stalls at least this long are logged as warnings.
      report_after_s: a stall still going on after this long is logged once, live.
      selfcheck_s: how often :meth:`run` checks that trio still calls the tracker.
    """

    def __init__(
        self,
        *,
        threshold_s: float = 0.020,
        poll_s: float = 0.005,
        max_records: int = 200,
        on_stall: Callable[[StallRecord], object] | None = None,
        log_after_s: float = 0.1,
        report_after_s: float = 1.0,
        selfcheck_s: float = 0.25,
        activity: Activity | None = None,
    ) -> None:
        if poll_s <= 0 or selfcheck_s <= 0:
            raise ValueError("poll_s and selfcheck_s must be positive")
        self.tracker = TaskTracker(threshold_s)
        self.watchdog = Watchdog(
            self.tracker,
            poll_s=poll_s,
            report_after_s=report_after_s,
            log_after_s=log_after_s,
            activity=activity,
            store=self._store,
            on_stall=on_stall,
        )
        self._selfcheck_s = selfcheck_s

        self._lock = threading.Lock()  # guards the records and counters below
        self._records: deque[StallRecord] = deque(maxlen=max_records)
        self._by_cause: dict[StallCause, int] = dict.fromkeys(STALL_CAUSES, 0)
        self._last_duration_s: float | None = None
        self._max_duration_s = 0.0

        self._running = False

    # -- public API ---------------------------------------------------------------

    def records(self) -> list[StallRecord]:
        """The kept stall records, oldest first."""
        with self._lock:
            return list(self._records)

    def statistics(self) -> StallStatistics:
        """The counters so far, and whether the detector is tracking right now."""
        with self._lock:
            return StallStatistics(
                stalls_total=sum(self._by_cause.values()),
                loop_stalls_total=self._by_cause["loop"],
                gil_stalls_total=self._by_cause["gil"],
                contention_stalls_total=self._by_cause["contention"],
                last_duration_s=self._last_duration_s,
                max_duration_s=self._max_duration_s,
                tracking=self._running and self.tracker.enabled and self.watchdog.alive,
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the loop that runs this task until cancelled.

        Installs the tracker on the current trio run, starts the watchdog thread,
        then reports started. Every ``selfcheck_s`` it checks that trio still calls the
        tracker (trio silently drops an instrument whose hook raised); if not, it stops
        watching and logs, but keeps running. On cancellation it removes the
        instrument and joins the thread (shielded, at most 1 s).

        Raises:
          RuntimeError: if this detector is already running.
        """
        if self._running:
            raise RuntimeError("StallDetector.run is already running")
        self._running = True
        tracker, watchdog = self.tracker, self.watchdog
        thread: threading.Thread | None = None
        loop_times: _ThreadTimes | None = None
        try:
            loop_ident = threading.get_ident()
            loop_times = _ThreadTimes(loop_ident, threading.get_native_id())
            watchdog.reset(loop_ident, loop_times)
            watching = trio.Event()
            token = trio.lowlevel.current_trio_token()
            thread = threading.Thread(
                target=watchdog.watch,
                args=(functools.partial(token.run_sync_soon, watching.set),),
                name="headwater-stall-watchdog",
                daemon=True,
            )
            tracker.busy_clock = loop_times.times
            tracker.start()
            trio.lowlevel.add_instrument(tracker)
            watchdog.alive = True
            # Thread.start() waits for the new thread to run: not on the loop.
            await trio.to_thread.run_sync(thread.start)
            # Report started only once the watchdog measures: a GIL stall that begins
            # while the thread is still starting up would otherwise go unclassified.
            await watching.wait()
            task_status.started()
            me = trio.lowlevel.current_task()
            while tracker.enabled and watchdog.alive:
                asleep = _clock()
                await trio.sleep(self._selfcheck_s)
                phase = tracker.phase  # must be this very step, begun after the sleep
                if tracker.enabled and (
                    phase[0] != _STEP or phase[1] is not me or phase[2] < asleep
                ):
                    logger.error("stall tracker lost: trio no longer calls its hooks")
                    tracker.disable("trio stopped calling the tracker's hooks")
            watchdog.stop()
            await trio.sleep_forever()
        finally:
            tracker.disable("stopped")
            watchdog.stop()
            if thread is not None and thread.ident is not None:  # it was started
                with trio.move_on_after(1.0, shield=True):
                    await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
            else:
                watchdog.alive = False
            if loop_times is not None and not (thread is not None and thread.is_alive()):
                loop_times.close()
            self._running = False

    # -- the watchdog thread --------------------------------------------------------

    def _store(self, record: StallRecord) -> None:
        """Keep *record* and count it: the watchdog's ``store``, called on its thread."""
        with self._lock:
            self._records.append(record)
            self._by_cause[record.cause] += 1
            self._last_duration_s = record.duration_s
            self._max_duration_s = max(self._max_duration_s, record.duration_s)
