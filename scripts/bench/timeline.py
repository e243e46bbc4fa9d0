"""A server's event-loop delay, RSS and CPU over time, sampled at 4 Hz during a run.

Why from ``/metrics``: both servers export the canary histogram
(``<prefix>event_loop_delay_seconds``), so one sampler serves headwater and Dynamo
alike. Each poll takes a snapshot; the difference between two consecutive snapshots
holds the canary's observations of that interval, from which :func:`timeline_points`
derives a per-interval p99 (Prometheus-style interpolation) and a per-interval maximum
(the upper bound of the highest bucket that gained observations: the histogram cannot
say more). Polling itself costs the server a request per 250 ms: the loop series only,
over one kept-alive connection per member (:class:`~scripts.bench.scrape.LoopScraper`),
which keeps the sampler out of the loop delay it samples.

A frontend of several processes (``headwater serve --processes N``) is sampled member
by member, each on its own URL, and merged per poll (:func:`merge_snapshots`,
:func:`sum_samples`): the histograms add up, so a point's p99 is that of every
member's canary together and its maximum the worst member's; RSS and CPU are the sum
over the supervisor and the members. A poll in which any member did not answer counts
as failed, so that no interval compares different sets of members.

:func:`sample` is the trio shell (run it beside the load; set its event when the load ends);
:func:`timeline_points` and the merges are pure, so they are tested on synthetic
snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from scripts.bench.scrape import Histogram, LoopScraper, LoopSnapshot, ProcSample, read_proc

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
    rss_mb: float | None  # the frontend's processes together
    cpu_pct: float | None  # the frontend's processes together, % of one core

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


# --- merging the processes of one frontend -----------------------------------------------


def _cumulative_at(hist: Histogram, le: float) -> float:
    """Observations ≤ *le* as far as *hist*'s own bounds tell (its largest bound ≤ le)."""
    count = 0.0
    for bound, cumulative in hist.buckets:
        if bound > le:
            break
        count = cumulative
    return count


def merge_histograms(hists: Sequence[Histogram]) -> Histogram:
    """The histogram of every observation of *hists* together (pure).

    Buckets add up by upper bound. The frontend's processes share one layout; were
    they to differ, each bound of the union counts what each histogram holds at or
    below it (a lower bound within a bucket it does not have). Raises ValueError for
    no histograms.
    """
    if not hists:
        raise ValueError("nothing to merge")
    if len(hists) == 1:
        return hists[0]
    bounds = sorted({le for h in hists for le, _ in h.buckets})
    return Histogram(
        tuple((le, sum(_cumulative_at(h, le) for h in hists)) for le in bounds),
        sum(h.count for h in hists),
        sum(h.sum for h in hists),
    )


def merge_snapshots(snapshots: Sequence[LoopSnapshot | None]) -> LoopSnapshot | None:
    """One snapshot of several event loops taken at about the same moment (pure).

    Histograms add up (see :func:`merge_histograms`), stall counters add up, and the
    max-delay gauge is the largest: a loop-max figure derived from the merge is the
    worst member's. ``None`` if any snapshot is missing (a member that did not answer:
    comparing different sets of members would make counters jump) or there are none.
    A figure no member exports stays ``None``.
    """
    if not snapshots or any(s is None for s in snapshots):
        return None
    snaps = [s for s in snapshots if s is not None]
    if len(snaps) == 1:
        return snaps[0]
    delays = [s.delay for s in snaps if s.delay is not None]
    maxes = [s.max_delay_s for s in snaps if s.max_delay_s is not None]
    stalls = [s.stalls for s in snaps if s.stalls is not None]
    return LoopSnapshot(
        taken_at=max(s.taken_at for s in snaps),
        delay=merge_histograms(delays) if delays else None,
        max_delay_s=max(maxes) if maxes else None,
        stalls=sum(stalls) if stalls else None,
    )


def sum_samples(samples: Sequence[ProcSample | None]) -> ProcSample | None:
    """The processes of one frontend as one: CPU, RSS, peak RSS, PSS and USS added up
    (pure; PSS and USS only when every sample has them).

    The pid is the first sample's, the time the latest. ``None`` if any process is
    missing (gone, or not read) or there are none: a sum over fewer processes than
    the last one would read as a drop.
    """
    if not samples or any(s is None for s in samples):
        return None
    ps = [s for s in samples if s is not None]
    if len(ps) == 1:
        return ps[0]
    return ProcSample(
        pid=ps[0].pid,
        taken_at=max(s.taken_at for s in ps),
        cpu_s=sum(s.cpu_s for s in ps),
        rss_bytes=sum(s.rss_bytes for s in ps),
        peak_rss_bytes=sum(s.peak_rss_bytes for s in ps),
        pss_bytes=_sum_or_none([s.pss_bytes for s in ps]),
        uss_bytes=_sum_or_none([s.uss_bytes for s in ps]),
    )


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    """The sum, or ``None`` if any is missing (a partial sum would read as a drop)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


# --- per-interval figures -------------------------------------------------------------------


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
    metrics_urls: Sequence[str],
    prefix: str,
    pids: Sequence[int],
    t0: float,
    out: list[RawSample],
    done: trio.Event,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> None:
    """Append a :class:`RawSample` to *out* every *interval_s* until *done* is set, then
    one last one, so that a run shorter than one interval still has one.

    *metrics_urls* are the frontend's processes' ``/metrics`` (one each) and *pids* the
    processes whose CPU and RSS are summed (see the module docstring). *t0* is the
    ``trio.current_time()`` the samples are timed from. Scrapes run in worker threads,
    the members' side by side, with a short timeout; a failed one makes the poll's
    ``loop`` ``None``. Ticks keep their schedule (a slow scrape delays only its own
    sample).
    """
    scrapers = [LoopScraper(url, prefix, timeout=2.0) for url in metrics_urls]
    try:
        tick = trio.current_time()
        while True:
            await _take(scrapers, pids, t0, out)
            if done.is_set():
                return
            tick += interval_s
            with trio.move_on_at(max(tick, trio.current_time())):
                await done.wait()
    finally:
        for scraper in scrapers:
            scraper.close()


async def _take(
    scrapers: Sequence[LoopScraper], pids: Sequence[int], t0: float, out: list[RawSample]
) -> None:
    loops: list[LoopSnapshot | None] = [None] * len(scrapers)
    async with trio.open_nursery() as nursery:
        for i, scraper in enumerate(scrapers):
            nursery.start_soon(_scrape_into, loops, i, scraper)
    procs: list[ProcSample | None] = []
    for pid in pids:
        try:
            procs.append(read_proc(pid))
        except ProcessLookupError:
            procs.append(None)
    out.append(RawSample(trio.current_time() - t0, merge_snapshots(loops), sum_samples(procs)))


async def _scrape_into(out: list[LoopSnapshot | None], index: int, scraper: LoopScraper) -> None:
    try:
        out[index] = await trio.to_thread.run_sync(scraper.scrape)
    except (OSError, ValueError):
        out[index] = None
