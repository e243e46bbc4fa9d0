"""The stall detector's loop-thread half: a trio instrument that knows what the loop does.

Everything here runs **on the event-loop thread**, inside trio's scheduler:
``before_task_step`` on every task step of the process, ``before_io_wait`` and
``after_io_wait`` once per loop iteration. That is why this module is kept apart from the
watchdog's (:mod:`headwater.instrumentation.watchdog`): every line added to a hook is paid
on every step of the frontend's loop, so the hooks stay at about a microsecond (the
measurements are in :class:`TaskTracker`'s docstring), take no lock, do no I/O (no
``linecache``, no logging but on failure) and never raise into trio. Whatever can be done
later, by the watchdog thread, is.

How the loop is watched
-----------------------
The loop thread's timeline is a chain of *phases*, each ending where the next begins:

* ``io``: trio waits for I/O with a timeout; it is *due* back when the timeout ends.
  Waiting idle, however long, is fine: nothing was due.
* ``sched``: trio's own bookkeeping after the wait; due at once.
* ``step``: one task step, from ``before_task_step`` to the next hook; due at once.

:class:`TaskTracker` keeps the current phase as one tuple, which the watchdog thread reads
without a lock (one attribute read is atomic). When a hook finds that the previous phase
ended more than ``threshold_s`` after it was due, it appends an :class:`_Overrun` with
exact timestamps to a deque (appends and pops are thread-safe), and the watchdog turns it
into a record. Durations always come from these timestamps, never from the watchdog's
sampling: a thread that holds the GIL freezes the watchdog too, but not the clock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from math import inf
from types import CodeType
from typing import Any, Final, NamedTuple

import trio

#: The detector's log lines carry one logger name, whichever thread and module write them.
logger = logging.getLogger("headwater.instrumentation.stalls")

#: The clock of every phase timestamp, on both threads.
_clock: Final = time.perf_counter

# Phases. A phase is the tuple (phase, task or I/O timeout, started, due), in
# time.perf_counter() seconds; one tuple so another thread reads it atomically.
_OFF, _SCHED, _STEP, _IO = 0, 1, 2, 3
_Phase = tuple[int, Any, float, float]
_OFF_PHASE: Final[_Phase] = (_OFF, None, inf, inf)

_Frames = tuple[tuple[CodeType, int], ...]  # (code, line), innermost last
_MAX_FRAMES: Final = 48  # frames kept of a stack, here and in the watchdog's samples


class _Overrun(NamedTuple):
    """A phase that ended more than ``threshold_s`` after it was due, for the watchdog."""

    phase: _Phase
    ended: float  # perf_counter seconds
    # The loop thread's seconds on a CPU and waiting for one (see _ThreadTimes) at `ended`.
    loop_times: tuple[float, float | None] | None
    awaiting: _Frames  # for a step: where the task awaited next


class TaskTracker(trio.abc.Instrument):
    """The trio instrument: knows what the loop thread is doing, at per-step cost.

    Only ``before_task_step`` runs per task step: a step ends where the next hook
    begins, so an ``after_task_step`` would only add a second hook call. The I/O-wait
    hooks run once per loop iteration. Process CPU time per step, measured with
    ``scripts/measure/instrument_overhead.py --steps 50000 --reps 41`` (checkpoints over
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
        #: Reads this thread's seconds on a CPU and waiting for one when a phase
        #: overran; set by the detector.
        self.busy_clock: Callable[[], tuple[float, float | None] | None] = _no_clock

    @property
    def threshold_s(self) -> float:
        """A phase ending this much later than due is an overrun."""
        return self._threshold_s

    @property
    def enabled(self) -> bool:
        """Whether the hooks track: not disabled, by :meth:`disable` or a failing hook."""
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
        times: tuple[float, float | None] | None = None
        with suppress(Exception):
            times = self.busy_clock()
        self.pending.append(_Overrun(phase, now, times, awaiting))

    def _fail(self, hook: str, exc: Exception) -> None:
        logger.error("stall tracker disabled: its %s hook raised", hook, exc_info=exc)
        self.disable(f"{hook} raised {exc!r}")


def _no_clock() -> tuple[float, float | None] | None:
    return None
