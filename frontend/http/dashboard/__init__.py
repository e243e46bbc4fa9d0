"""The live dashboard: its static page and the JSON snapshot the page polls.

The page (``index.html``, ``dashboard.js``, ``dashboard.css`` beside this module) is
self-contained: no CDN, no chart library; ``dashboard.js`` draws SVG itself and inserts
every server string as text, never as markup. It polls ``GET /dashboard/data`` (built by
:func:`snapshot`) every 500 ms and changes nothing on the server.

A snapshot only reads ``statistics()``-style records and metric values, so building
one is cheap and never blocks: it runs on the event loop like any handler.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.metrics import MetricWrapperBase

if TYPE_CHECKING:
    from frontend.server import Frontend

#: Asset file name → content type; the only files the dashboard routes serve.
ASSETS: Final[dict[str, str]] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

#: Stall records sent in one snapshot at most (each carries a stack of up to 48 frames).
MAX_STALLS: Final = 50


@functools.cache
def load_asset(name: str) -> bytes:
    """The bytes of one file of :data:`ASSETS`, read once per process.

    Raises:
      KeyError: *name* is not a dashboard asset (callers answer 404).
    """
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files(__name__).joinpath(name).read_bytes()


def snapshot(frontend: Frontend, *, stalls_after: float | None = None) -> dict[str, Any]:
    """Everything the page shows, as one JSON-ready dict.

    Args:
      frontend: the running frontend to describe.
      stalls_after: send only stall records that started after this unix time (the
        newest one the page already has); ``None`` sends the latest :data:`MAX_STALLS`.

    Keys: ``now`` (server unix time: the page's x axes use it, not the browser's clock),
    ``model``, ``loop`` (delay series and threshold), ``stalls`` (records newest first
    and the detector's statistics), ``pool``, ``requests`` (in-flight, queued, totals by
    status), ``latency`` (TTFT and ITL percentiles over a recent window), ``workers``.
    """
    monitor, metrics, pool = frontend.monitor, frontend.metrics, frontend.pool
    now = time.time()
    records = monitor.records()
    if stalls_after is not None:
        records = [r for r in records if r.started_at > stalls_after]
    stall_stats = monitor.statistics()
    pool_stats = pool.statistics()
    return {
        "now": now,
        "model": frontend.config.model_name,
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
            "inflight": int(_value(metrics.inflight_requests)),
            "queued": pool_stats.waiting,
            "by_status": _totals_by(metrics.requests_total, "status"),
            "disconnected_clients": int(_value(metrics.disconnected_clients)),
        },
        "latency": {
            "ttft": dataclasses.asdict(metrics.time_to_first_token_seconds.window.statistics()),
            "itl": dataclasses.asdict(metrics.inter_token_latency_seconds.window.statistics()),
        },
        "workers": [dataclasses.asdict(v) for v in frontend.router.views()],
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
