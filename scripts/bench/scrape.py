"""What the server paid for a run: event-loop health from ``/metrics``, CPU and RSS from ``/proc``.

Take a snapshot before and after the load and subtract: counters and histogram buckets
are cumulative, so the difference belongs to the run alone. The max-delay gauge is not
cumulative; the report takes its value after the run (the frontend defines its window).

Metric names follow ``<prefix>event_loop_delay_seconds`` (histogram),
``<prefix>event_loop_max_delay_seconds`` (gauge) and ``<prefix>event_loop_stall_total``
(counter), with ``prefix="headwater_frontend_"``; Dynamo's frontend uses
``dynamo_frontend_`` and has no max-delay gauge (reported as ``None``). Series with
labels are summed.

Reading ``/proc`` is Linux-only; :func:`read_proc` raises :class:`ProcessLookupError`
once the process is gone.
"""

from __future__ import annotations

import http.client
import math
import os
import time
import urllib.parse
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from headwater.procmem import read_memory
from scripts.bench.loadgen import check_loopback

HEADWATER_PREFIX = "headwater_frontend_"
DYNAMO_PREFIX = "dynamo_frontend_"


# --- /metrics -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts by upper bound (``math.inf`` last), plus count and sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since *earlier* (same bucket layout assumed)."""
        before = dict(earlier.buckets)
        return Histogram(
            tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
            self.count - earlier.count,
            self.sum - earlier.sum,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile``: linear within the bucket holding rank q·count.

        ``None`` without observations; a rank in the +Inf bucket yields the largest finite
        bound (the true value is larger: read it with the max-delay gauge).
        """
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                if cumulative == below:
                    return le
                return lower + (le - lower) * (rank - below) / (cumulative - below)
            lower, below = le, cumulative
        return lower


@dataclass(frozen=True, slots=True)
class LoopSnapshot:
    """The event-loop metrics at one moment; ``None`` where the server exports nothing."""

    taken_at: float  # time.perf_counter()
    delay: Histogram | None
    max_delay_s: float | None
    stalls: float | None


@dataclass(frozen=True, slots=True)
class LoopReport:
    """Event-loop health over a run (between two snapshots)."""

    samples: int  # canary measurements taken during the run
    delay_mean_s: float | None
    delay_p99_s: float | None
    max_delay_s: float | None  # the gauge after the run
    stalls: float | None  # stall counter increase (delays over the server's threshold)


def parse_loop(text: str, prefix: str = HEADWATER_PREFIX) -> LoopSnapshot:
    """Extract the event-loop metrics named ``<prefix>event_loop_*`` from exposition *text*."""
    bucket, count, total, max_name, stall_name = loop_series(prefix)
    buckets: dict[float, float] = {}
    sums: dict[str, float] = {}
    max_delay: float | None = None
    stalls: float | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == bucket:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name in (count, total):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name == max_name:
                max_delay = s.value if max_delay is None else max(max_delay, s.value)
            elif s.name == stall_name:
                stalls = (stalls or 0.0) + s.value
    delay = None
    if buckets:
        histogram = tuple(sorted(buckets.items()))
        delay = Histogram(histogram, sums.get(count, 0.0), sums.get(total, 0.0))
    return LoopSnapshot(time.perf_counter(), delay, max_delay, stalls)


def loop_series(prefix: str = HEADWATER_PREFIX) -> tuple[str, ...]:
    """The sample names :func:`parse_loop` reads (histogram bucket, count, sum; max-delay
    gauge; stall counter), and :func:`loop_url` asks for."""
    delay = prefix + "event_loop_delay_seconds"
    return (
        delay + "_bucket",
        delay + "_count",
        delay + "_sum",
        prefix + "event_loop_max_delay_seconds",
        prefix + "event_loop_stall_total",
    )


def loop_url(url: str, prefix: str = HEADWATER_PREFIX) -> str:
    """*url* (a ``/metrics`` page) asking for :func:`loop_series` only, with ``name[]``
    (a server that ignores the query, as Dynamo's does, sends everything)."""
    query = urllib.parse.urlencode([("name[]", name) for name in loop_series(prefix)])
    return f"{url}{'&' if '?' in url else '?'}{query}"


def scrape_loop(url: str, prefix: str = HEADWATER_PREFIX, timeout: float = 5.0) -> LoopSnapshot:
    """One scrape of the loop series: a :class:`LoopScraper` used once."""
    scraper = LoopScraper(url, prefix, timeout)
    try:
        return scraper.scrape()
    finally:
        scraper.close()


class LoopScraper:
    """Scrapes one server's loop series again and again over one kept-alive connection.

    Why: headwater serves ``/metrics`` on the loop being measured. Sampled at 4 Hz with a
    new connection and a full page each time, it raised the loop p99 of a long c16 run
    from a median of ~7.0 to ~8.5 ms; the loop series over one kept-alive connection read
    6.8 (docs/performance.md, "The observer"). Reconnects once when the server has
    closed the connection. Use from one thread at a time; :meth:`close` when done.
    """

    def __init__(self, url: str, prefix: str = HEADWATER_PREFIX, timeout: float = 2.0) -> None:
        check_loopback(url)
        self._url = loop_url(url, prefix)
        parts = urllib.parse.urlsplit(self._url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._target = f"{parts.path}?{parts.query}"
        self._prefix = prefix
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def scrape(self) -> LoopSnapshot:
        """Raises OSError (no answer, or not 200) or ValueError (not a metrics page)."""
        reused = self._conn is not None
        try:
            status, body = self._get()
        except OSError:
            if not reused:
                raise
            status, body = self._get()  # the server had closed the kept-alive connection
        if status != 200:
            raise OSError(f"HTTP {status} from {self._url}")
        return parse_loop(body.decode(), self._prefix)

    def _get(self) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(*self._address, timeout=self._timeout)
        try:
            self._conn.request("GET", self._target)
            response = self._conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise OSError(f"scrape of {self._url} failed: {exc}") from exc
        if response.will_close:
            self.close()
        return response.status, body

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def loop_report(before: LoopSnapshot, after: LoopSnapshot) -> LoopReport:
    """What happened to the loop between two snapshots of the same server."""
    samples, mean, p99 = 0, None, None
    if after.delay is not None:
        delta = after.delay.minus(before.delay) if before.delay is not None else after.delay
        samples = int(delta.count)
        mean = delta.sum / delta.count if delta.count > 0 else None
        p99 = delta.quantile(0.99)
    stalls = None
    if after.stalls is not None:
        stalls = after.stalls - (before.stalls or 0.0)
    return LoopReport(samples, mean, p99, after.max_delay_s, stalls)


# --- /proc --------------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One process's counters at one moment (from ``/proc/<pid>/stat`` and ``status``)."""

    pid: int
    taken_at: float  # time.perf_counter()
    cpu_s: float  # user + system, this process only (not its children)
    rss_bytes: int
    peak_rss_bytes: int  # VmHWM: high-water mark since the process started
    # From smaps_rollup, when asked (read_proc(memory=True)): shared pages divided among
    # the processes that map them (PSS), and this process's own (USS).
    pss_bytes: int | None = None
    uss_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ProcReport:
    """A process's cost over a run."""

    pid: int
    cpu_s: float
    cpu_pct: float  # of one core over the interval
    peak_rss_bytes: int


def read_proc(pid: int, *, memory: bool = False) -> ProcSample:
    """Sample *pid*; with *memory* also its PSS and USS (``/proc/<pid>/smaps_rollup``: a
    walk of its page tables, so not in the 4 Hz timeline). Raises ProcessLookupError if
    it does not exist (or no longer does)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    # Fields after "(comm)": state is field 3, utime 14, stime 15 (1-based, proc(5)).
    fields = stat.rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    kb = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            kb[key] = int(value.split()[0])
    pss = uss = None
    if memory:
        try:
            usage = read_memory(pid)
            pss, uss = usage.pss, usage.uss
        except (PermissionError, ValueError):
            pass  # not ours to read, or an old kernel: RSS only
    return ProcSample(
        pid,
        time.perf_counter(),
        cpu,
        kb.get("VmRSS", 0) * 1024,
        kb.get("VmHWM", 0) * 1024,
        pss,
        uss,
    )


def proc_report(before: ProcSample, after: ProcSample) -> ProcReport:
    """CPU used between two samples of the same process, and its peak RSS so far."""
    if before.pid != after.pid:
        raise ValueError(f"samples of different processes: {before.pid} and {after.pid}")
    cpu = after.cpu_s - before.cpu_s
    interval = after.taken_at - before.taken_at
    pct = 100 * cpu / interval if interval > 0 else 0.0
    return ProcReport(after.pid, cpu, pct, after.peak_rss_bytes)
