"""What one stall leaves behind: :class:`StallRecord`, a frozen value of no thread.

The watchdog thread builds each record (:mod:`headwater.instrumentation.watchdog`); the
detector keeps it and hands it out on the loop thread
(:mod:`headwater.instrumentation.stalls`, which re-exports it). It lives in a module of
its own, importing nothing of either, so that both can import it without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headwater.instrumentation.loop_metrics import StallCause


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
      cause: ``"loop"`` (the loop thread was busy or blocked in a call), ``"gil"``
        (it could not run because another thread held the GIL) or ``"contention"`` (it
        was ready to run but waited for a CPU: the host's other work, not this code).
      sampled: ``True`` when ``stack`` was sampled during the stall; ``False`` when it
        is where the task next awaited (the watchdog was frozen throughout), or empty
        if the task ended in that step.
      loop_busy_fraction: share of the stall the loop thread was running or runnable
        (rather than asleep in a blocking call or waiting for the GIL); ``None`` where
        the platform cannot tell.
      cpu_wait_fraction: share of the stall the loop thread was runnable but waited for
        a CPU (in the kernel's run queue); ``None`` where the platform cannot tell.
      cpu_pressure: share of the time around the stall during which some task of the
        host waited for a CPU (the kernel's CPU pressure); ``None`` without it.
    """

    started_at: float
    duration_s: float
    task: str
    stack: tuple[str, ...]
    cause: StallCause
    sampled: bool
    loop_busy_fraction: float | None
    cpu_wait_fraction: float | None = None
    cpu_pressure: float | None = None

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
            "cpu_wait_fraction": self.cpu_wait_fraction,
            "cpu_pressure": self.cpu_pressure,
        }
