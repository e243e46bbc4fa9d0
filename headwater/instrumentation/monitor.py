"""One object that watches a process's event loop: canary, stall detector, GC pauses and
metrics.

Both the frontend and the workers start one :class:`LoopMonitor` in their top-level
nursery; ``--no-instrument`` maps to ``enabled=False``, which keeps the cheap canary (and
its metrics) but installs no trio instrument and starts no watchdog thread.

Given the process's :class:`~headwater.instrumentation.activity.Activity`, canary and
watchdog rest (10 Hz instead of 100 Hz) while no request is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio
from prometheus_client import CollectorRegistry

from headwater.instrumentation.activity import Activity
from headwater.instrumentation.attribution import StallLog
from headwater.instrumentation.canary import DelaySeries, loop_clock, run_canary
from headwater.instrumentation.gc_pauses import timing_gc
from headwater.instrumentation.loop_metrics import LoopMetrics
from headwater.instrumentation.stalls import StallDetector, StallRecord, StallStatistics


class LoopMonitor:
    """Canary + stall detector + GC pauses + :class:`LoopMetrics` for the loop that runs
    :meth:`run`.

    Args:
      registry: where the metrics go; ``None`` creates a fresh registry (see
        ``monitor.metrics.registry``).
      prefix: metric name prefix, e.g. ``"headwater_frontend_"``.
      threshold_s: a loop delay above this is a stall, for the canary and the detector.
      enabled: ``False`` runs only the canary: no instrument, no watchdog thread.
      canary_interval_s: how long the canary asks to sleep.
      max_records: stall records kept.
      on_stall: also called with each stall record, on the watchdog thread (see
        :class:`StallDetector`).
      activity: the process's work in flight (the caller marks each request with
        ``with monitor.activity:``); ``None`` never rests.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None,
        prefix: str,
        threshold_s: float = 0.020,
        enabled: bool = True,
        *,
        canary_interval_s: float = 0.010,
        max_records: int = 200,
        on_stall: Callable[[StallRecord], object] | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.metrics = LoopMetrics(registry, prefix)
        self.series = DelaySeries()
        #: The stalls the canary saw, for stall-aware attribution.
        self.stall_log = StallLog()
        self.threshold_s = threshold_s
        self.enabled = enabled
        self._canary_interval_s = canary_interval_s
        self._on_stall = on_stall
        self.activity = activity
        self.detector: StallDetector | None = (
            StallDetector(
                threshold_s=threshold_s,
                # Half the threshold still samples every stall while it lasts; waking
                # more often costs the loop GIL hand-offs (docs/observability.md).
                poll_s=threshold_s / 2,
                max_records=max_records,
                on_stall=self._stalled,
                activity=activity,
            )
            if enabled
            else None
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the current loop until cancelled; reports started once everything runs.

        Cancellation: the detector removes its instrument and joins its thread, and the
        GC hook is removed.
        """
        if self.activity is not None:
            self.activity.use_clock(loop_clock())  # the canary's: trio's under a MockClock
        with timing_gc(self.metrics):
            async with trio.open_nursery() as nursery:
                if self.detector is not None:
                    await nursery.start(self.detector.run)
                await nursery.start(
                    partial(
                        run_canary,
                        self.metrics,
                        interval=self._canary_interval_s,
                        threshold=self.threshold_s,
                        series=self.series,
                        activity=self.activity,
                        stall_log=self.stall_log,
                    )
                )
                task_status.started()

    def records(self) -> list[StallRecord]:
        """Stall records, oldest first; empty when not enabled."""
        return self.detector.records() if self.detector is not None else []

    def statistics(self) -> StallStatistics | None:
        """The detector's counters, or ``None`` when not enabled."""
        return self.detector.statistics() if self.detector is not None else None

    def recent_delays(self, now: float | None = None) -> list[tuple[float, float]]:
        """``(bucket start unix seconds, max delay seconds)`` over the last minute."""
        return self.series.recent(now)

    def _stalled(self, record: StallRecord) -> None:
        self.metrics.count_stall_record(record.cause)
        if self._on_stall is not None:
            self._on_stall(record)
