"""A server's event-loop delay, RSS and CPU over time, sampled at 4 Hz during a run.

Why from ``/metrics``: both servers export the canary histogram
(``<prefix>event_loop_delay_seconds``), so one sampler serves headwater and Dynamo
alike. Each poll takes a snapshot; the difference between two consecutive snapshots
holds the canary's observations of that interval, from which :func:`timeline_points`
derives a per-interval p99 (Prometheus-style interpolation) and a per-interval maximum
(the upper bound of the highest bucket that gained observations: the histogram cannot
say more). Polling itself costs the server a ``/metrics`` render per 250 ms.

:func:`sample` is the trio shell (run it beside the load; cancel it when the load ends);
:func:`timeline_points` is pure, so it is tested on synthetic snapshots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

import trio

from scripts.bench.scrape import Histogram, LoopSnapshot, ProcSample, read_proc, scrape_loop

DEFAULT_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class RawSample:
    """One poll: seconds since the run started, the loop metrics and the frontend's /proc."""

    t_s: float
    loop: LoopSnapshot | None  # None when the scrape failed (a stalled server answers late)
    proc: ProcSample | None


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """One interval (ending at ``t_s``) of a run; ``None`` where nothing was observed."""

    t_s: float
    loop_samples: int  # canary observations in the interval (~25 at 100 Hz)
    loop_p99_ms: float | None
    loop_max_ms: float | None  # upper bound of the highest bucket hit (inf: above the last)
    rss_mb: float | None
    cpu_pct: float | None  # frontend process, % of one core over the interval

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "t_s": round(self.t_s, 3),
            "loop_samples": self.loop_samples,
            "loop_p99_ms": _round(self.loop_p99_ms),
            "loop_max_ms": _round(self.loop_max_ms),
            "rss_mb": _round(self.rss_mb),
            "cpu_pct": _round(self.cpu_pct),
        }


def _round(value: float | None) -> float | None:
    if value is None or math.isinf(value):
        return value
    return round(value, 3)


def highest_bucket(delta: Histogram) -> float | None:
    """Upper bound of the highest bucket that gained observations in *delta*, or None."""
    previous = 0.0
    top: float | None = None
    for le, cumulative in delta.buckets:
        if cumulative > previous:
            top = le
        previous = cumulative
    return top


def timeline_points(samples: list[RawSample]) -> list[TimelinePoint]:
    """Per-interval figures between consecutive samples (pure; see the module docstring).

    An interval whose start or end scrape failed is merged into the next good one.
    """
    points: list[TimelinePoint] = []
    last_loop: RawSample | None = None
    last_proc: RawSample | None = None
    for s in samples:
        p99 = top = None
        count = 0
        if s.loop is not None and s.loop.delay is not None:
            if last_loop is not None and last_loop.loop is not None and last_loop.loop.delay:
                delta = s.loop.delay.minus(last_loop.loop.delay)
                count = int(delta.count)
                if count > 0:
                    p99 = delta.quantile(0.99)
                    top = highest_bucket(delta)
            last_loop = s
        cpu = rss = None
        if s.proc is not None:
            rss = s.proc.rss_bytes / 2**20
            if last_proc is not None and last_proc.proc is not None:
                dt = s.proc.taken_at - last_proc.proc.taken_at
                if dt > 0:
                    cpu = 100 * (s.proc.cpu_s - last_proc.proc.cpu_s) / dt
            last_proc = s
        if s is samples[0]:
            continue  # the first poll only opens the first interval
        points.append(
            TimelinePoint(
                t_s=s.t_s,
                loop_samples=count,
                loop_p99_ms=None if p99 is None else p99 * 1e3,
                loop_max_ms=None if top is None else top * 1e3,
                rss_mb=rss,
                cpu_pct=cpu,
            )
        )
    return points


async def sample(
    metrics_url: str,
    prefix: str,
    pid: int,
    t0: float,
    out: list[RawSample],
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> NoReturn:
    """Append a :class:`RawSample` to *out* every *interval_s* until cancelled.

    *t0* is the ``trio.current_time()`` the samples are timed from. Scrapes run in a
    worker thread with a short timeout; a failed one is recorded as ``loop=None``.
    Ticks keep their schedule (a slow scrape delays only its own sample).
    """
    tick = trio.current_time()
    while True:
        try:
            loop = await trio.to_thread.run_sync(scrape_loop, metrics_url, prefix, 2.0)
        except (OSError, ValueError):
            loop = None
        try:
            proc = read_proc(pid)
        except ProcessLookupError:
            proc = None
        out.append(RawSample(trio.current_time() - t0, loop, proc))
        tick += interval_s
        await trio.sleep_until(max(tick, trio.current_time()))
