"""The live dashboard: its static page and the JSON snapshot the page polls.

The page (``index.html``, ``dashboard.js``, ``dashboard.css`` beside this module) is
self-contained: no CDN, no chart library; ``dashboard.js`` draws SVG itself and inserts
every server string as text, never as markup. It polls ``GET /dashboard/data`` (built by
:func:`snapshot`) every 500 ms and changes nothing on the server.

A snapshot only reads ``statistics()``-style records and metric values, so building
one is cheap and never blocks: it runs on the event loop like any handler.

The load charts (in-flight, queued, tokenizer threads busy) need a history, and the
frontend runs no sampling task for it: :class:`LoadHistory` takes a sample whenever a
dashboard polls (at most every 250 ms), so a page opened later still shows the last
minute, and a minute nobody watched is simply a gap.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from importlib import resources
from typing import Any, Final

from prometheus_client.metrics import MetricWrapperBase

from frontend.http.observed import Observed

#: Asset file name → content type; the only files the dashboard routes serve.
ASSETS: Final[dict[str, str]] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

#: The page and its two static files: no data in them, so with API keys they stay open
#: (``frontend.http.auth``): a browser cannot put a key on a page load, so the page loads,
#: asks for the key, and sends it (a header, never the URL) with each ``/dashboard/data``.
PAGE_PATHS: Final = frozenset(
    {"/dashboard"} | {f"/dashboard/{name}" for name in ASSETS if name != "index.html"}
)

#: Stall records sent in one snapshot at most (each carries a stack of up to 48 frames).
MAX_STALLS: Final = 50

#: The columns of each :class:`LoadHistory` point, in order.
HISTORY_FIELDS: Final = ("t", "inflight", "queued", "busy", "threads", "finished")


class LoadHistory:
    """Load samples over the last *window_s* seconds, one per *interval_s* at most.

    Each point follows :data:`HISTORY_FIELDS`: unix time, requests in flight, requests
    waiting for a tokenizer thread, tokenizer threads busy, pool size, and requests
    finished since start (the page derives a rate). Fed and read on the event loop.
    """

    def __init__(self, window_s: float = 60.0, interval_s: float = 0.25) -> None:
        self.window_s = window_s
        self.interval_s = interval_s
        self._points: deque[tuple[float, ...]] = deque(maxlen=int(window_s / interval_s) + 1)

    def add(self, point: tuple[float, ...]) -> None:
        """Keep *point* unless the previous one is less than ``interval_s`` older."""
        if not self._points or point[0] - self._points[-1][0] >= self.interval_s:
            self._points.append(point)

    def recent(self, now: float) -> list[tuple[float, ...]]:
        """The points of the last ``window_s`` seconds before *now*, oldest first."""
        oldest = now - self.window_s
        return [p for p in self._points if p[0] >= oldest]


@functools.cache
def load_asset(name: str) -> bytes:
    """The bytes of one file of :data:`ASSETS`, read once per process.

    Raises:
      KeyError: *name* is not a dashboard asset (callers answer 404).
    """
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files(__name__).joinpath(name).read_bytes()


def snapshot(
    frontend: Observed,
    history: LoadHistory,
    *,
    stalls_after: float | None = None,
    memory: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Everything the page shows, as one JSON-ready dict; also samples *history*.

        Args:
          frontend: the running frontend to describe.
          history: the load history to add the current point to, and to send.
          stalls_after: send only stall records that started after this unix time (the
            newest one the page already has); ``None`` sends the latest :data:`MAX_STALLS`.
          memory: rows of ``role``, ``pid``, ``rss_mb``, ``pss_mb``, ``uss_mb``
            (:meth:`headwater.procmem.MemoryUsage.to_mb`), read by the caller off the loop.

        Keys: ``now`` (server unix time: the page's x axes use it, not the browser's clock),
        ``model``, ``loop`` (delay series and threshold), ``stalls`` (records newest first
        and the detector's statistics), ``pool``, ``requests`` (in-flight, queued, generation
        requests by outcome, HTTP answers by status code), ``history`` (``fields`` and
        ``points``: see :class:`LoadHistory`), ``latency`` (TTFT and ITL percentiles over a
        recent window), ``workers``, ``memory``, ``errors`` (the last error answers, newest
        first, with their request ids: :mod:`frontend.http.recent_errors`), ``routing`` (the
    router's policy and ``--router kv``'s counters). A group's view
        (``headwater.cluster.group_view``) has the same keys and ``processes``, one row per
        process.
    """
    monitor, metrics, pool = frontend.monitor, frontend.metrics, frontend.pool
    now = time.time()
    records = monitor.records()
    if stalls_after is not None:
        records = [r for r in records if r.started_at > stalls_after]
    stall_stats = monitor.statistics()
    pool_stats = pool.statistics()
    inflight = int(_value(metrics.inflight_requests))
    by_status = _totals_by(metrics.requests_total, "status")
    history.add(
        (
            now,
            inflight,
            pool_stats.waiting,
            pool_stats.busy,
            pool_stats.threads,
            sum(by_status.values()),
        )
    )
    return {
        "now": now,
        "model": frontend.model_name,
        "loop": {
            "threshold_s": monitor.threshold_s,
            "window_s": monitor.series.window_s,
            "bucket_s": monitor.series.bucket_s,
            "delays": [[round(t, 3), round(d, 6)] for t, d in monitor.recent_delays(now)],
            "max_delay_s": monitor.metrics.max_delay_s,
            "instrumented": monitor.enabled,
        },
        "stalls": {
            "records": [r.to_dict() for r in reversed(records[-MAX_STALLS:])],
            "statistics": dataclasses.asdict(stall_stats) if stall_stats is not None else None,
        },
        "pool": {"mode": pool.mode.value, **dataclasses.asdict(pool_stats)},
        "requests": {
            "inflight": inflight,
            "queued": pool_stats.waiting,
            "by_status": by_status,
            "by_code": _totals_by(metrics.http_responses_total, "code"),
            "disconnected_clients": int(_value(metrics.disconnected_clients)),
        },
        "history": {
            "fields": HISTORY_FIELDS,
            "points": [[round(p[0], 3), *p[1:]] for p in history.recent(now)],
        },
        "latency": {
            "ttft": dataclasses.asdict(metrics.time_to_first_token_seconds.window.statistics()),
            "itl": dataclasses.asdict(metrics.inter_token_latency_seconds.window.statistics()),
        },
        "workers": [dataclasses.asdict(v) for v in frontend.router.views()],
        "memory": memory or [],
        "errors": [e.to_dict() for e in frontend.errors.records()],
        "routing": {
            "policy": frontend.router.policy.value,
            **dataclasses.asdict(frontend.router.kv_statistics()),
        },
    }


def _value(metric: MetricWrapperBase) -> float:
    """The value of an unlabelled counter or gauge (its ``_total`` sample for a counter)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name or sample.name == f"{family.name}_total":
                return sample.value
    return 0.0


def _totals_by(counter: MetricWrapperBase, label: str) -> dict[str, int]:
    """A labelled counter's totals summed over every label but *label*."""
    totals: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and label in sample.labels:
                key = sample.labels[label]
                totals[key] = totals.get(key, 0) + int(sample.value)
    return totals
