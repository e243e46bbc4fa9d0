"""The stall detector's watchdog-thread half: what the loop was doing while it stalled.

Everything here runs **on the watchdog thread** (``headwater-stall-watchdog``), apart from
:meth:`Watchdog.reset` and :meth:`Watchdog.stop`, which the detector calls from the loop
thread, and :meth:`_ThreadTimes.times`, which the tracker also calls when a phase overran.
The split from :mod:`headwater.instrumentation.tracker` is the split of costs: the
tracker's hooks run on every task step and must stay at about a microsecond, so stack
sampling, reading source lines, formatting, logging and the ``on_stall`` callback all happen here,
off the loop. The price: a thread that holds the GIL freezes the watchdog too. So the
watchdog never measures a stall by its own sampling; durations come from the tracker's
timestamps, and the watchdog adds the stack (sampled with ``sys._current_frames()`` while
a phase is overdue) and the cause.

Cause
-----
* ``contention``: the loop thread was ready to run but waited for a CPU for most of the
  stall, and would not have stalled without that wait: the host's other work (another
  process, a noisy neighbour) took the CPUs, not this process's code. The record also
  carries the host's CPU pressure around the stall (:mod:`.pressure`), when the kernel
  has it.
* ``gil``: the loop came back late from the I/O wait (it was parked in epoll, so it was
  not running Python: another thread held the GIL); or a step stretched while the loop
  thread was mostly asleep *and* the watchdog could not get the GIL either.
* ``loop``: everything else: the loop thread itself was busy (Python, or C code holding
  the GIL, such as ``tokenizers.Tokenizer.encode`` on the loop) or blocked in a
  synchronous call (``time.sleep``, a lock, file I/O).

Contention is checked first: a loop that waits in the run queue is late back from epoll
too, which alone would read as ``gil`` (on a busy host an idle frontend's every stall
did), and a short step stretched by the wait would read as ``loop``.

"Busy" counts time on a CPU *and* time runnable in the OS run queue (Linux
``/proc/self/task/<tid>/schedstat``), so a busy loop is still busy on an overloaded
machine (measured: 0.97–1.0 of the stall with two CPU hogs on 2 cores), while a thread
waiting for the GIL sleeps on a futex but for brief wake-ups every switch interval
(measured: 0.02–0.25). The watchdog counts as "could not get the GIL" any gap of more
than 10 ms between its wake-ups beyond its requested sleep and its own CPU time.
Without schedstat the thread CPU clock is used (CPU time only: no stall is then
``contention``); without either, a C call holding the GIL on the loop is reported as
``gil``. The run-queue wait of a stall is read from the loop thread's schedstat at its
end, less the watchdog's latest sample before its start (at most ``threshold_s``, or the
canary's resting tick, earlier).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from math import inf
from types import CodeType
from typing import Final

import trio

from headwater.instrumentation.activity import Activity
from headwater.instrumentation.loop_metrics import StallCause
from headwater.instrumentation.pressure import CpuPressure
from headwater.instrumentation.record import StallRecord
from headwater.instrumentation.tracker import (
    _IO,
    _MAX_FRAMES,
    _STEP,
    TaskTracker,
    _clock,
    _Frames,
    _Overrun,
    _Phase,
    logger,
)

_TRIO_DIR: Final = os.path.dirname(trio.__file__) + os.sep
_STARVED_MIN_S: Final = 0.010  # watchdog oversleep that counts as "could not get the GIL"
_BUSY: Final = 0.5  # loop thread busy for at least this share of a stall ⇒ "loop"
_WAITING: Final = 0.5  # loop thread waiting for a CPU this share of a stall ⇒ "contention"

#: A sample of the loop thread's times: (t, on a CPU s, waiting for one s or None, the
#: host's CPU pressure total s or None).
_Sample = tuple[float, float, float | None, float | None]


class Watchdog:
    """The watchdog thread's loop and state; :meth:`watch` is the thread's body.

    It samples the loop thread's stack while the tracker's current phase is overdue,
    and turns each of the tracker's overruns into a :class:`StallRecord` with its best
    sample. Its state is written only by the watchdog thread (and by :meth:`reset`,
    before that starts), so it takes no lock.

    Args:
      tracker: the loop's instrument: its ``phase`` and ``pending`` are read here.
      poll_s: how often to wake while a phase is overdue or about to be (see :meth:`_nap`).
      report_after_s: a stall still going on after this long is logged once, live.
      log_after_s: completed stalls at least this long are logged as warnings.
      activity: while its canary rests, poll every ``activity.rest_interval_s``.
      store: keeps each finished record; called on the watchdog thread, so thread-safe.
      on_stall: called with each record after ``store``, on the watchdog thread; its
        exceptions are logged.
    """

    def __init__(
        self,
        tracker: TaskTracker,
        *,
        poll_s: float,
        report_after_s: float,
        log_after_s: float,
        activity: Activity | None,
        store: Callable[[StallRecord], object],
        on_stall: Callable[[StallRecord], object] | None,
    ) -> None:
        self.tracker = tracker
        self._threshold_s = tracker.threshold_s
        self._poll_s = poll_s
        self._report_after_s = report_after_s
        self._log_after_s = log_after_s
        self._activity = activity
        self._store = store
        self._on_stall = on_stall
        self._wall_offset = time.time() - _clock()
        #: Set by the detector before it starts the thread; cleared when the thread ends.
        self.alive = False
        self._stop = threading.Event()
        self._loop_ident = 0
        self._loop_times: _ThreadTimes | None = None
        self._busy_samples: deque[_Sample] = deque(maxlen=256)
        self._pressure: CpuPressure | None = None
        self._starved: deque[tuple[float, float]] = deque(maxlen=256)  # watchdog GIL waits
        self._sampled_phase: _Phase | None = None
        self._best: _Frames = ()
        self._votes: dict[tuple[CodeType, int] | None, int] = {}  # innermost frame: samples
        self._reported_live = False

    # -- from the loop thread -----------------------------------------------------------

    def reset(self, loop_ident: int, loop_times: _ThreadTimes) -> None:
        """Prepare to watch the thread *loop_ident*: call on it, before the thread starts."""
        self._loop_ident = loop_ident
        self._loop_times = loop_times
        if self._pressure is None:
            self._pressure = CpuPressure()  # closed when the watch ends
        self._busy_samples.clear()
        self._starved.clear()
        self._sample_loop_busy()  # a base for stalls before the watchdog's first tick
        self._stop.clear()

    def stop(self) -> None:
        """Ask :meth:`watch` to finish; a nap ends at once. Safe from any thread."""
        self._stop.set()
        if self._activity is not None:
            self._activity.woken.set()  # ends a resting nap at once

    # -- the watchdog thread ------------------------------------------------------------

    def watch(self, watching: Callable[[], object]) -> None:
        """The thread's body: calls *watching* once measuring, returns after :meth:`stop`.

        Finishes the overruns still pending on the way out, and calls *watching* again,
        in case the loop is still waiting for it. Never raises: a failure is logged and
        ends the watch.
        """
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
            if self._pressure is not None:
                self._pressure.close()
                self._pressure = None
            self.alive = False
            with suppress(trio.RunFinishedError):
                watching()  # again, in case the loop is still waiting for it

    def _nap(self) -> float | None:
        """Sleep one poll; returns the seconds asked for, or ``None`` once stopped.

        The nap lasts until the loop's current phase could first count as a stall, at
        least ``poll_s`` and at most ``threshold_s``. Why: every wake-up takes the GIL
        from the loop thread, which on a busy loop is a forced switch that costs it two
        OS wake-ups (docs/performance.md, "History": "Where one process stopped"). A
        loop that runs short steps is never close to a stall, so the watchdog wakes
        every ``threshold_s`` instead of every ``poll_s``, and a phase that does stall
        is still sampled within ``threshold_s + poll_s`` of its start, as before.

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

    def _sample_loop_busy(self) -> None:
        if self._loop_times is not None and (times := self._loop_times.times()) is not None:
            pressure = self._pressure.total() if self._pressure is not None else None
            self._busy_samples.append((_clock(), *times, pressure))

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
        duration = overrun.ended - began
        busy, waiting, pressure = self._shares(began, overrun.ended, overrun.loop_times)
        cause: StallCause = "loop"
        if (
            waiting is not None
            and waiting >= _WAITING
            and duration * (1 - waiting) < self._threshold_s
        ):
            cause = "contention"  # ready to run, no CPU: without the wait, no stall
        elif kind == _IO:
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
            duration_s=duration,
            task=_phase_name(phase),
            stack=tuple(_format_frame(code, line) for code, line in frames),
            cause=cause,
            sampled=sampled,
            loop_busy_fraction=busy,
            cpu_wait_fraction=waiting,
            cpu_pressure=pressure,
        )
        self._store(record)
        if record.duration_s >= self._log_after_s:
            logger.warning(
                "event loop stalled %.3f s (%s; loop thread busy %s, waiting for a CPU %s) "
                "in %s at %s",
                record.duration_s,
                cause,
                "?" if busy is None else f"{busy:.0%}",
                "?" if waiting is None else f"{waiting:.0%}",
                record.task,
                record.stack[-1] if record.stack else "?",
            )
        if self._on_stall is not None:
            try:
                self._on_stall(record)
            except Exception:
                logger.exception("on_stall callback failed")

    def _shares(
        self, start: float, end: float, at_end: tuple[float, float | None] | None
    ) -> tuple[float | None, float | None, float | None]:
        """The loop thread's busy share of [start, end] (on a CPU or waiting for one),
        the share of it spent waiting for a CPU, and the host's CPU pressure: each from
        the latest sample ≤ start to *at_end* (the loop's times when the stall ended) or,
        for the pressure, to now. None where unknown."""
        if at_end is None:
            return None, None, None
        base: _Sample | None = None
        for sample in reversed(self._busy_samples):
            base = sample
            if sample[0] <= start:
                break
        if base is None or end - base[0] <= 0:
            return None, None, None
        t0, cpu0, queued0, pressure0 = base
        cpu, queued = at_end
        waited = None if queued is None or queued0 is None else queued - queued0
        busy = (cpu - cpu0 + (waited or 0.0)) / (end - t0)
        waiting = None if waited is None or end <= start else waited / (end - start)
        pressure = None
        now_total = self._pressure.total() if self._pressure is not None else None
        if pressure0 is not None and now_total is not None and (now := _clock()) > t0:
            pressure = _clamp((now_total - pressure0) / (now - t0))
        return _clamp(busy), None if waiting is None else _clamp(waiting), pressure

    def _starved_fraction(self, start: float, end: float) -> float:
        """Share of [start, end] during which the watchdog waited for the GIL."""
        if end <= start:
            return 0.0
        total = sum(
            max(0.0, min(late_end, end) - max(late_start, start))
            for late_start, late_end in self._starved
        )
        return total / (end - start)


def _clamp(share: float) -> float:
    return min(1.0, max(0.0, share))


class _ThreadTimes:
    """How one thread spent its time, readable from any thread.

    Linux ``/proc/self/task/<tid>/schedstat`` (``pread`` on a kept descriptor, ~2 µs)
    gives time on a CPU and time runnable in the run queue; elsewhere the thread CPU
    clock (``time.pthread_getcpuclockid``) gives CPU time only. Methods raise ``OSError``
    if the thread is gone. The watchdog reads the loop thread's and its own; the tracker
    reads the loop thread's :meth:`times` once per overrun, on the loop thread.
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

    def times(self) -> tuple[float, float | None] | None:
        """Seconds on a CPU, and runnable waiting for one (None without schedstat)."""
        if self._fd is not None:
            return self._schedstat()
        if self._cpu_clock is not None:
            return time.clock_gettime(self._cpu_clock), None
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
    source = _source_line(code.co_filename, line)
    return f"{where}: {source}" if source else where


@functools.lru_cache(maxsize=4096)
def _source_line(filename: str, line: int) -> str:
    """Line *line* of *filename*, stripped; "" when it cannot be read.

    Not ``linecache``: it keeps every file it was asked about, whole, for the life of
    the process, and the stacks of a long-running process's stalls name file after
    file (trio's, httpx's, h11's...): a worker's memory rose ~1 MiB every ten minutes
    of a soak with it (docs/reliability.md). Here one line is kept per place named,
    4096 at most, each read once.
    """
    try:
        with open(filename, encoding="utf-8", errors="replace") as source:
            for number, text in enumerate(source, 1):
                if number == line:
                    return text.strip()
    except OSError:  # "<string>", a file gone since
        pass
    return ""


@functools.lru_cache(maxsize=1024)
def _short_path(filename: str) -> str:
    """``filename`` relative to the longest ``sys.path`` entry holding it."""
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or os.curdir) + os.sep
        if filename.startswith(root) and len(root) > len(best):
            best = root
    return filename[len(best) :]
