"""Stall-aware attribution: a deadline missed while our own loop stood still is not the
peer's fault.

This is the seed of the failure headwater exists to prevent: a frontend that stalls
while tokenizing misses its workers' ACKs and heartbeats, marks healthy workers down,
and piles the traffic onto the rest. A frontend that waited ``timeout`` seconds for an
ACK while its loop was stalled for a good part of them did not give the worker that
time: the ACK may be sitting in its socket. So before a missed ACK or heartbeat is
blamed on a worker, the caller asks :meth:`StallAttribution.excuses` whether the loop
was stalled during the window; if so the miss is excused (the request is retried, the
connection kept) and counted (``headwater_frontend_excused_timeouts_total``).

The witness is the loop canary (:mod:`headwater.instrumentation.canary`): every
overshoot above the stall threshold is a stretch of time in which no task of this
loop ran, whatever the cause (the loop's own code, the GIL, or a host with no CPU to
spare: the detector's records tell them apart, an excuse need not), recorded in a
:class:`StallLog` (trio's clock, so it compares with the deadlines that callers set
with ``trio.move_on_after``). A deadline that fires right
as a stall ends may run before the canary has woken to record it, so callers yield
once (``await trio.lowlevel.checkpoint()``) before they ask.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class StallLog:
    """The loop's recent stalls as ``(start, end)`` intervals of trio time."""

    def __init__(self, maxlen: int = 1024) -> None:
        self._stalls: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, end: float, delay: float) -> None:
        """The loop ran no task for *delay* seconds until *end*."""
        self._stalls.append((end - delay, end))

    def intervals(self) -> list[tuple[float, float]]:
        """The stalls kept, oldest first."""
        return list(self._stalls)

    def stalled(self, start: float, end: float) -> float:
        """Seconds of [*start*, *end*] during which the loop was stalled."""
        total = 0.0
        for s, e in reversed(self._stalls):
            if e <= start:
                break  # older ones end earlier still
            total += max(0.0, min(e, end) - max(s, start))
        return total


@dataclass(slots=True)
class StallAttribution:
    """Decides whether a missed deadline is excused; counts the excuses.

    A miss over the window [*start*, *end*] is excused when the loop was stalled for at
    least ``share`` of it (default a quarter: a 5 s ACK timeout is excused after 1.25 s
    of our own stall inside it). ``enabled=False`` (``--no-stall-attribution``) excuses
    nothing, to reproduce the failure. *on_excuse* is called with each excuse (the
    frontend counts them in a metric).
    """

    log: StallLog
    share: float = 0.25
    enabled: bool = True
    on_excuse: Callable[[], object] | None = None
    excused_total: int = 0

    def excuses(self, start: float, end: float) -> bool:
        if not self.enabled or end <= start:
            return False
        if self.log.stalled(start, end) < self.share * (end - start):
            return False
        self.excused_total += 1
        if self.on_excuse is not None:
            self.on_excuse()
        return True
