"""Prometheus metrics for the health of one process's event loop.

The frontend exports them with the prefix ``headwater_frontend_``, each worker with
``headwater_worker_``; the names after the prefix match NVIDIA Dynamo's
(``event_loop_delay_seconds``, ``event_loop_stall_total``) so dashboards compare.

Every :class:`LoopMetrics` registers into its own :class:`CollectorRegistry` (never the
process-global one), so tests and several components in one process can each own one.
prometheus-client metrics are thread-safe: the stall watchdog thread may count records.
"""

from __future__ import annotations

from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from headwater.instrumentation.exposition import TextExposition

FRONTEND_PREFIX: Final = "headwater_frontend_"
WORKER_PREFIX: Final = "headwater_worker_"

#: Seconds. Canary overshoots are ~0.1–1 ms on a healthy loop; the upper buckets catch
#: the multi-second stalls that made Dynamo mark healthy workers down (5 s timeout).
DELAY_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Seconds. A collection over a few thousand objects takes well under 1 ms; one over
#: tens of thousands (a rare young one, a full one) tens of ms, past the stall threshold.
GC_PAUSE_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
GC_GENERATIONS: Final = ("0", "1", "2")

StallCause = Literal["loop", "gil", "contention"]
STALL_CAUSES: Final[tuple[StallCause, ...]] = ("loop", "gil", "contention")


class LoopMetrics:
    """The loop-health metrics of one process, in a registry of their own: the canary's
    delays, the stall records, and the garbage collector's pauses (which stop the loop).

    Args:
      registry: where to register; ``None`` creates a fresh :class:`CollectorRegistry`.
      prefix: prepended to every name, e.g. :data:`FRONTEND_PREFIX`.

    Raises:
      ValueError: if ``prefix`` makes an invalid metric name, or the registry already
        holds these names (one :class:`LoopMetrics` per registry and prefix).
    """

    def __init__(self, registry: CollectorRegistry | None, prefix: str) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prefix = prefix
        self.delay = Histogram(
            f"{prefix}event_loop_delay_seconds",
            "How late the event loop woke a 10 ms sleep (observed minus requested).",
            buckets=DELAY_BUCKETS,
            registry=self.registry,
        )
        self.max_delay = Gauge(
            f"{prefix}event_loop_max_delay_seconds",
            "Largest event loop delay seen since the process started.",
            registry=self.registry,
        )
        self.stalls = Counter(
            f"{prefix}event_loop_stall_total",
            "Canary wake-ups later than the stall threshold.",
            registry=self.registry,
        )
        self.stall_records = Counter(
            f"{prefix}stall_records_total",
            "Stalls recorded by the watchdog, by cause: loop (a blocking call on the loop),"
            " gil (another thread held the GIL) or contention (the loop waited for a CPU).",
            labelnames=("cause",),
            registry=self.registry,
        )
        for cause in STALL_CAUSES:
            self.stall_records.labels(cause=cause)  # export zeros before the first stall
        self.gc_pause = Histogram(
            f"{prefix}gc_pause_seconds",
            "How long each collection of Python's cyclic GC held the process, by generation.",
            labelnames=("generation",),
            buckets=GC_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.gc_max_pause = Gauge(
            f"{prefix}gc_max_pause_seconds",
            "Longest collection of Python's cyclic GC seen while the monitor ran.",
            registry=self.registry,
        )
        self._gc_pause_by_generation = {
            int(g): self.gc_pause.labels(generation=g) for g in GC_GENERATIONS
        }
        self._max_delay_s = 0.0
        self._max_gc_pause_s = 0.0

    @property
    def max_delay_s(self) -> float:
        """The largest delay observed so far, in seconds."""
        return self._max_delay_s

    def observe_delay(self, seconds: float, *, stalled: bool) -> None:
        """Record one canary overshoot; ``stalled`` counts it as a stall too."""
        self.delay.observe(seconds)
        if seconds > self._max_delay_s:
            self._max_delay_s = seconds
            self.max_delay.set(seconds)
        if stalled:
            self.stalls.inc()

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        """Record one collection of ``generation`` (0-2) that took ``seconds``. Any thread."""
        self._gc_pause_by_generation[generation].observe(seconds)
        if seconds > self._max_gc_pause_s:
            self._max_gc_pause_s = seconds
            self.gc_max_pause.set(seconds)

    def count_stall_record(self, cause: StallCause) -> None:
        """Count one watchdog stall record. Thread-safe.

        Raises:
          ValueError: for a cause outside :data:`STALL_CAUSES`.
        """
        if cause not in STALL_CAUSES:
            raise ValueError(f"unknown stall cause {cause!r}")
        self.stall_records.labels(cause=cause).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format. Servers render their
        registry through one long-lived :class:`TextExposition` (the frontend's metrics,
        the worker's endpoint); this one-off render keeps no cache."""
        return TextExposition(self.registry).render()
