"""Worker health: a circuit per worker, with hysteresis both ways.

A worker is *healthy* (the circuit is closed) until it fails ``inhibit_after``
requests in a row; one slow moment does not eject it. Then it is *inhibited* (open):
it gets no requests, and after a backoff it is *probed* (half-open): the router asks
it for its counters over the plane (``WorkerClient.probe``), ``recover_after`` times
in a row, ``probe_interval`` apart; all of them answered, it is healthy again; one
unanswered, it is inhibited again with the backoff doubled (up to ``probe_backoff_max``,
each delay shortened by up to ``probe_jitter`` at random so that frontends that lost
the same worker do not probe it in lockstep)::

    healthy ──(inhibit_after faults in a row)──▶ inhibited ──(backoff)──▶ probing
       ▲                                             ▲                       │
       └──────────(recover_after probes answered)────┼───────────────────────┤
                                                     └──(a probe unanswered)─┘

Only the worker's own faults count (:meth:`Circuit.failure` is called for them by
dispatch): no connection or no ACK, a stream that broke, an internal error. A request
the worker refuses as invalid, a busy or draining worker, a KV pull that failed
because of the *prefill* worker, and a miss excused by the frontend's own stalled loop
never move the circuit. Draining (announced by discovery) is separate: a draining
worker gets no new requests whatever its circuit says.

Dynamo brings a failed worker back after a fixed 5 s, with no hysteresis; SGLang's
gateway opens after 10 failures and closes after 3 successes, over 60 s. The defaults
here (:class:`HealthConfig`) react faster to a dead worker and still ride out one
missed ACK; docs/fault-tolerance.md compares them.

Pure bookkeeping: no I/O, no trio; times are passed in (trio's clock in the router).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from headwater.config_fields import option, positive_float, positive_int


class WorkerState(enum.StrEnum):
    HEALTHY = "healthy"
    INHIBITED = "inhibited"
    PROBING = "probing"
    DRAINING = "draining"
    REMOVED = "removed"  # only as the end of a transition: the worker left the router


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """When a worker is taken out of routing and how it comes back. The fields with a
    help are ``headwater serve`` options (headwater/config_fields.py)."""

    inhibit_after: int = option(
        2,
        type=positive_int,
        help="consecutive faults (no ACK, a broken stream) that take a worker out of routing",
    )
    #: Doubles each time a probe fails.
    probe_backoff: float = option(
        1.0,
        type=positive_float,
        help="seconds before an inhibited worker is first probed; doubles each time a "
        "probe goes unanswered",
    )
    probe_backoff_max: float = option(
        30.0, type=positive_float, help="upper bound of the probe backoff (s)"
    )
    #: Each delay is shortened by up to this fraction at random.
    probe_jitter: float = 0.2
    recover_after: int = option(
        2, type=positive_int, help="probes in a row a worker must answer to take requests again"
    )
    #: Seconds between the probes of a worker that is being probed.
    probe_interval: float = 0.5
    #: Seconds a probe may take before it counts as unanswered.
    probe_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.inhibit_after < 1 or self.recover_after < 1:
            raise ValueError("inhibit_after and recover_after must be at least 1")
        if not 0 < self.probe_backoff <= self.probe_backoff_max:
            raise ValueError("need 0 < probe_backoff <= probe_backoff_max")
        if not 0 <= self.probe_jitter < 1:
            raise ValueError("probe_jitter must be in [0, 1)")
        if self.probe_interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("probe_interval and probe_timeout must be positive")


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of a worker's state, with why."""

    old: WorkerState
    new: WorkerState
    reason: str


class Circuit:
    """One worker's circuit; see the module docstring. ``state`` is never DRAINING or
    REMOVED: those are the router's."""

    __slots__ = (
        "_config",
        "_opens",
        "_rng",
        "failures",
        "probe_at",
        "reason",
        "state",
        "successes",
    )

    def __init__(self, config: HealthConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng
        self.state = WorkerState.HEALTHY
        self.failures = 0  # consecutive faults while healthy
        self.successes = 0  # consecutive answered probes while probing
        self._opens = 0  # times opened since it was last healthy: the backoff's exponent
        self.probe_at = 0.0  # when the next probe is due (inhibited or probing)
        self.reason: str | None = None  # why the last transition happened

    def success(self) -> None:
        """A request was served to the end: the faults in a row start again from zero."""
        if self.state is WorkerState.HEALTHY:
            self.failures = 0

    def failure(self, now: float, reason: str) -> Transition | None:
        """The worker failed a request; returns the transition if that opened the circuit."""
        if self.state is not WorkerState.HEALTHY:
            return None  # already out of routing: its in-flight requests finish failing
        self.failures += 1
        if self.failures < self._config.inhibit_after:
            return None
        return self._open(now, f"{self.failures} faults in a row, last: {reason}")

    def due(self, now: float) -> bool:
        """A probe should start now."""
        return self.state in (WorkerState.INHIBITED, WorkerState.PROBING) and now >= self.probe_at

    def probing(self, now: float) -> Transition | None:
        """A probe starts; the first one moves an inhibited worker to probing."""
        if self.state is WorkerState.INHIBITED:
            return self._to(WorkerState.PROBING, "backoff elapsed: probing")
        return None

    def probe_answered(self, now: float) -> Transition | None:
        """A probe came back; enough of them in a row close the circuit."""
        if self.state is not WorkerState.PROBING:
            return None
        self.successes += 1
        if self.successes < self._config.recover_after:
            self.probe_at = now + self._config.probe_interval
            return None
        self.failures = self.successes = self._opens = 0
        return self._to(WorkerState.HEALTHY, f"{self._config.recover_after} probes answered")

    def probe_failed(self, now: float, reason: str) -> Transition | None:
        """A probe went unanswered: inhibited again, with a longer backoff."""
        if self.state is not WorkerState.PROBING:
            return None
        return self._open(now, f"probe unanswered: {reason}")

    def _open(self, now: float, reason: str) -> Transition:
        cfg = self._config
        delay = min(cfg.probe_backoff_max, cfg.probe_backoff * 2.0**self._opens)
        self._opens += 1
        self.probe_at = now + delay * (1 - cfg.probe_jitter * self._rng.random())
        self.successes = 0
        return self._to(WorkerState.INHIBITED, reason)

    def _to(self, state: WorkerState, reason: str) -> Transition:
        old, self.state, self.reason = self.state, state, reason
        return Transition(old, state, reason)
