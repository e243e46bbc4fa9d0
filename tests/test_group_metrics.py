"""The group's merged /metrics and dashboard (pure: pages and snapshots in, merged out).

The pages are real ones: each comes from a :class:`FrontendMetrics` registry fed here,
so the merge is checked against what a frontend process really exports.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.http.dashboard import LoadHistory
from frontend.metrics import FrontendMetrics
from headwater.cluster.group_metrics import Family, GroupMetrics, render
from headwater.cluster.group_view import Member, merge_dashboards
from headwater.instrumentation import LoopMetrics
from headwater.instrumentation.loop_metrics import FRONTEND_PREFIX

P = FRONTEND_PREFIX
STARTED = 1_700_000_000.0


class Process:
    """One frontend process's metrics, as its /metrics page renders them."""

    def __init__(self) -> None:
        self.metrics = FrontendMetrics()
        self.loop = LoopMetrics(self.metrics.registry, P)

    def served(self, n: int, seconds: float = 0.05) -> None:
        for _ in range(n):
            self.metrics.requests_total.labels("chat", "unary", "success", "m").inc()
            self.metrics.request_duration_seconds.labels("m").observe(seconds)

    def page(self) -> str:
        return self.metrics.render().decode()


def samples(page: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = page.decode() if isinstance(page, bytes) else page
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(page: bytes, name: str, **labels: str) -> float:
    return samples(page)[(name, tuple(sorted(labels.items())))]


SUCCESS = {"endpoint": "chat", "request_type": "unary", "status": "success", "model": "m"}


def test_counters_and_histograms_add_up_across_processes() -> None:
    a, b = Process(), Process()
    a.served(3, 0.004)
    b.served(2, 0.3)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 100, a.page())
    group.observe(1, 101, b.page())
    page = group.render()
    assert value(page, f"{P}requests_total", **SUCCESS) == 5
    assert value(page, f"{P}request_duration_seconds_count", model="m") == 5
    assert value(page, f"{P}request_duration_seconds_sum", model="m") == pytest.approx(
        3 * 0.004 + 2 * 0.3
    )
    # Cumulative buckets add up bound by bound: 3 below 5 ms, all 5 below 0.5 s.
    assert value(page, f"{P}request_duration_seconds_bucket", le="0.005", model="m") == 3
    assert value(page, f"{P}request_duration_seconds_bucket", le="0.25", model="m") == 3
    assert value(page, f"{P}request_duration_seconds_bucket", le="0.5", model="m") == 5
    assert value(page, f"{P}request_duration_seconds_bucket", le="+Inf", model="m") == 5
    # Every series' _created is the group's start, not a process's.
    assert value(page, f"{P}requests_created", **SUCCESS) == STARTED
    assert value(page, f"{P}request_duration_seconds_created", model="m") == STARTED


def test_gauges_add_up_except_the_worst_of_loop_and_drain() -> None:
    a, b = Process(), Process()
    a.metrics.inflight_requests.set(4)
    b.metrics.inflight_requests.set(3)
    a.loop.max_delay.set(0.002)
    b.loop.max_delay.set(0.150)
    b.metrics.draining.set(1)
    a.loop.observe_gc_pause(2, 0.040)
    b.loop.observe_gc_pause(0, 0.0003)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 1, a.page())
    group.observe(1, 2, b.page())
    page = group.render()
    assert value(page, f"{P}inflight_requests") == 7
    assert value(page, f"{P}event_loop_max_delay_seconds") == 0.150
    assert value(page, f"{P}draining") == 1
    # The longest GC pause is the worst process's; the pauses' histogram adds up.
    assert value(page, f"{P}gc_max_pause_seconds") == 0.040
    assert value(page, f"{P}gc_pause_seconds_count", generation="2") == 1
    assert value(page, f"{P}gc_pause_seconds_count", generation="0") == 1


def test_a_restarted_process_neither_resets_nor_double_counts_the_group() -> None:
    a, b = Process(), Process()
    a.served(10)
    b.served(4)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 100, a.page())
    group.observe(1, 101, b.page())
    assert value(group.render(), f"{P}requests_total", **SUCCESS) == 14

    # Process 0 dies; until its restart answers it counts with what was last seen.
    group.observe(0, 100, None)
    b.served(1)
    group.observe(1, 101, b.page())
    assert value(group.render(), f"{P}requests_total", **SUCCESS) == 15

    # Its new incarnation counts from 0: the 10 it had are kept, none twice.
    restarted = Process()
    restarted.served(2)
    group.observe(0, 200, restarted.page())
    group.observe(1, 101, b.page())
    page = group.render()
    assert value(page, f"{P}requests_total", **SUCCESS) == 10 + 2 + 5
    assert value(page, f"{P}request_duration_seconds_count", model="m") == 17

    # Scraped again with nothing new: unchanged (monotonic, no reset for Prometheus).
    group.observe(0, 200, restarted.page())
    group.observe(1, 101, b.page())
    assert value(group.render(), f"{P}requests_total", **SUCCESS) == 17


def test_a_silent_process_keeps_its_counts_but_not_its_gauges() -> None:
    a, b = Process(), Process()
    a.served(3)
    a.metrics.inflight_requests.set(5)
    b.metrics.inflight_requests.set(1)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 1, a.page())
    group.observe(1, 2, b.page())
    group.observe(0, 1, None)  # stalled: no answer this time
    group.observe(1, 2, b.page())
    page = group.render()
    assert value(page, f"{P}requests_total", **SUCCESS) == 3
    assert value(page, f"{P}inflight_requests") == 1
    assert group.answered() == 1


def test_a_filtered_scrape_keeps_the_other_series() -> None:
    a = Process()
    a.served(2)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 1, a.page())
    loop_only = [f"{P}event_loop_delay_seconds_count"]
    group.observe(0, 1, a.metrics.render(loop_only).decode())
    page = group.render()
    assert value(page, f"{P}requests_total", **SUCCESS) == 2
    assert set(samples(group.render(names=loop_only))) == {
        (f"{P}event_loop_delay_seconds_count", ())
    }


def test_the_rendered_page_parses_back_with_its_types() -> None:
    a = Process()
    a.served(1)
    group = GroupMetrics(started_at=STARTED)
    group.observe(0, 1, a.page())
    extra = Family(
        "x_restarts",
        "counter",
        'a "quoted"\\ help',
        (("x_restarts_total", (("why", 'a"b\nc'),), 2.0),),
    )
    families = {f.name: f for f in text_string_to_metric_families(group.render([extra]).decode())}
    assert families[f"{P}requests"].type == "counter"
    assert families[f"{P}request_duration_seconds"].type == "histogram"
    assert families[f"{P}inflight_requests"].type == "gauge"
    (restarts,) = families["x_restarts"].samples
    assert restarts.labels == {"why": 'a"b\nc'}
    assert restarts.value == 2
    assert render([]) == b""


def test_a_page_that_does_not_parse_is_refused() -> None:
    group = GroupMetrics(started_at=STARTED)
    with pytest.raises(ValueError, match="cannot parse"):
        group.observe(0, 1, "requests_total{ 3\n")


# ---- the dashboard --------------------------------------------------------------------------


def snapshot(inflight: int, ok: int, delays: list[list[float]], p99: float) -> dict[str, Any]:
    window = {
        "window_s": 60.0,
        "count": 10,
        "p50": p99 / 2,
        "p90": p99 / 1.5,
        "p99": p99,
        "max": p99,
    }
    return {
        "now": 0.0,
        "model": "deepseek-v4",
        "loop": {
            "threshold_s": 0.02,
            "window_s": 60.0,
            "bucket_s": 0.25,
            "delays": delays,
            "max_delay_s": max(d for _, d in delays),
            "instrumented": True,
        },
        "stalls": {
            "records": [{"started_at": delays[0][0], "duration_s": 0.03}],
            "statistics": {
                "stalls_total": 2,
                "loop_stalls_total": 1,
                "gil_stalls_total": 0,
                "contention_stalls_total": 1,
                "last_duration_s": 0.03,
                "max_duration_s": 0.03,
                "tracking": True,
            },
        },
        "pool": {
            "mode": "thread",
            "threads": 2,
            "busy": 1,
            "waiting": 0,
            "encoded_total": 5,
            "inline_total": 3,
            "segment_cache": {
                "hits": ok,
                "misses": 1,
                "hit_bytes": 100 * ok,
                "miss_bytes": 10,
                "entries": 2,
                "bytes": 110,
                "max_bytes": 1 << 20,
            },
        },
        "requests": {
            "inflight": inflight,
            "queued": 0,
            "by_status": {"success": ok},
            "by_code": {"200": ok, "404": 1},
            "disconnected_clients": 0,
        },
        "history": {"fields": [], "points": []},
        "latency": {"ttft": window, "itl": window},
        "workers": [{"worker_id": "local-prefill-0"}],
        "memory": [],
    }


def test_dashboards_merge_into_the_group_with_every_process_kept() -> None:
    members = [
        Member(0, 11, "http://127.0.0.1:1", True, 0),
        Member(1, 12, "http://127.0.0.1:2", True, 1),
        Member(2, 13, "http://127.0.0.1:3", False, 2),
    ]
    parts = [
        snapshot(2, 5, [[10.0, 0.001], [10.25, 0.004]], 0.2),
        snapshot(1, 7, [[10.25, 0.002], [10.5, 0.030]], 0.5),
        None,
    ]
    memory = [
        {"role": "supervisor", "pid": 1, "rss_mb": 200.0, "pss_mb": 60.0, "uss_mb": 5.0},
        {"role": "process 0", "pid": 11, "rss_mb": 220.0, "pss_mb": 80.0, "uss_mb": 30.0},
    ]
    data = merge_dashboards(members, parts, LoadHistory(), 11.0, memory)
    assert data["group"] == {"processes": 3, "up": 2}
    assert data["requests"]["inflight"] == 3
    assert data["requests"]["by_status"] == {"success": 12}
    assert data["requests"]["by_code"] == {"200": 12, "404": 2}
    assert data["pool"]["threads"] == 4
    assert data["pool"]["encoded_total"] == 10
    cache = data["pool"]["segment_cache"]  # every process's own, added up
    assert (cache["hits"], cache["misses"], cache["max_bytes"]) == (12, 2, 2 << 20)
    assert data["loop"]["delays"] == [(10.0, 0.001), (10.25, 0.004), (10.5, 0.030)]  # worst
    assert [p["process"] for p in data["loop"]["processes"]] == [0, 1]
    assert data["latency"]["ttft"]["p99"] == 0.5
    assert data["latency"]["ttft"]["count"] == 20
    assert data["stalls"]["statistics"]["stalls_total"] == 4
    assert data["stalls"]["statistics"]["contention_stalls_total"] == 2
    assert [r["process"] for r in data["stalls"]["records"]] == [1, 0]  # newest first
    assert [w["process"] for w in data["workers"]] == [0, 1]
    rows = data["processes"]
    assert [(r["process"], r["up"], r.get("finished")) for r in rows] == [
        (0, True, 5),
        (1, True, 7),
        (2, False, None),
    ]
    assert rows[0]["memory"]["pss_mb"] == 80.0
    assert rows[1]["memory"] is None
    assert data["memory"] == memory
    assert data["history"]["points"][-1][1:] == [3, 0, 2, 4, 12]
    with pytest.raises(ValueError, match="3 members, 2 snapshots"):
        merge_dashboards(members, parts[:2], LoadHistory(), 11.0, [])
