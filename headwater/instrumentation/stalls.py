"""Name, while it happens, the task and the line that stall the event loop.

Why: NVIDIA Dynamo's frontend tokenized huge prompts on its event loop; the loop
stalled for seconds, its request-plane timeouts marked healthy workers down, and
nothing said which code was to blame. Here every stall becomes a :class:`StallRecord`
with the task, the stack and the cause.

How the loop is watched
-----------------------
The loop thread's timeline is a chain of *phases*, each ending where the next begins:

* ``io``: trio waits for I/O with a timeout; it is *due* back when the timeout ends.
  Waiting idle, however long, is fine: nothing was due.
* ``sched``: trio's own bookkeeping after the wait; due at once.
* ``step``: one task step, from ``before_task_step`` to the next hook; due at once.

:class:`TaskTracker` (the trio instrument) keeps the current phase as one tuple, and
when a hook finds that the previous phase ended more than ``threshold_s`` after it was
due, it queues an *overrun* with exact timestamps. :class:`StallDetector`'s watchdog
thread samples the loop thread's stack (``sys._current_frames()``) while a phase is
overdue, then turns each queued overrun into a record with its best sample.

Durations always come from the tracker's timestamps, never from counting samples: a
thread that holds the GIL freezes the watchdog too.

Cause
-----
* ``gil``: the loop came back late from the I/O wait (it was parked in epoll, so it was
  not running Python: another thread held the GIL); or a step stretched while the loop
  thread was mostly asleep *and* the watchdog could not get the GIL either.
* ``loop``: everything else: the loop thread itself was busy (Python, or C code holding
  the GIL, such as ``tokenizers.Tokenizer.encode`` on the loop) or blocked in a
  synchronous call (``time.sleep``, a lock, file I/O).

"Busy" counts time on a CPU *and* time runnable in the OS run queue (Linux
``/proc/self/task/<tid>/schedstat``), so a busy loop is still busy on an overloaded
machine (measured: 0.97–1.0 of the stall with two CPU hogs on 2 cores), while a thread
waiting for the GIL sleeps on a futex but for brief wake-ups every switch interval
(measured: 0.02–0.25). The watchdog counts as "could not get the GIL" any gap of more
than 10 ms between its wake-ups beyond its requested sleep and its own CPU time.
Without schedstat the thread CPU clock is used (CPU time only); without either, a C
call holding the GIL on the loop is reported as ``gil``.

Limits: GIL stalls are only visible while the I/O-wait timeout is short (the canary
keeps it ≤ 10 ms); only ``trio.run`` is supported, not guest mode.
"""

from __future__ import annotations

import functools
import linecache
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from math import inf
from types import CodeType
from typing import Any, Final, NamedTuple

import trio

from headwater.instrumentation.activity import Activity
from headwater.instrumentation.loop_metrics import StallCause

logger = logging.getLogger(__name__)

_clock: Final = time.perf_counter

# Phases. A phase is the tuple (phase, task or I/O timeout, started, due), in
# time.perf_counter() seconds; one tuple so another thread reads it atomically.
_OFF, _SCHED, _STEP, _IO = 0, 1, 2, 3
_Phase = tuple[int, Any, float, float]
_OFF_PHASE: Final[_Phase] = (_OFF, None, inf, inf)

_Frames = tuple[tuple[CodeType, int], ...]  # (code, line), innermost last

_TRIO_DIR: Final = os.path.dirname(trio.__file__) + os.sep
_MAX_FRAMES: Final = 48
_STARVED_MIN_S: Final = 0.010  # watchdog oversleep that counts as "could not get the GIL"
_BUSY: Final = 0.5  # loop thread busy for at least this share of a stall ⇒ "loop"


@dataclass(frozen=True, slots=True)
class StallRecord:
    """One stall of the event loop.

    Attributes:
      started_at: unix time at which the loop was due to run but did not.
      duration_s: how long it could not run.
      task: name of the task whose step stalled; ``"<io wait>"`` when the loop could
        not come back from waiting for I/O, ``"<trio scheduler>"`` for trio itself.
      stack: the loop thread's stack, innermost last, one ``"file:line in function:
        source line"`` string per frame; empty when nothing could be sampled.
      cause: ``"loop"`` (the loop thread was busy or blocked in a call) or ``"gil"``
        (it could not run because another thread held the GIL).
      sampled: ``True`` when ``stack`` was sampled during the stall; ``False`` when it
        is where the task next awaited (the watchdog was frozen throughout), or empty
        if the task ended in that step.
      loop_busy_fraction: share of the stall the loop thread was running or runnable
        (rather than asleep in a blocking call or waiting for the GIL); ``None`` where
        the platform cannot tell.
    """

    started_at: float
    duration_s: float
    task: str
    stack: tuple[str, ...]
    cause: StallCause
    sampled: bool
    loop_busy_fraction: float | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "task": self.task,
            "stack": list(self.stack),
            "cause": self.cause,
            "sampled": self.sampled,
            "loop_busy_fraction": self.loop_busy_fraction,
        }


@dataclass(frozen=True, slots=True)
class StallStatistics:
    """Counters of a :class:`StallDetector` since it was created."""

    stalls_total: int
    loop_stalls_total: int
    gil_stalls_total: int
    last_duration_s: float | None
    max_duration_s: float
    tracking: bool  # the instrument is installed, healthy and the watchdog runs


class _Overrun(NamedTuple):
    phase: _Phase
    ended: float  # perf_counter seconds
    loop_busy: float | None  # the loop thread's busy seconds (see _ThreadTimes) at `ended`
    awaiting: _Frames  # for a step: where the task awaited next


class TaskTracker(trio.abc.Instrument):
    """The trio instrument: knows what the loop thread is doing, at per-step cost.

    Only ``before_task_step`` runs per task step: a step ends where the next hook
    begins, so an ``after_task_step`` would only add a second hook call. The I/O-wait
    hooks run once per loop iteration. Process CPU time per step, measured with
    ``scripts/bench_instrument_overhead.py --steps 50000 --reps 41`` (checkpoints over
    100 tasks; 2 cores, Python 3.11, trio 0.35; best of 41, six runs; 2.5–2.65 µs
    per step without instruments):

    ===============================================  ==============
    configuration                                    added per step
    ===============================================  ==============
    ``before``/``after_io_wait`` only                +0.01–0.03 µs
    empty ``before_task_step`` (trio's dispatch)     +0.57–0.68 µs
    ``before`` + ``after_task_step``, clock in both  +1.54–1.69 µs
    this tracker                                     +0.79–0.90 µs
    :class:`StallDetector` (+ watchdog thread CPU)   +0.95–1.23 µs
    ===============================================  ==============

    So the per-step clock read and phase tuple cost ~0.2 µs over trio's own dispatch,
    and the I/O-wait heartbeat is free; the watchdog's wake-ups (200 a second in that
    measurement) added 0.1–0.3.

    A hook that raises disables the tracker (logged once); it never reaches trio, which
    would otherwise remove the instrument behind the detector's back.
    """

    __slots__ = ("_threshold_s", "busy_clock", "disabled_reason", "pending", "phase")

    def __init__(self, threshold_s: float = 0.020, *, max_pending: int = 1024) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be positive")
        self._threshold_s = threshold_s
        self.phase: _Phase = _OFF_PHASE
        #: Overruns for the watchdog; deque appends and pops are thread-safe.
        self.pending: deque[_Overrun] = deque(maxlen=max_pending)
        self.disabled_reason: str | None = None
        #: Reads this thread's busy seconds when a phase overran; set by the detector.
        self.busy_clock: Callable[[], float | None] = _no_clock

    @property
    def threshold_s(self) -> float:
        return self._threshold_s

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def current_task(self) -> trio.lowlevel.Task | None:
        """The task whose step is running, if the loop is in a task step."""
        phase = self.phase
        return phase[1] if phase[0] == _STEP else None

    def start(self) -> None:
        """Begin tracking from now: call right before ``trio.lowlevel.add_instrument``.

        Called from a task, it counts the rest of that task's current step as a step.
        """
        now = _clock()
        self.disabled_reason = None
        try:
            self.phase = (_STEP, trio.lowlevel.current_task(), now, now)
        except RuntimeError:  # not inside a trio task
            self.phase = (_SCHED, None, now, now)

    def disable(self, reason: str) -> None:
        """Stop tracking, and leave trio's instrument list if still in it."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
        self.phase = _OFF_PHASE
        with suppress(KeyError, RuntimeError):  # already removed / not in a trio run
            trio.lowlevel.remove_instrument(self)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        try:
            now = _clock()
            previous = self.phase
            self.phase = (_STEP, task, now, now)
            if now - previous[3] > self._threshold_s:
                self._overran(previous, now)
        except Exception as exc:
            self._fail("before_task_step", exc)

    def before_io_wait(self, timeout: float) -> None:
        try:
            now = _clock()
            previous = self.phase
            self.phase = (_IO, timeout, now, now + timeout)
            if now - previous[3] > self._threshold_s:
                self._overran(previous, now)
        except Exception as exc:
            self._fail("before_io_wait", exc)

    def after_io_wait(self, timeout: float) -> None:
        try:
            now = _clock()
            previous = self.phase
            self.phase = (_SCHED, None, now, now)
            if now - previous[3] > self._threshold_s:
                self._overran(previous, now)
        except Exception as exc:
            self._fail("after_io_wait", exc)

    def _overran(self, phase: _Phase, now: float) -> None:
        # Rare path, on the loop thread: keep it cheap and free of I/O (no linecache).
        # The next phase is already published, so the watchdog's samples taken from here
        # on are not mistaken for the overrun phase's.
        if phase[0] == _OFF:
            return
        awaiting: _Frames = ()
        if phase[0] == _STEP:
            with suppress(Exception):  # introspection must not break the hook
                awaiting = tuple(
                    (frame.f_code, lineno) for frame, lineno in phase[1].iter_await_frames()
                )[-_MAX_FRAMES:]
        busy: float | None = None
        with suppress(Exception):
            busy = self.busy_clock()
        self.pending.append(_Overrun(phase, now, busy, awaiting))

    def _fail(self, hook: str, exc: Exception) -> None:
        logger.error("stall tracker disabled: its %s hook raised", hook, exc_info=exc)
        self.disable(f"{hook} raised {exc!r}")


class StallDetector:
    """Owns a :class:`TaskTracker` and the watchdog thread; keeps the stall records.

    Args:
      threshold_s: a phase ending this much later than due is a stall.
      poll_s: how often the watchdog wakes while a phase is overdue or about to be;
        while none is, it sleeps until the current one could first count as a stall
        (at most ``threshold_s``): see :meth:`_nap`.
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
        self._threshold_s = threshold_s
        self._poll_s = poll_s
        self._on_stall = on_stall
        self._log_after_s = log_after_s
        self._report_after_s = report_after_s
        self._selfcheck_s = selfcheck_s
        self._activity = activity
        self._wall_offset = time.time() - _clock()

        self._lock = threading.Lock()  # guards the records and counters below
        self._records: deque[StallRecord] = deque(maxlen=max_records)
        self._by_cause: dict[StallCause, int] = {"loop": 0, "gil": 0}
        self._last_duration_s: float | None = None
        self._max_duration_s = 0.0

        self._running = False
        self._watchdog_alive = False
        self._stop = threading.Event()
        self._loop_ident = 0
        self._loop_times: _ThreadTimes | None = None
        # Watchdog-thread state (written before the thread starts, then only by it):
        self._busy_samples: deque[tuple[float, float]] = deque(maxlen=256)  # (t, busy s)
        self._starved: deque[tuple[float, float]] = deque(maxlen=256)  # watchdog GIL waits
        self._sampled_phase: _Phase | None = None
        self._best: _Frames = ()
        self._votes: dict[tuple[CodeType, int] | None, int] = {}  # innermost frame: samples
        self._reported_live = False

    # -- public API ---------------------------------------------------------------

    def records(self) -> list[StallRecord]:
        """The kept stall records, oldest first."""
        with self._lock:
            return list(self._records)

    def statistics(self) -> StallStatistics:
        with self._lock:
            return StallStatistics(
                stalls_total=sum(self._by_cause.values()),
                loop_stalls_total=self._by_cause["loop"],
                gil_stalls_total=self._by_cause["gil"],
                last_duration_s=self._last_duration_s,
                max_duration_s=self._max_duration_s,
                tracking=self._running and self.tracker.enabled and self._watchdog_alive,
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
        tracker = self.tracker
        watchdog: threading.Thread | None = None
        loop_times: _ThreadTimes | None = None
        try:
            self._loop_ident = threading.get_ident()
            loop_times = _ThreadTimes(self._loop_ident, threading.get_native_id())
            self._loop_times = loop_times
            self._busy_samples.clear()
            self._starved.clear()
            self._sample_loop_busy()  # a base for stalls before the watchdog's first tick
            self._stop.clear()
            watching = trio.Event()
            token = trio.lowlevel.current_trio_token()
            watchdog = threading.Thread(
                target=self._watch,
                args=(functools.partial(token.run_sync_soon, watching.set),),
                name="headwater-stall-watchdog",
                daemon=True,
            )
            tracker.busy_clock = loop_times.busy
            tracker.start()
            trio.lowlevel.add_instrument(tracker)
            self._watchdog_alive = True
            # Thread.start() waits for the new thread to run: not on the loop.
            await trio.to_thread.run_sync(watchdog.start)
            # Report started only once the watchdog measures: a GIL stall that begins
            # while the thread is still starting up would otherwise go unclassified.
            await watching.wait()
            task_status.started()
            me = trio.lowlevel.current_task()
            while tracker.enabled and self._watchdog_alive:
                asleep = _clock()
                await trio.sleep(self._selfcheck_s)
                phase = tracker.phase  # must be this very step, begun after the sleep
                if tracker.enabled and (
                    phase[0] != _STEP or phase[1] is not me or phase[2] < asleep
                ):
                    logger.error("stall tracker lost: trio no longer calls its hooks")
                    tracker.disable("trio stopped calling the tracker's hooks")
            self._halt()
            await trio.sleep_forever()
        finally:
            tracker.disable("stopped")
            self._halt()
            if watchdog is not None and watchdog.ident is not None:  # it was started
                with trio.move_on_after(1.0, shield=True):
                    await trio.to_thread.run_sync(watchdog.join, abandon_on_cancel=True)
            else:
                self._watchdog_alive = False
            if loop_times is not None and not (watchdog is not None and watchdog.is_alive()):
                loop_times.close()
            self._running = False

    # -- watchdog thread ------------------------------------------------------------

    def _watch(self, watching: Callable[[], object]) -> None:
        own: _ThreadTimes | None = None
        try:
            own = _ThreadTimes(threading.get_ident(), threading.get_native_id())
            last_wake, last_cpu = _clock(), own.cpu()
            with suppress(trio.RunFinishedError):
                watching()
            while (asked := self._nap()) is not None:
                # A long gap between two wakes, beyond the requested sleep and our own CPU
                # time, means we could not get the GIL (at the wake-up or at any GIL
                # release inside the previous tick). Run-queue waits are not subtracted: a
                # thread waiting for the GIL wakes every switch interval, and on a busy
                # machine queues for a CPU each time; but such waits rarely reach 10 ms.
                now, cpu = _clock(), own.cpu()
                if now - last_wake - asked - (cpu - last_cpu) > _STARVED_MIN_S:
                    self._starved.append((last_wake, now))
                last_wake, last_cpu = now, cpu
                self._sample_loop_busy()
                self._drain(until=now)
                self._observe(_clock())
            self._drain(until=inf)
        except Exception:
            logger.exception("stall watchdog failed; stall detection is off")
        finally:
            if own is not None:
                own.close()
            self._watchdog_alive = False
            with suppress(trio.RunFinishedError):
                watching()  # again, in case the loop is still waiting for it

    def _nap(self) -> float | None:
        """Sleep one poll; returns the seconds asked for, or ``None`` once stopped.

        The nap lasts until the loop's current phase could first count as a stall, at
        least ``poll_s`` and at most ``threshold_s``. Why: every wake-up takes the GIL
        from the loop thread, which on a busy loop is a forced switch that costs it two
        OS wake-ups (docs/performance.md, "Where the loop's wall time goes besides its
        CPU"). A loop that runs short steps is never close to a stall, so the watchdog
        wakes every ``threshold_s`` instead of every ``poll_s``, and a phase that does
        stall is still sampled within ``threshold_s + poll_s`` of its start, as before.

        While the canary rests, poll as seldom as it ticks: an idle loop has nothing to
        stall, and the first request ends the nap (``Activity.woken``).
        """
        activity = self._activity
        if activity is not None:
            activity.woken.clear()  # before reading `resting`, so no wake-up is lost
            if activity.resting:
                activity.woken.wait(activity.rest_interval_s)
                return None if self._stop.is_set() else activity.rest_interval_s
        asked = self._until_overdue(_clock())
        return None if self._stop.wait(asked) else asked

    def _until_overdue(self, now: float) -> float:
        """Seconds until the current phase could first count as a stall, clamped to
        ``[poll_s, threshold_s]``."""
        stall_at = self.tracker.phase[3] + self._threshold_s
        return min(self._threshold_s, max(self._poll_s, stall_at - now))

    def _halt(self) -> None:
        self._stop.set()
        if self._activity is not None:
            self._activity.woken.set()  # ends a nap at once

    def _sample_loop_busy(self) -> None:
        if self._loop_times is not None and (busy := self._loop_times.busy()) is not None:
            self._busy_samples.append((_clock(), busy))

    def _observe(self, now: float) -> None:
        """Sample the loop thread's stack if the current phase is overdue."""
        phase = self.tracker.phase
        overdue = now - phase[3]
        if overdue <= self._threshold_s:
            return
        frames = self._sample_stack()
        if self.tracker.phase is not phase:
            return  # the loop moved on while we sampled: the sample may be of the next phase
        if phase is not self._sampled_phase:
            self._sampled_phase, self._best, self._reported_live = phase, frames, False
            self._votes = {}
        self._keep(frames)
        if not self._reported_live and overdue >= self._report_after_s:
            self._reported_live = True
            logger.warning(
                "event loop stalled for %.2f s so far, in %s at %s",
                overdue,
                _phase_name(phase),
                _innermost(self._best),
            )

    def _keep(self, frames: _Frames) -> None:
        """Count *frames* for the phase; keep it as the phase's stack if it ranks first.

        A sampling profiler's rule: the stall is where most samples landed. The deepest
        stack is not enough: a step that sleeps 100 ms and then writes its response
        would be blamed on the write if one sample caught it.
        """
        votes = self._votes
        where = frames[-1] if frames else None
        votes[where] = votes.get(where, 0) + 1
        best = self._best
        if frames is best:
            return
        best_where = best[-1] if best else None
        if _rank(frames, votes[where]) > _rank(best, votes.get(best_where, 0)):
            self._best = frames

    def _sample_stack(self) -> _Frames:
        frame = sys._current_frames().get(self._loop_ident)
        frames: list[tuple[CodeType, int]] = []
        while frame is not None and len(frames) < _MAX_FRAMES:
            code = frame.f_code
            in_trio = code.co_filename.startswith(_TRIO_DIR)
            if in_trio and code.co_name == "unrolled_run":
                break  # outside the task: trio's scheduler and whatever called trio.run
            frames.append((code, frame.f_lineno or code.co_firstlineno))
            if in_trio and code.co_name == "run":
                break  # the I/O wait is called from trio.run itself
            frame = frame.f_back
        frames.reverse()
        return tuple(frames)

    def _drain(self, *, until: float) -> None:
        """Finish the overruns that ended by ``until``, up to which our starvation is known.

        An overrun that ended later may have frozen this very tick at a GIL release; its
        starvation shows only at the next wake-up, so it waits for the next tick.
        """
        pending = self.tracker.pending
        while pending and pending[0].ended <= until:
            self._finish(pending.popleft())

    def _finish(self, overrun: _Overrun) -> None:
        phase = overrun.phase
        kind, _, started, due = phase
        began = due if kind == _IO else started
        busy = self._busy_fraction(began, overrun.ended, overrun.loop_busy)
        cause: StallCause = "loop"
        if kind == _IO:
            cause = "gil"  # parked in epoll, so not running Python: it could not get the GIL
        elif (busy is None or busy < _BUSY) and self._starved_fraction(began, overrun.ended) >= 0.5:
            cause = "gil"
        if phase is self._sampled_phase:
            frames, sampled = self._best, True
            self._sampled_phase, self._best, self._votes = None, (), {}
        else:
            frames, sampled = overrun.awaiting, False
        record = StallRecord(
            started_at=began + self._wall_offset,
            duration_s=overrun.ended - began,
            task=_phase_name(phase),
            stack=tuple(_format_frame(code, line) for code, line in frames),
            cause=cause,
            sampled=sampled,
            loop_busy_fraction=busy,
        )
        with self._lock:
            self._records.append(record)
            self._by_cause[cause] += 1
            self._last_duration_s = record.duration_s
            self._max_duration_s = max(self._max_duration_s, record.duration_s)
        if record.duration_s >= self._log_after_s:
            logger.warning(
                "event loop stalled %.3f s (%s; loop thread busy %s) in %s at %s",
                record.duration_s,
                cause,
                "?" if busy is None else f"{busy:.0%}",
                record.task,
                record.stack[-1] if record.stack else "?",
            )
        if self._on_stall is not None:
            try:
                self._on_stall(record)
            except Exception:
                logger.exception("on_stall callback failed")

    def _busy_fraction(self, start: float, end: float, busy_end: float | None) -> float | None:
        """Share of [start, end] the loop thread was busy, from the latest sample ≤ start."""
        if busy_end is None:
            return None
        base: tuple[float, float] | None = None
        for sample in reversed(self._busy_samples):
            base = sample
            if sample[0] <= start:
                break
        if base is None or end - base[0] <= 0:
            return None
        return min(1.0, max(0.0, (busy_end - base[1]) / (end - base[0])))

    def _starved_fraction(self, start: float, end: float) -> float:
        """Share of [start, end] during which the watchdog waited for the GIL."""
        if end <= start:
            return 0.0
        total = sum(
            max(0.0, min(late_end, end) - max(late_start, start))
            for late_start, late_end in self._starved
        )
        return total / (end - start)


class _ThreadTimes:
    """How one thread spent its time, readable from any thread.

    Linux ``/proc/self/task/<tid>/schedstat`` (``pread`` on a kept descriptor, ~2 µs)
    gives time on a CPU and time runnable in the run queue; elsewhere the thread CPU
    clock (``time.pthread_getcpuclockid``) gives CPU time only. Methods raise ``OSError``
    if the thread is gone.
    """

    def __init__(self, ident: int, native_id: int) -> None:
        self._fd: int | None = None
        self._cpu_clock: int | None = None
        try:
            self._fd = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)
            self._schedstat()
        except (OSError, ValueError):
            self.close()
            with suppress(AttributeError, OSError):  # not on this platform
                self._cpu_clock = time.pthread_getcpuclockid(ident)

    def _schedstat(self) -> tuple[float, float]:
        assert self._fd is not None
        on_cpu, queued, _ = os.pread(self._fd, 128, 0).split()
        return int(on_cpu) / 1e9, int(queued) / 1e9

    def busy(self) -> float | None:
        """Seconds on a CPU or runnable waiting for one (CPU only without schedstat)."""
        if self._fd is not None:
            on_cpu, queued = self._schedstat()
            return on_cpu + queued
        if self._cpu_clock is not None:
            return time.clock_gettime(self._cpu_clock)
        return None

    def cpu(self) -> float:
        """Seconds on a CPU; 0 if unknown."""
        if self._fd is not None:
            return self._schedstat()[0]
        if self._cpu_clock is not None:
            return time.clock_gettime(self._cpu_clock)
        return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _no_clock() -> float | None:
    return None


def _phase_name(phase: _Phase) -> str:
    kind = phase[0]
    if kind == _STEP:
        return str(phase[1].name)
    return "<io wait>" if kind == _IO else "<trio scheduler>"


def _rank(frames: _Frames, votes: int) -> tuple[bool, int, int]:
    """Most informative sample first: innermost frame outside trio, then the innermost
    frame most samples of the phase share (*votes*), then the deepest."""
    outside_trio = bool(frames) and not frames[-1][0].co_filename.startswith(_TRIO_DIR)
    return (outside_trio, votes, len(frames))


def _innermost(frames: _Frames) -> str:
    return _format_frame(*frames[-1]) if frames else "?"


def _format_frame(code: CodeType, line: int) -> str:
    where = f"{_short_path(code.co_filename)}:{line} in {code.co_qualname}"
    source = linecache.getline(code.co_filename, line).strip()
    return f"{where}: {source}" if source else where


@functools.lru_cache(maxsize=1024)
def _short_path(filename: str) -> str:
    """``filename`` relative to the longest ``sys.path`` entry holding it."""
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or os.curdir) + os.sep
        if filename.startswith(root) and len(root) > len(best):
            best = root
    return filename[len(best) :]
