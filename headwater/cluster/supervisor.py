"""Keeping a process running: a restart policy, and the supervisor of one process.

``headwater launch`` runs each process of its cluster, etcd, every worker and the
frontend alike, as a :class:`Supervised` process: started once, then started again
whenever it exits without being asked to, while the rest of the cluster keeps
serving. The one thing that differs between them is how a process is started, its
*starter*; the recipes (:mod:`headwater.cluster.recipes`) provide those.

The policy (:class:`RestartPolicy`), after Kubernetes' CrashLoopBackOff and
systemd's ``StartLimitBurst`` / ``StartLimitIntervalSec``:

* **backoff**: the n-th restart in a row waits a random time of up to
  ``min(backoff_max, backoff * 2**(n-1))`` seconds, and at least ``backoff / 2``
  (full jitter, :class:`headwater.backoff.Backoff`: processes that died together
  do not come back in lockstep). A process that stayed up for a whole ``window``
  starts over at the first delay.
* **budget**: at most ``budget`` restarts of the process in any ``window``
  seconds. At the exit that would need one more it is given up: ``failure`` says
  which process, how it ended, the restarts used and the end of its log, and the
  *on_give_up* hook is called (``headwater launch`` then stops the cluster).
  ``budget=0``: never restart.
* a restart that does not come up (exits before it is ready, or stays silent past
  its starter's bound) counts as one; the next attempt follows after the next delay.
  If a port it must bind is taken, the reason says so.
* the first start is not retried: its :class:`~headwater.cluster.children.LaunchError`
  is the caller's (a cluster that cannot start is a configuration to fix, not a
  crash to wait out).

Identity: the starter is called with the previous incarnation and must start the
same process again (same worker id, same ports, same data directory), so that
whoever knew it (a frontend's ``--workers`` list, an etcd key, a client's URL)
still finds it. Every incarnation appends to the same log file, after a separator
line that says which restart it is and why.

Ownership: :meth:`Supervised.run` is one task, started with ``nursery.start`` (it
reports the first incarnation once that is ready). Each incarnation lives in a
nursery of its own inside that task, so cancelling it kills whatever incarnation
is up (the watcher in :mod:`headwater.cluster.children` does). :meth:`Supervised.stop`
is the orderly end: no more restarts, the current incarnation stopped (SIGTERM,
SIGKILL after the grace), ``run`` returned.

:class:`RestartBudget` is the decision alone, without I/O: time is passed in.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import trio

from headwater.backoff import Backoff
from headwater.cluster.children import (
    KILL_TIMEOUT,
    LaunchError,
    append_to_log,
    describe_status,
)
from headwater.config_fields import non_negative_int, option, positive_float
from headwater.ports import port_free

log = logging.getLogger(__name__)

_LOG_TAIL = 1500  # characters of its log quoted when a process is given up


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to restart a process that exited on its own, and when to give up on it.

    Its fields are the ``--restart-*`` options of ``headwater launch`` and ``serve``
    (headwater/config_fields.py). Raises ValueError for values that make no sense.
    """

    backoff: float = option(
        0.5,
        flags=("--restart-backoff",),
        type=positive_float,
        help="seconds before a process that exited is restarted: a random delay between "
        "half of this and this, whose upper bound doubles with each restart in a row",
    )
    backoff_max: float = option(
        10.0,
        flags=("--restart-backoff-max",),
        type=positive_float,
        help="the highest that upper bound goes (s)",
    )
    budget: int = option(
        5,
        flags=("--restart-budget",),
        type=non_negative_int,
        help="restarts allowed per process within --restart-window; its next exit stops "
        "the supervisor and every process it runs (0: never restart)",
    )
    window: float = option(
        60.0,
        flags=("--restart-window",),
        type=positive_float,
        help="seconds over which restarts are counted; a process up this long starts "
        "over at the first delay",
    )

    def __post_init__(self) -> None:
        if not self.backoff > 0:
            raise ValueError(f"--restart-backoff must be > 0 s, got {self.backoff:g}")
        if not self.backoff_max >= self.backoff:
            raise ValueError(
                f"--restart-backoff-max ({self.backoff_max:g} s) must be at least "
                f"--restart-backoff ({self.backoff:g} s)"
            )
        if self.budget < 0:
            raise ValueError(f"--restart-budget must be >= 0, got {self.budget}")
        if not self.window > 0:
            raise ValueError(f"--restart-window must be > 0 s, got {self.window:g}")

    def describe(self) -> str:
        """``5 restarts per 60 s``."""
        return f"{self.budget} restart{'s' if self.budget != 1 else ''} per {self.window:g} s"


class RestartBudget:
    """One process's restarts under a :class:`RestartPolicy`; no I/O, time passed in.

    *rng* draws the jitter (seed it, or pass one whose ``uniform`` is exact, in tests).
    """

    def __init__(self, policy: RestartPolicy, *, rng: random.Random | None = None) -> None:
        self.policy = policy
        self._backoff = Backoff(policy.backoff, policy.backoff_max, rng=rng)
        self._recent: deque[float] = deque()  # when each restart in the window was decided
        #: Restarts granted since the process first started.
        self.total = 0

    def recent(self, now: float) -> int:
        """Restarts granted in the ``window`` seconds up to *now*."""
        while self._recent and self._recent[0] <= now - self.policy.window:
            self._recent.popleft()
        return len(self._recent)

    def exited(self, now: float, uptime: float) -> float | None:
        """The process ended at *now* after *uptime* seconds up (0: a restart that did
        not come up). Returns the seconds to wait before restarting it, or None when
        the budget is spent (then nothing is counted)."""
        if uptime >= self.policy.window:
            self._backoff.reset()
        if self.recent(now) >= self.policy.budget:
            return None
        self._recent.append(now)
        self.total += 1
        return self._backoff.next()


class Incarnation(Protocol):
    """What :class:`Supervised` needs of one run of a process
    (:class:`~headwater.cluster.children.ChildProcess` is one)."""

    name: str
    log_path: Path | None
    #: Set when someone asked it to stop (stop(), kill()): its exit is no crash.
    stopping: bool

    @property
    def pid(self) -> int: ...

    @property
    def ports(self) -> tuple[int, ...]: ...

    async def wait(self) -> int: ...

    async def stop(self, grace: float) -> int: ...

    def kill(self) -> None: ...

    def log_tail(self, chars: int) -> str: ...


C = TypeVar("C", bound=Incarnation)

#: Starts one incarnation in the nursery given, returns it once ready (LaunchError
#: otherwise). The second argument is the previous incarnation (None the first
#: time): a restart must start the same process (id, ports, data) again.
Starter = Callable[[trio.Nursery, C | None], Awaitable[C]]
#: Called once, with the process, when it is given up.
GiveUpHook = Callable[["Supervised[C]"], None]


@dataclass(frozen=True, slots=True)
class SupervisedStats:
    name: str
    pid: int | None  # the current (or last) incarnation's
    running: bool
    restarts_total: int
    restarts_recent: int  # within the policy's window
    given_up: bool


class Supervised(Generic[C]):
    """One process kept running under *policy*; see the module docstring.

    ``child`` is the latest incarnation that came up (it may have exited since);
    ``failure`` is set, once, when the process is given up.
    """

    def __init__(
        self,
        name: str,
        start: Starter[C],
        policy: RestartPolicy | None = None,
        *,
        on_give_up: GiveUpHook[C] | None = None,
        stop_grace: float = 15.0,  # s after SIGTERM before SIGKILL, for a stop during a restart
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.policy = policy or RestartPolicy()
        self.child: C | None = None
        self.failure: str | None = None
        self.stop_grace = stop_grace
        self._start = start
        self._budget = RestartBudget(self.policy, rng=rng)
        self._on_give_up = on_give_up
        self._stopping = False
        self._running = False
        self._pending: trio.CancelScope | None = None  # a restart's delay or start
        self._ran = False
        self._done = trio.Event()

    def __repr__(self) -> str:
        return f"<Supervised {self.name} {self.child!r}>"

    @property
    def restarts(self) -> int:
        return self._budget.total

    def statistics(self) -> SupervisedStats:
        return SupervisedStats(
            name=self.name,
            pid=self.child.pid if self.child is not None else None,
            running=self._running,
            restarts_total=self._budget.total,
            restarts_recent=self._budget.recent(trio.current_time()),
            given_up=self.failure is not None,
        )

    # -- the owner's side ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[C] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the process, report its first incarnation once ready, and keep it
        running until :meth:`stop` or until it is given up. The first start's
        LaunchError (or OSError) is raised, before anything is reported. May be
        called once."""
        if self._ran:
            raise RuntimeError(f"Supervised({self.name}).run() called twice")
        self._ran = True
        try:
            await self._keep_running(task_status)
        finally:
            self._running = False
            self._done.set()

    def stop_restarting(self) -> None:
        """No more restarts: a pending one is abandoned (a process it was starting is
        killed); the current incarnation keeps running until stopped."""
        self._stopping = True
        if self._pending is not None:
            self._pending.cancel()

    async def stop(self, grace: float | None = None) -> None:
        """Stop restarting and stop the current incarnation (SIGTERM, then SIGKILL after
        *grace* seconds, default ``stop_grace``); returns once :meth:`run` has ended.
        Idempotent."""
        self.stop_restarting()
        if self.child is not None:
            await self.child.stop(self.stop_grace if grace is None else grace)
        if self._ran:
            await self._done.wait()

    def kill(self) -> None:
        """Stop restarting; SIGKILL the current incarnation now."""
        self.stop_restarting()
        if self.child is not None:
            self.child.kill()

    # -- internals -------------------------------------------------------------------------

    async def _keep_running(self, task_status: trio.TaskStatus[C]) -> None:
        previous: C | None = None
        while True:
            ended = await self._incarnation(previous, task_status)
            if ended is None:
                return  # asked to stop
            child, why, uptime = ended
            previous = child or previous
            assert previous is not None  # only a restart can fail to come up
            delay = self._budget.exited(trio.current_time(), uptime)
            if delay is None:
                self._give_up(previous, why)
                return
            log.warning(
                "%s %s; restarting it in %.2f s (restart %d; %d of %s)",
                self.name,
                why,
                delay,
                self._budget.total,
                self._budget.recent(trio.current_time()),
                self.policy.describe(),
            )
            stamp = datetime.now().isoformat(sep=" ", timespec="seconds")
            restart = f"restart {self._budget.total} in {delay:.2f} s"
            append_to_log(previous.log_path, f"----- {stamp} {self.name} {why}: {restart} -----")
            with trio.CancelScope() as self._pending:
                await trio.sleep(delay)
            self._pending = None
            if self._stopping:
                return

    async def _incarnation(
        self, previous: C | None, task_status: trio.TaskStatus[C]
    ) -> tuple[C | None, str, float] | None:
        """Start one incarnation and wait for its end. Returns (it, what ended it, the
        seconds it was up); it is None for a restart that did not come up. Returns
        None when asked to stop. Raises the first start's error."""
        child: C | None = None
        failure: LaunchError | OSError | None = None
        status: int | None = None
        uptime = 0.0
        async with trio.open_nursery() as nursery:
            self._pending = nursery.cancel_scope  # a stop while it starts kills it
            try:
                child = await self._start(nursery, previous)
            except (LaunchError, OSError) as exc:
                failure = exc
            finally:
                self._pending = None
            if child is not None:
                self.child, self._running = child, True
                if previous is None:
                    task_status.started(child)
                else:
                    log.info("%s is back (pid %d)", self.name, child.pid)
                up_at = trio.current_time()
                if self._stopping:  # stop() came while it started, after its last checkpoint
                    await child.stop(self.stop_grace)
                status = await child.wait()
                self._running = False
                uptime = trio.current_time() - up_at
                # Its watcher is done; the stdout copier writes what was left in the pipe.
                nursery.cancel_scope.deadline = trio.current_time() + KILL_TIMEOUT
        if failure is not None:
            if previous is None:
                raise failure
            return None, self._not_back(previous, failure), 0.0
        if child is None or self._stopping or child.stopping:
            return None
        return child, f"exited ({describe_status(status)})", uptime

    def _not_back(self, previous: C, exc: LaunchError | OSError) -> str:
        reason = exc.summary if isinstance(exc, LaunchError) else f"{exc!r}"
        # Checked once the failed incarnation is reaped: a port held now is someone else's.
        taken = [
            f"127.0.0.1:{p} is taken by another process" for p in previous.ports if not port_free(p)
        ]
        return "did not come back: " + "; ".join([reason, *taken])

    def _give_up(self, last: C, why: str) -> None:
        now = trio.current_time()
        recent, total = self._budget.recent(now), self._budget.total
        self.failure = (
            f"{self.name} {why}; giving up on it: restarted {recent} times in the last "
            f"{self.policy.window:g} s, its whole budget ({self.policy.describe()}; "
            f"{total} restarts in all). Last lines of its log {last.log_path}:\n"
            f"{last.log_tail(_LOG_TAIL)}"
        )
        if self._on_give_up is not None:
            try:
                self._on_give_up(self)
            except Exception:  # a supervisor's bug must not take its siblings down
                log.exception("on_give_up hook for %s failed", self.name)
