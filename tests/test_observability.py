"""Observability: /metrics, /debug/*, the dashboard's page and data, worker metrics.

Policy: every frontend runs on 127.0.0.1:0 (see frontend_fixture) with in-process
simulated workers; worker processes bind 127.0.0.1 port 0 for the plane and a free
loopback port for metrics, and are killed by their own handle. Stalls are injected
through the opt-in debug endpoint; waits for the watchdog's record poll live state
under a deadline. Real time throughout (the loop monitor measures the real clock).
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from frontend.http.dashboard import LoadHistory
from frontend.http.observability import MAX_INJECTED_STALL_MS
from frontend.metrics import FrontendMetrics, RecentWindow, WindowedHistogram
from headwater.cluster.recipes import start_worker
from headwater.instrumentation.exposition import TextExposition
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.ports import free_port
from headwater.wire import GenerateRequest, Role, SamplingParams
from scripts.bench.scrape import loop_series
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker
from workers.metrics_endpoint import serve_worker_metrics

from frontend_fixture import serve_frontend

REPO = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Name three rivers."}]
P = "headwater_frontend_"

#: The sample names the issue asks /metrics to carry (counters with their _total).
FRONTEND_SAMPLES = [
    f"{P}requests_total",
    f"{P}inflight_requests",
    f"{P}queued_requests",
    f"{P}request_duration_seconds_bucket",
    f"{P}time_to_first_token_seconds_bucket",
    f"{P}inter_token_latency_seconds_bucket",
    f"{P}input_sequence_tokens_bucket",
    f"{P}output_sequence_tokens_bucket",
    f"{P}tokenize_seconds_bucket",
    f"{P}template_seconds_bucket",
    f"{P}disconnected_clients_total",
    f"{P}event_loop_delay_seconds_bucket",
    f"{P}event_loop_max_delay_seconds",
    f"{P}event_loop_stall_total",
    f"{P}stall_records_total",
    f"{P}gc_pause_seconds_bucket",
    f"{P}gc_max_pause_seconds",
    f"{P}tokenizer_threads",
    f"{P}tokenizer_threads_busy",
    f"{P}worker_state",
    f"{P}worker_inflight_requests",
]
WORKER_SAMPLES = [
    "headwater_worker_event_loop_delay_seconds_bucket",
    "headwater_worker_event_loop_max_delay_seconds",
    "headwater_worker_event_loop_stall_total",
    "headwater_worker_stall_records_total",
    "headwater_worker_gc_pause_seconds_bucket",
    "headwater_worker_info",
    "headwater_worker_inflight_requests",
    "headwater_worker_kv_blocks_used",
    "headwater_worker_kv_blocks_total",
    "headwater_worker_requests_served_total",
    "headwater_worker_requests_cancelled_total",
]
WORKER_VIEW_KEYS = {
    "worker_id",
    "role",
    "model",
    "address",
    "state",
    "reason",
    "since",
    "inflight",
    "busy",
    "served",
    "failures",
    "last_error",
    "probe_in_s",
    "cached_blocks",
    "cache_view",
}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text body, via prometheus-client's own parser."""
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def value(found: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    matches = [v for n, ls, v in found if n == name and labels.items() <= ls.items()]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


async def chat(c: httpx.AsyncClient, *, stream: bool = False, max_tokens: int = 6) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "stream": stream}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


async def stall_records_naming(c: httpx.AsyncClient, needle: str) -> list[dict[str, Any]]:
    """Poll /debug/stalls until a record's stack names *needle* (the watchdog writes it
    a few ms after the stall ends)."""
    with trio.fail_after(5):
        while True:
            records = (await c.get("/debug/stalls")).json()
            hits = [r for r in records if any(needle in frame for frame in r["stack"])]
            if hits:
                return hits
            await trio.sleep(0.02)


# -- /metrics -----------------------------------------------------------------------


async def test_metrics_parse_and_name_everything() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        await chat(c)
        await chat(c, stream=True)
        r = await c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        found = samples(r.text)
        loop_names = loop_series(P)
        loop_only = await c.get("/metrics", params=[("name[]", n) for n in loop_names])
        workers = fe.router.views()
        threads = fe.pool.statistics().threads
    names = {n for n, _, _ in found}
    missing = [n for n in FRONTEND_SAMPLES if n not in names]
    assert missing == []
    assert {n for n, _, _ in samples(loop_only.text)} == set(loop_names)
    total = f"{P}requests_total"
    assert value(found, total, endpoint="chat", request_type="unary", status="success") == 1
    assert value(found, total, endpoint="chat", request_type="stream", status="success") == 1
    assert value(found, f"{P}time_to_first_token_seconds_count") == 2
    assert value(found, f"{P}inflight_requests") == 0
    assert value(found, f"{P}tokenizer_threads") == threads == 2
    assert len(workers) == 2
    for w in workers:
        assert value(found, f"{P}worker_state", worker_id=w.worker_id, state="healthy") == 1
        assert value(found, f"{P}worker_state", worker_id=w.worker_id, state="draining") == 0


# -- the text exposition ----------------------------------------------------------------


class _ChurningSeries:
    """A collector with a new label value per round (workers come and go), timestamps,
    and a gauge histogram's OpenMetrics-only samples. :meth:`advance` starts a round."""

    def __init__(self) -> None:
        self.round = 1

    def advance(self) -> None:
        self.round += 1

    def collect(self) -> list[Metric]:
        g = GaugeMetricFamily("churn_gauge", "One series per round", labels=["worker"])
        g.add_metric([f"w{self.round}"], self.round * 1.5, timestamp=1700000000.25)
        g.add_metric(["steady"], 1e21)
        gh = GaugeHistogramMetricFamily(
            "churn_ghist", "A gauge histogram", buckets=[("1.0", 2), ("+Inf", 3)], gsum_value=4.5
        )
        return [g, gh]


def _zoo() -> tuple[CollectorRegistry, Counter, _ChurningSeries]:
    """A registry with every metric type, escapes in help and label values, NaN/Inf."""
    reg = CollectorRegistry()
    c = Counter(
        "zoo_requests", "Help with a back\\slash and a\nnewline", ["path", "code"], registry=reg
    )
    c.labels(path='/v1/"chat"', code="200").inc(3)
    c.labels(path="back\\slash\nnew line ünïcode", code="500").inc()
    Gauge("zoo_gauge", "A gauge", registry=reg).set(float("nan"))
    Gauge("zoo_inf", "An infinite gauge", registry=reg).set(float("-inf"))
    h = Histogram("zoo_seconds", "A histogram", ["stage"], buckets=(0.001, 0.5, 10), registry=reg)
    h.labels(stage="route").observe(0.2)
    h.labels(stage="route").observe(1234567.0)
    Summary("zoo_summary", "A summary", registry=reg).observe(7)
    Info("zoo_build", "An info", registry=reg).info({"version": "1.2", "commit": "abc"})
    Enum("zoo_state", "An enum", states=["up", "down"], registry=reg).state("down")
    churn = _ChurningSeries()
    reg.register(churn)
    return reg, c, churn


def test_text_exposition_is_byte_for_byte_generate_latest() -> None:
    reg, counter, churn = _zoo()
    other = CollectorRegistry()
    Gauge("second_registry", "Rendered after the first", registry=other).set(2)
    exposition = TextExposition(reg, other)
    for i in range(3):  # the cached text is reused; values and new series are fresh
        assert exposition.render() == generate_latest(reg) + generate_latest(other)
        counter.labels(path="/", code=str(i)).inc(i)
        churn.advance()


def test_frontend_metrics_render_as_generate_latest() -> None:
    m = FrontendMetrics()
    m.requests_total.labels("chat", "stream", "success", "m").inc()
    m.time_to_first_token_seconds.observe(0.02)
    m.worker_state.labels("w1", "decode", "healthy").set(1)
    assert m.render() == generate_latest(m.registry)


def test_a_scrape_can_ask_for_some_series_only() -> None:
    """``name[]`` as prometheus-client's handler reads it: sample names; the cache of the
    full render survives a partial one."""
    reg, _, churn = _zoo()
    exposition = TextExposition(reg)
    full = exposition.render()
    cached = len(exposition._series)
    names = ["zoo_seconds_bucket", "zoo_seconds_count", "zoo_requests_total", "no_such"]
    partial = exposition.render(names)
    assert partial == generate_latest(reg.restricted_registry(names))
    assert b"zoo_seconds_bucket" in partial
    assert b"zoo_seconds_sum" not in partial
    assert 0 < len(partial) < len(full)
    assert len(exposition._series) == cached
    assert exposition.render([]) == b""  # no name asked for: nothing, as the library does
    churn.advance()
    assert exposition.render() == generate_latest(reg)


def test_text_exposition_forgets_series_that_are_gone() -> None:
    reg, _, churn = _zoo()
    exposition = TextExposition(reg)
    exposition.render()
    live = len(exposition._series)
    sizes = []
    for _ in range(50):
        churn.advance()
        exposition.render()
        sizes.append(len(exposition._series))
    # One series is new on each scrape; the cache is trimmed rather than keeping fifty.
    assert max(sizes) <= 2 * live
    assert exposition.render() == generate_latest(reg)


# -- /debug/workers, /debug/stalls, /debug/stall --------------------------------------


async def test_debug_workers_lists_state_load_and_last_error() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        before = (await c.get("/debug/workers")).json()
        await chat(c)
        after = {w["role"]: w for w in (await c.get("/debug/workers")).json()}
    assert len(before) == 2
    for w in before:
        assert set(w) == WORKER_VIEW_KEYS
        assert w["state"] == "healthy"
        assert w["inflight"] == 0
        assert w["last_error"] is None
        assert (w["cached_blocks"], w["cache_view"]) == (0, "")  # not routing by KV
        assert w["model"] == MODEL
    assert set(after) == {"prefill", "decode"}
    assert after["prefill"]["served"] == 1
    assert after["decode"]["served"] == 1  # booked although the stream is closed at its last chunk
    assert all(w["inflight"] == 0 for w in after.values())


async def test_debug_runtime_counts_the_tasks_and_descriptors_of_the_process() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        await chat(c)
        r = await c.get("/debug/runtime")
        with socket.socket():  # one more descriptor in this (the frontend's) process
            held = (await c.get("/debug/runtime")).json()
        # Compared with the count right after it closed, not before it opened: the
        # chat's own descriptors may still be closing between the first two reads.
        after = (await c.get("/debug/runtime")).json()
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    snap = r.json()
    assert set(snap) == {"pid", "trio_tasks", "tasks_by_name", "open_fds", "threads", "rss_bytes"}
    assert snap["pid"] == os.getpid()  # the frontend runs in the test's process
    assert snap["trio_tasks"] == sum(snap["tasks_by_name"].values())
    # The request being answered is one of the tasks it counts.
    assert any("handle_request" in name for name in snap["tasks_by_name"])
    assert held["open_fds"] == after["open_fds"] + 1
    assert snap["rss_bytes"] > 0


async def test_injected_stall_is_recorded_with_its_function() -> None:
    async with (
        serve_frontend(debug_endpoints=True) as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        r = await c.post("/debug/stall", params={"ms": 120})
        assert r.status_code == 200, r.text
        assert r.json()["requested_ms"] == 120
        assert r.json()["blocked_ms"] >= 120
        (record, *_) = await stall_records_naming(c, "inject_loop_stall")
        found = samples((await c.get("/metrics")).text)
    assert record["cause"] == "loop"
    assert record["sampled"] is True
    assert 0.110 <= record["duration_s"] < 5
    assert "time.sleep(" in record["stack"][-1]  # innermost last, with its source line
    assert value(found, f"{P}stall_records_total", cause="loop") >= 1
    assert value(found, f"{P}event_loop_max_delay_seconds") >= 0.1


async def test_debug_stall_rejects_bad_durations() -> None:
    async with (
        serve_frontend(debug_endpoints=True) as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        for ms in ("0", "-5", "abc", str(MAX_INJECTED_STALL_MS + 1)):
            r = await c.post("/debug/stall", params={"ms": ms})
            assert r.status_code == 400, ms
            assert r.json()["error"]["param"] == "ms"
        assert (await c.get("/debug/stall")).status_code == 405


async def test_debug_stall_is_not_served_by_default() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        assert fe.config.debug_endpoints is False
        r = await c.post("/debug/stall", params={"ms": 300})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        stalls = (await c.get("/debug/stalls")).json()
    assert not any("inject_loop_stall" in f for s in stalls for f in s["stack"])


# -- the dashboard --------------------------------------------------------------------


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []  # (tag, attribute, value)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, val in attrs:
            if name in ("src", "href", "action", "srcset", "poster", "data") and val:
                self.urls.append((tag, name, val))


async def test_dashboard_is_self_contained() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        page = await c.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp
        assert "script-src 'self'" in csp
        links = _Links()
        links.feed(page.text)
        assets = {}
        for tag, attr, link in links.urls:
            # Same-origin paths or inline data only: never another host.
            assert link.startswith("data:") or (
                link.startswith("/") and not link.startswith("//")
            ), (tag, attr, link)
            if link.startswith("/"):
                r = await c.get(link)
                assert r.status_code == 200, link
                assets[link] = r
        assert (await c.get("/dashboard/nothing-here.js")).status_code == 404
    assert {"/dashboard/dashboard.js", "/dashboard/dashboard.css"} <= set(assets)
    js = assets["/dashboard/dashboard.js"]
    assert js.headers["content-type"].startswith("text/javascript")
    assert assets["/dashboard/dashboard.css"].headers["content-type"].startswith("text/css")
    # The only absolute URL in the code is the SVG namespace (a name, never fetched).
    everything = page.text + js.text + assets["/dashboard/dashboard.css"].text
    urls = set(re.findall(r"https?://[^\s\"')]+", everything))
    assert urls == {"http://www.w3.org/2000/svg"}
    assert "<script>" not in page.text  # no inline code: the CSP would block it
    assert ".innerHTML" not in js.text  # server text goes in as text, never markup
    assert "/dashboard/data" in js.text


async def test_dashboard_data_snapshot() -> None:
    async with (
        serve_frontend(debug_endpoints=True) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        await chat(c, stream=True, max_tokens=8)
        await c.post("/debug/stall", params={"ms": 80})
        await stall_records_naming(c, "inject_loop_stall")
        r = await c.get("/dashboard/data")
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-store"
        data = r.json()
        newest = data["stalls"]["records"][0]["started_at"]
        none_newer = (await c.get("/dashboard/data", params={"stalls_after": newest})).json()
        just_one = (await c.get("/dashboard/data", params={"stalls_after": newest - 1e-6})).json()
        bad = await c.get("/dashboard/data", params={"stalls_after": "soon"})
        workers = (await c.get("/debug/workers")).json()

    assert set(data) == {
        "now",
        "model",
        "loop",
        "stalls",
        "pool",
        "requests",
        "history",
        "latency",
        "workers",
        "memory",
        "errors",
        "routing",
    }
    assert data["model"] == MODEL
    (memory,) = data["memory"]  # this process's own, from /proc/self/smaps_rollup
    assert memory["role"] == "frontend"
    assert memory["pid"] == os.getpid()  # the test runs the frontend in-process
    assert 0 < memory["uss_mb"] <= memory["pss_mb"] <= memory["rss_mb"]
    loop = data["loop"]
    assert loop["threshold_s"] == pytest.approx(0.020)
    assert loop["instrumented"] is True
    assert loop["delays"], "the canary has been sampling for a while"
    assert all(data["now"] - 61 <= t <= data["now"] + 1 and d >= 0 for t, d in loop["delays"])
    assert max(d for _, d in loop["delays"]) >= 0.05  # the injected stall shows in the series

    records = data["stalls"]["records"]
    starts = [rec["started_at"] for rec in records]
    assert starts == sorted(starts, reverse=True)  # newest first
    assert any("inject_loop_stall" in f for rec in records for f in rec["stack"])
    stats = data["stalls"]["statistics"]
    assert stats["stalls_total"] >= 1
    assert stats["tracking"] is True
    assert none_newer["stalls"]["records"] == []
    assert [rec["started_at"] for rec in just_one["stalls"]["records"]] == [newest]
    assert bad.status_code == 400

    assert set(data["pool"]) == {
        "mode",
        "threads",
        "busy",
        "waiting",
        "encoded_total",
        "inline_total",
        "segment_cache",
    }
    cache = data["pool"]["segment_cache"]  # fastokens', on by default (None when off, or hf)
    assert cache is not None
    assert {"hits", "misses", "bytes", "max_bytes"} <= set(cache)
    assert cache["max_bytes"] > 0
    assert data["pool"]["threads"] == 2
    assert data["requests"]["inflight"] == 0
    assert data["requests"]["queued"] == 0
    assert data["requests"]["by_status"] == {"success": 1}
    history = data["history"]
    assert history["fields"] == ["t", "inflight", "queued", "busy", "threads", "finished"]
    point = dict(zip(history["fields"], history["points"][-1], strict=True))
    assert point == {
        "t": pytest.approx(data["now"], abs=1e-3),
        "inflight": 0,
        "queued": 0,
        "busy": 0,
        "threads": 2,
        "finished": 1,
    }
    ttft, itl = data["latency"]["ttft"], data["latency"]["itl"]
    assert ttft["count"] == 1
    assert 0 < ttft["p50"] == ttft["p99"] == ttft["max"]
    assert itl["count"] == 7  # 8 tokens: 7 gaps, however the chunks were merged
    assert itl["p50"] <= itl["p90"] <= itl["p99"] <= itl["max"]
    assert data["workers"] == workers
    assert fe.metrics.time_to_first_token_seconds.window.statistics().count == 1


# -- the recent window behind the percentiles --------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_recent_window_percentiles_are_nearest_rank() -> None:
    window = RecentWindow(window_s=60, clock=FakeClock())
    assert window.statistics().count == 0
    assert window.statistics().p50 is None
    for v in range(100, 0, -1):
        window.add(float(v))
    stats = window.statistics()
    assert (stats.count, stats.p50, stats.p90, stats.p99, stats.max) == (100, 50, 90, 99, 100)


def test_recent_window_forgets_old_and_excess_observations() -> None:
    clock = FakeClock()
    window = RecentWindow(window_s=10, max_samples=5, clock=clock)
    window.add(1.0)
    clock.now = 5
    window.add(2.0)
    clock.now = 10.5  # the first observation is now 10.5 s old
    assert window.values() == [2.0]
    for v in range(10):
        window.add(float(v))
    assert window.values() == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_windowed_histogram_feeds_both() -> None:
    registry = CollectorRegistry()
    hist = WindowedHistogram(Histogram("x_seconds", "x", registry=registry))
    hist.observe(0.25)
    hist.observe(0.75)
    assert registry.get_sample_value("x_seconds_count") == 2
    assert registry.get_sample_value("x_seconds_sum") == 1.0
    assert hist.window.values() == [0.25, 0.75]


def test_load_history_keeps_one_point_per_interval_over_the_window() -> None:
    history = LoadHistory(window_s=10, interval_s=0.25)
    for i in range(200):  # a point every 0.1 s for 20 s
        history.add((i / 10, i, 0, 0, 2, 0))
    points = history.recent(now=19.9)
    times = [p[0] for p in points]
    assert times[0] >= 9.9
    assert times == sorted(times)
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(times))
    assert 30 <= len(points) <= 41


# -- worker metrics ----------------------------------------------------------------------


@pytest.mark.slow
async def test_worker_process_serves_its_metrics(tmp_path: Path, nursery: trio.Nursery) -> None:
    port = free_port()
    worker = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        model=MODEL,
        ready_within=10,
        engine_args=["--num-gpu-blocks", "512", "--speedup-ratio", "1000"],
        # Not the default loopback address: --metrics-host is where it binds.
        extra_args=["--metrics-port", str(port), "--metrics-host", "127.0.0.2"],
    )
    worker_id = worker.worker_id
    client = await connect_worker(
        WorkerInstance(worker_id, Role(worker.role), MODEL, worker.address), nursery
    )
    request = GenerateRequest(
        "m1", MODEL, list(range(3, 200)), SamplingParams(max_tokens=4, ignore_eos=True)
    )
    async with client.stream(request) as chunks:
        assert len([t async for c in chunks for t in c.token_ids]) == 4
    async with httpx.AsyncClient(base_url=f"http://127.0.0.2:{port}") as c:
        r = await c.get("/metrics")
        stalls = await c.get("/debug/stalls")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(r.text)
    names = {n for n, _, _ in found}
    assert [n for n in WORKER_SAMPLES if n not in names] == []
    assert value(found, "headwater_worker_info", worker_id=worker_id, role="agg") == 1
    assert value(found, "headwater_worker_kv_blocks_total") == 512
    # The Gateway API Inference Extension's endpoint picker reads vLLM's names.
    used = value(found, "headwater_worker_kv_blocks_used")
    assert value(found, "vllm:kv_cache_usage_perc") == used / 512
    assert value(found, "vllm:gpu_cache_usage_perc") == used / 512
    assert value(found, "vllm:num_requests_waiting") == 0
    assert value(found, "vllm:num_requests_running") == 0
    assert value(found, "headwater_worker_requests_served_total") == 1
    assert value(found, "headwater_worker_inflight_requests") == 0
    assert value(found, "headwater_worker_event_loop_delay_seconds_count") > 0
    assert stalls.status_code == 200
    assert isinstance(stalls.json(), list)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.2:{port}") as c:
        runtime = (await c.get("/debug/runtime")).json()
    assert runtime["pid"] == worker.pid  # the worker process's own, read from inside it
    assert runtime["trio_tasks"] == sum(runtime["tasks_by_name"].values()) > 0
    assert runtime["open_fds"] > 0


async def test_the_engines_own_series_are_exported_beside_the_workers(
    nursery: trio.Nursery,
) -> None:
    # vLLM in-process records its series in the worker's process; the worker exports
    # them, except the names it gives itself (the endpoint picker's).
    worker: RunningWorker = await nursery.start(
        serve_worker,
        WorkerConfig(engine_config=MockerConfig(speedup_ratio=1000.0, num_gpu_blocks=64)),
    )
    tokens = GaugeMetricFamily("vllm:engine_tokens", "the engine's own", value=42)
    running = GaugeMetricFamily("vllm:num_requests_running", "the engine's own", value=7)
    engine = worker.runtime.engine
    engine.metric_families = lambda: [tokens, running]  # type: ignore[method-assign]
    port: int = await nursery.start(serve_worker_metrics, 0, worker)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        found = samples((await c.get("/metrics")).text)
    assert value(found, "vllm:engine_tokens") == 42
    assert [v for n, _, v in found if n == "vllm:num_requests_running"] == [0]  # the worker's


async def test_worker_metrics_endpoint_answers_only_metrics(nursery: trio.Nursery) -> None:
    worker: RunningWorker = await nursery.start(
        serve_worker,
        WorkerConfig(engine_config=MockerConfig(speedup_ratio=1000.0, num_gpu_blocks=64)),
    )
    port: int = await nursery.start(serve_worker_metrics, 0, worker)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        ok = await c.get("/metrics?x=1")
        some = await c.get("/metrics?name[]=headwater_worker_kv_blocks_total")
        loop = loop_series("headwater_worker_")
        only_loop = await c.get("/metrics", params=[("name[]", n) for n in loop])
        head = await c.head("/metrics")
        missing = await c.get("/")
        post = await c.post("/metrics", content=b"")
    assert ok.status_code == 200
    assert value(samples(ok.text), "headwater_worker_kv_blocks_total") == 64
    assert [(n, v) for n, _, v in samples(some.text)] == [("headwater_worker_kv_blocks_total", 64)]
    assert {n for n, _, _ in samples(only_loop.text)} == set(loop)
    assert head.status_code == 200
    assert head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert missing.status_code == 404
    assert post.status_code == 405
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        runtime = await c.get("/debug/runtime")
    assert runtime.status_code == 200
    assert runtime.json()["pid"] == os.getpid()
    assert runtime.json()["trio_tasks"] == sum(runtime.json()["tasks_by_name"].values())
    # A client that sends garbage, or nothing, costs only its own connection.
    for junk in (b"\x00\x01 nonsense\r\n\r\n", b""):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            if junk:
                await stream.send_all(junk)
            await stream.send_eof()
            with trio.fail_after(5):
                reply = b""
                while chunk := await stream.receive_some(4096):
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 400") if junk else reply == b""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        assert (await c.get("/metrics")).status_code == 200
