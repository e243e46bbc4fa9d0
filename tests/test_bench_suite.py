"""The benchmark suite: records, timelines, stage attribution, report, charts, one real run.

Test policy: loopback only; the one end-to-end test starts two real ``headwater serve``
subprocesses on free ports (``--port 0``; one of them as two frontend processes,
``--processes 2``) and sends ten requests per run, bounded by a time limit; one more
starts a fake frontend program that only prints its start-up lines. Everything else
runs on synthetic data. No Dynamo is started: the suite is pointed at a directory
without its scripts and must skip it with a message.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from headwater.cluster import recipes as processes
from scripts.bench import measure, plots, profile, report, servers, suite, timeline
from scripts.bench import run as bench
from scripts.bench.loadgen import ClientUsage, LoadResult, RequestRecord
from scripts.bench.scrape import Histogram as Hist
from scripts.bench.scrape import LoopSnapshot, ProcReport, ProcSample, loop_report, parse_loop

# --- synthetic data -------------------------------------------------------------------


def _exposition(delays: list[float], max_delay: float) -> str:
    reg = CollectorRegistry()
    hist = Histogram(
        "headwater_frontend_event_loop_delay_seconds",
        "d",
        registry=reg,
        buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1),
    )
    for d in delays:
        hist.observe(d)
    Counter("headwater_frontend_event_loop_stall_total", "s", registry=reg).inc(
        sum(d > 0.02 for d in delays)
    )
    Gauge("headwater_frontend_event_loop_max_delay_seconds", "m", registry=reg).set(max_delay)
    return generate_latest(reg).decode()


def _record(**overrides: Any) -> dict[str, Any]:
    """A run record as build_record writes it, with plausible figures."""
    r: dict[str, Any] = {
        "phase": "vs dynamo fastokens",
        "pair": None,
        "server": "headwater",
        "variant": "fastokens/thread",
        "label": "headwater fastokens/thread",
        "scenario": "long",
        "key": "long unary c16",
        "started_unix": 1000.0,
        "ended_unix": 1010.0,
        "load_avg_1m": 0.3,
        "content_tokens_mean": 40000.0,
        "max_tokens": 8,
        "stream": False,
        "concurrency": 16,
        "requests": 100,
        "ok": 100,
        "failed": 0,
        "cut_off": 0,
        "wall_s": 1.0,
        "req_per_s": 100.0,
        "output_tokens_per_s": 800.0,
        "ttft_p50_ms": 50.0,
        "ttft_p99_ms": 90.0,
        "itl_p50_ms": None,
        "itl_p99_ms": None,
        "e2e_p50_ms": 50.0,
        "e2e_p99_ms": 90.0,
        "prompt_tokens_mean": 40010.0,
        "completion_tokens_mean": 8.0,
        "client_cpu_s": 0.1,
        "client_cpu_pct": 10.0,
        "first_error": None,
        "prompt_tokens_per_s": 4_001_000.0,
        "frontend_cpu_s": 1.0,
        "frontend_cpu_ms_per_req": 10.0,
        "frontend_cpu_pct": 50.0,
        "server_cpu_ms_per_req": 10.0,
        "server_pids": [1],
        "peak_rss_mb": 320.0,
        "rss_start_mb": 300.0,
        "rss_end_mb": 305.0,
        "loop_samples": 100,
        "loop_mean_ms": 1.0,
        "loop_p99_ms": 3.0,
        "loop_max_ms": 12.0,
        "loop_max_exact": True,
        "stalls": 0,
        "stall_threshold_ms": 20.0,
        "stall_records": 0,
        "stall_record_max_ms": None,
        "threads_cpu_s": {"loop": 0.8, "tokenizer": 0.15, "other": 0.05},
        "threads_cpu_ms_per_req": {"loop": 8.0, "tokenizer": 1.5, "other": 0.5},
        "timeline": [
            {
                "t_s": 0.25 * i,
                "loop_samples": 25,
                "loop_p99_ms": 1.0 + i % 3,
                "loop_max_ms": 5.0,
                "rss_mb": 300.0 + i,
                "cpu_pct": 50.0,
            }
            for i in range(1, 9)
        ],
    }
    r.update(overrides)
    return r


def _results(runs: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "config": {},
        "started": "2026-11-29T22:00:00",
        "quick": False,
        "machine": {
            "nproc": 2,
            "usable_cpus": 2,
            "cpu_model": "test CPU",
            "memory_gb": 8,
            "os": "Linux",
            "python": "3.11",
            "packages": {"trio": "0.35"},
            "commit": "abc1234",
            "dirty": False,
        },
        "load_avg_start": [0.2, 0.2, 0.2],
        "load_avg_end": [0.4, 0.3, 0.2],
        "runs": runs,
        "calibration": [
            {
                "backend": "fastokens",
                "texts": 8,
                "tokens": 1,
                "tokens_per_cpu_s": 10_000_000,
                "tokens_per_wall_s": 9_000_000,
            },
        ],
        "idle_rss_mb": {
            "headwater fastokens/thread": 290.0,
            "headwater fastokens/thread (after warm-up)": 300.0,
            "dynamo fastokens": 285.0,
        },
        "profile": [],
        "skipped": [],
        "dynamo_version": "1.6.1",
        "finished": True,
        "elapsed_s": 100.0,
    }
    res.update(overrides)
    return res


def _pair_runs(hw_rps: float, dyn_rps: float, key: str = "long unary c16") -> list[dict[str, Any]]:
    scenario = key.split()[0]
    pair = f"vs dynamo fastokens: {key}"
    common = {
        "pair": pair,
        "key": key,
        "scenario": scenario,
        "concurrency": int(key.rsplit("c", 1)[1]),
    }
    return [
        _record(**common, req_per_s=hw_rps, ttft_p50_ms=40.0),
        _record(
            **common,
            server="dynamo",
            variant="fastokens",
            label="dynamo fastokens",
            req_per_s=dyn_rps,
            ttft_p50_ms=80.0,
            started_unix=1011.0,
        ),
    ]


# --- timeline ---------------------------------------------------------------------------


def _snap(delays: list[float], max_delay: float) -> Any:
    return parse_loop(_exposition(delays, max_delay))


def test_timeline_points_take_per_interval_deltas() -> None:
    base = [0.0005] * 50
    fast = base + [0.0005] * 25
    spike = fast + [0.0005] * 20 + [0.04]
    samples = [
        timeline.RawSample(0.0, _snap(base, 0.0005), ProcSample(1, 10.0, 1.0, 100 * 2**20, 0)),
        timeline.RawSample(0.25, _snap(fast, 0.0005), ProcSample(1, 10.25, 1.1, 101 * 2**20, 0)),
        timeline.RawSample(0.5, None, None),  # a scrape that failed: merged into the next
        timeline.RawSample(0.75, _snap(spike, 0.04), ProcSample(1, 10.75, 1.2, 102 * 2**20, 0)),
    ]
    points = timeline.timeline_points(samples)
    assert [p.t_s for p in points] == [0.25, 0.5, 0.75]
    first, failed, last = points
    assert first.loop_samples == 25
    assert first.loop_max_ms == 1.0  # every observation in the ≤ 1 ms bucket
    assert first.loop_p99_ms is not None
    assert first.loop_p99_ms <= 1.0
    assert first.cpu_pct == pytest.approx(40.0)
    assert (failed.loop_samples, failed.loop_p99_ms, failed.rss_mb) == (0, None, None)
    assert last.loop_samples == 21  # 0.25 → 0.75 s
    assert last.loop_max_ms == 50.0  # the 40 ms spike lands in the (20, 50] ms bucket
    assert last.rss_mb == pytest.approx(102)
    assert last.cpu_pct == pytest.approx(20.0)


def test_loop_max_is_exact_only_when_the_gauge_rose() -> None:
    before = _snap([0.0005] * 10, 0.030)
    rose = _snap([0.0005] * 10 + [0.045], 0.045)
    report_rose = loop_report(before, rose)
    assert measure.loop_max(report_rose, before, 0.05) == (0.045, True)
    flat = _snap([0.0005] * 10 + [0.004], 0.030)
    # The gauge still says 30 ms (an earlier run); the run's own bound is the 5 ms bucket.
    assert measure.loop_max(loop_report(before, flat), before, 0.005) == (0.005, False)
    assert measure.loop_max(None, None, None) == (None, False)


# --- stage attribution ----------------------------------------------------------------


def _frame(function: str, path: str) -> str:
    return f"{function}\x00{path}\x001"


TRIO = "/v/site-packages/trio/_core/_run.py"
ROOT = [_frame("run", TRIO), _frame("unrolled_run", TRIO)]
APP, PIPE, PRE = "/r/frontend/http/app.py", "/r/frontend/pipeline.py", "/r/frontend/preprocess/"


@pytest.mark.parametrize(
    ("stack", "stage"),
    [
        (
            [
                _frame("get_events", "/v/site-packages/trio/_core/_io_epoll.py"),
                _frame("epoll.poll", "<built-in>"),
            ],
            profile.IDLE,
        ),
        (
            [
                _frame("_serve", APP),
                _frame("preprocess", PIPE),
                _frame("render", PRE + "template.py"),
                _frame("join", "<built-in>"),
            ],
            "template",
        ),
        (
            [
                _frame("_serve", APP),
                _frame("encode", PRE + "pool.py"),
                _frame("encode", PRE + "tokenizer.py"),
            ],
            "tokenize",
        ),
        ([_frame("_parse", APP), _frame("loads", "<built-in>")], "receive+parse"),
        ([_frame("_stream_on", PIPE), _frame("stream", "/r/frontend/plane/memory.py")], "route"),
        ([_frame("step", "/r/workers/engines/mocker/engine.py")], "engine (in-process mocker)"),
        ([_frame("_stream", APP), _frame("delta", "/r/frontend/http/responses.py")], "stream out"),
        ([_frame("render", "/r/frontend/metrics.py")], "observability"),
        ([_frame("protocol_send", "/v/site-packages/hypercorn/trio/tcp_server.py")], "stream out"),
        ([_frame("_read_data", "/v/site-packages/hypercorn/trio/tcp_server.py")], "receive+parse"),
        (
            [
                _frame("_read_data", "/r/frontend/http/serving/tcp_server.py"),
                _frame("receive_some", "/v/site-packages/trio/_highlevel_socket.py"),
            ],
            "receive+parse",
        ),
        (
            [
                _frame("protocol_send", "/r/frontend/http/serving/tcp_server.py"),
                _frame("_write_now", "/r/frontend/http/serving/tcp_server.py"),
            ],
            "stream out",
        ),
        (
            [
                _frame("protocol_send", "/r/frontend/http/serving/tcp_server.py"),
                _frame("_send_bounded", "/r/frontend/http/serving/tcp_server.py"),
                _frame("send_all", "/v/site-packages/trio/_highlevel_socket.py"),
            ],
            "stream out",
        ),
        ([_frame("reschedule", TRIO)], "HTTP server + trio (other)"),
    ],
)
def test_stage_of_takes_the_innermost_stage_frame(stack: list[str], stage: str) -> None:
    assert profile.stage_of(ROOT + stack) == stage


def test_attribute_windows_and_costs() -> None:
    tok = [*ROOT, _frame("encode", "/r/frontend/preprocess/pool.py")]
    parse = [*ROOT, _frame("_parse", "/r/frontend/http/app.py")]
    idle = [*ROOT, _frame("get_events", "/v/site-packages/trio/_core/_io_epoll.py")]
    # 1 s of start-up (tokenize: loading), then the window: 0.3 s parse, 0.1 s tokenize, idle.
    records = [(tok, 1.0), (parse, 0.3), (tok, 0.1), (idle, 0.6)]
    shares = profile.attribute(records, window=(1.05, 2.0))
    assert shares.seconds == pytest.approx({"receive+parse": 0.3, "tokenize": 0.1})
    assert shares.idle_s == pytest.approx(0.6)
    assert shares.share("receive+parse") == pytest.approx(0.75)
    costs = profile.stage_costs(shares, profile.ThreadCpu(0.8, 0.2, 0.1), requests=100)
    assert costs["receive+parse"] == pytest.approx(6.0)  # 75% of 8 ms loop CPU per request
    assert costs["tokenize"] == pytest.approx(2.0 + 2.0)  # 25% of the loop + tokenizer threads
    assert costs["other threads"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        profile.stage_costs(shares, profile.ThreadCpu(0, 0, 0), requests=0)


async def test_read_threads_counts_trio_worker_threads_as_tokenizer() -> None:
    before = profile.read_threads(os.getpid())

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.15:
            pass

    await trio.to_thread.run_sync(burn)  # on a "Trio thread N" OS thread, kept by trio's cache
    burnt, release = threading.Event(), threading.Event()

    def plain() -> None:  # a thread of another name counts as "other"
        burn()
        burnt.set()
        release.wait(10)

    other = threading.Thread(target=plain)
    other.start()
    try:
        assert burnt.wait(10)
        delta = profile.read_threads(os.getpid()).since(before)  # while both threads live
    finally:
        release.set()
        other.join()
    assert delta.tokenizer_s >= 0.1
    assert delta.other_s >= 0.1
    with pytest.raises(ProcessLookupError):
        profile.read_threads(2**22 + 1)


def test_thread_delta_survives_threads_coming_and_going() -> None:
    before = profile.ThreadSample({1: ("loop", 5.0), 2: ("tokenizer", 3.0), 3: ("other", 1.0)})
    # Thread 2 retired (its 3 s are history, not negative); thread 4 started during the run.
    after = profile.ThreadSample({1: ("loop", 6.5), 3: ("other", 1.25), 4: ("tokenizer", 0.5)})
    delta = after.since(before)
    assert (delta.loop_s, delta.tokenizer_s, delta.other_s) == (1.5, 0.5, 0.25)


# --- several frontend processes ---------------------------------------------------------


def test_merged_snapshots_are_the_union_of_the_members() -> None:
    fast = [0.0005] * 97 + [0.003] * 3
    slow = [0.0005] * 95 + [0.04] * 5  # 5 stalls over 20 ms
    a, b = _snap(fast, 0.004), _snap(slow, 0.045)
    merged = timeline.merge_snapshots([a, b])
    assert merged is not None
    union = _snap(fast + slow, 0.0)  # one canary that saw every delay
    assert merged.delay is not None
    assert union.delay is not None
    assert merged.delay.buckets == union.delay.buckets
    assert merged.delay.count == 200
    assert merged.delay.sum == pytest.approx(union.delay.sum)
    assert merged.max_delay_s == 0.045  # the worst member's gauge
    assert merged.stalls == 5
    # p99 of the union: rank 198 of 200 lands among the slow member's 40 ms delays.
    p99 = merged.delay.quantile(0.99)
    assert p99 is not None
    assert 0.02 < p99 <= 0.05
    assert timeline.merge_snapshots([a, None]) is None  # a member that did not answer
    assert timeline.merge_snapshots([]) is None
    assert timeline.merge_snapshots([a]) is a
    no_gauge = LoopSnapshot(1.0, None, None, None)  # Dynamo-like: nothing exported
    assert timeline.merge_snapshots([no_gauge, no_gauge]) == LoopSnapshot(1.0, None, None, None)


def test_merge_histograms_with_different_bounds_counts_what_each_holds() -> None:
    h1 = Hist(((0.001, 2.0), (0.01, 5.0), (float("inf"), 6.0)), 6.0, 0.1)
    h2 = Hist(((0.005, 3.0), (float("inf"), 4.0)), 4.0, 0.2)
    merged = timeline.merge_histograms([h1, h2])
    assert merged.buckets == ((0.001, 2.0), (0.005, 5.0), (0.01, 8.0), (float("inf"), 10.0))
    assert merged.count == 10.0
    assert merged.sum == pytest.approx(0.3)
    with pytest.raises(ValueError):
        timeline.merge_histograms([])


def test_run_snapshots_keep_only_members_that_answered_twice() -> None:
    a0, a1 = _snap([0.0005] * 10, 0.001), _snap([0.0005] * 30, 0.001)
    b0 = _snap([0.0005] * 1000, 0.2)  # answered before the run only
    before, after = measure.merge_run_snapshots([a0, b0], [a1, None])
    assert (before, after) == (a0, a1)  # b's 1000 old samples must not enter the delta
    assert before is not None
    assert after is not None
    assert loop_report(before, after).samples == 20
    assert measure.merge_run_snapshots([None], [a1]) == (None, None)
    with pytest.raises(ValueError):
        measure.merge_run_snapshots([a0], [a1, a1])


def test_process_figures_add_up() -> None:
    a = ProcSample(10, 5.0, 1.5, 100 * 2**20, 120 * 2**20)
    b = ProcSample(11, 5.1, 2.5, 200 * 2**20, 210 * 2**20)
    total = timeline.sum_samples([a, b])
    assert total == ProcSample(10, 5.1, 4.0, 300 * 2**20, 330 * 2**20)
    assert timeline.sum_samples([a, None]) is None  # a process gone: no partial sum
    assert timeline.sum_samples([]) is None
    reports = [ProcReport(10, 1.0, 50.0, 2**20), ProcReport(11, 2.0, 90.0, 3 * 2**20)]
    assert measure.sum_reports(reports) == ProcReport(10, 3.0, 140.0, 4 * 2**20)
    assert measure.sum_reports([]) is None
    cpu = measure.sum_thread_cpu(
        [profile.ThreadCpu(1.0, 0.5, 0.25), profile.ThreadCpu(2.0, 1.5, 0.25)]
    )
    assert cpu == profile.ThreadCpu(3.0, 2.0, 0.5)
    assert measure.sum_thread_cpu([]) is None


def _server(**overrides: Any) -> servers.ServerInfo:
    fields: dict[str, Any] = {
        "kind": "headwater",
        "variant": "fastokens/thread ×2 procs",
        "base_url": "http://127.0.0.1:9000",
        "model": "m",
        "pids": (10, 11, 12, 20),
        "metrics_prefix": "headwater_frontend_",
        "stall_threshold_ms": 20.0,
        "log_path": Path("x.log"),
        "frontend_pids": (11, 12),
        "member_urls": ("http://127.0.0.1:9001", "http://127.0.0.1:9002"),
    }
    fields.update(overrides)
    return servers.ServerInfo(**fields)


def test_server_info_defaults_to_one_serving_process() -> None:
    single = _server(pids=(10, 20), frontend_pids=(), member_urls=())
    assert single.frontend_pids == (10,)
    assert single.member_urls == ("http://127.0.0.1:9000",)
    assert single.member_metrics_urls == ("http://127.0.0.1:9000/metrics",)
    assert (single.frontend_group, single.frontend_processes) == ((10,), 1)
    multi = _server()
    assert (multi.frontend_group, multi.frontend_processes) == ((10, 11, 12), 2)
    assert multi.member_metrics_urls[1] == "http://127.0.0.1:9002/metrics"
    with pytest.raises(ValueError):
        _server(member_urls=("http://127.0.0.1:9001",))


def _load_result(ok: int) -> LoadResult:
    records = tuple(
        RequestRecord(i, i, 0.01 * i, 0.05, 0.05, (), 1, 100, 8, 200, True, False, None)
        for i in range(ok)
    )
    return LoadResult(
        "http://127.0.0.1:9000/v1/chat/completions",
        4,
        ok,
        30.0,
        False,
        0.0,
        1.0,
        ok,
        False,
        records,
        ClientUsage(0.1, 0.0, 1000),
    )


def test_build_record_sums_supervisor_and_members_but_not_workers() -> None:
    mb = 2**20
    before = (  # supervisor 10, members 11 and 12, worker 20: (pid, t, CPU, RSS, peak RSS)
        ProcSample(10, 0.0, 1.0, 40 * mb, 40 * mb),
        ProcSample(11, 0.0, 5.0, 250 * mb, 260 * mb),
        ProcSample(12, 0.0, 6.0, 240 * mb, 250 * mb),
        ProcSample(20, 0.0, 9.0, 90 * mb, 90 * mb),
    )
    cpu_used = {10: 0.01, 11: 0.4, 12: 0.6, 20: 0.3}
    after = tuple(
        ProcSample(
            p.pid, 2.0, p.cpu_s + cpu_used[p.pid], p.rss_bytes + 10 * mb, p.peak_rss_bytes + 10 * mb
        )
        for p in before
    )
    loop_a0, loop_a1 = _snap([0.0005] * 10, 0.002), _snap([0.0005] * 60, 0.002)
    loop_b0, loop_b1 = _snap([0.0005] * 10, 0.001), _snap([0.0005] * 55 + [0.03] * 5, 0.03)
    loop_before, loop_after = measure.merge_run_snapshots([loop_a0, loop_b0], [loop_a1, loop_b1])
    stall = {
        "duration_s": 0.03,
        "cause": "cpu",
        "task": "t",
        "stack": ["f.py:1 in g"],
        "process": 1,
    }
    m = measure.Measurement(
        spec=measure.RunSpec("short", False, 4, 10),
        server=_server(),
        phase="main",
        pair=None,
        result=_load_result(10),
        started_unix=0.0,
        ended_unix=2.0,
        loop_before=loop_before,
        loop_after=loop_after,
        procs_before=before,
        procs_after=after,
        threads=measure.sum_thread_cpu(
            [profile.ThreadCpu(0.3, 0.05, 0.01), profile.ThreadCpu(0.5, 0.05, 0.01)]
        ),
        timeline=(),
        stall_records=(stall,),
        load_avg=(0.0, 0.0, 0.0),
        content_tokens_mean=100,
    )
    r = measure.build_record(m)
    assert r["frontend_processes"] == 2
    assert r["frontend_group_pids"] == [10, 11, 12]
    assert r["frontend_cpu_ms_per_req"] == pytest.approx((0.01 + 0.4 + 0.6) * 1e3 / 10)
    assert r["frontend_cpu_pct"] == pytest.approx(100 * 1.01 / 2)
    assert r["server_cpu_ms_per_req"] == pytest.approx((0.01 + 0.4 + 0.6 + 0.3) * 1e3 / 10)
    assert r["peak_rss_mb"] == pytest.approx(40 + 260 + 250 + 30)  # the worker's 100 left out
    assert r["rss_start_mb"] == pytest.approx(40 + 250 + 240)
    assert r["rss_end_mb"] == pytest.approx(40 + 250 + 240 + 30)
    assert r["loop_samples"] == 100  # 50 per member
    assert r["loop_max_ms"] == 30.0  # the worst member's gauge, which rose in the run
    assert r["loop_max_exact"] is True
    assert r["stalls"] == 5
    # 5 of the 100 are in the (20, 50] ms bucket: interpolated, rank 99 is at 44 ms, above
    # the 30 ms the gauge saw; the p99 is capped at the maximum.
    assert r["loop_p99_ms"] == 30.0
    assert r["threads_cpu_ms_per_req"]["loop"] == pytest.approx(80.0)
    assert r["stall_longest"][0]["process"] == 1


def test_process_layout_and_variant_names() -> None:
    members = [
        processes.FrontendMember(1, 12, "http://127.0.0.1:2"),
        processes.FrontendMember(0, 11, "http://127.0.0.1:1"),
    ]
    assert servers.process_layout(10, members, [20, 21]) == (
        (10, 11, 12, 20, 21),
        (11, 12),
        ("http://127.0.0.1:1", "http://127.0.0.1:2"),
    )
    alone = [processes.FrontendMember(0, 10, "http://127.0.0.1:1")]
    assert servers.process_layout(10, alone, []) == ((10,), (10,), ("http://127.0.0.1:1",))
    assert servers.variant_name("fastokens", "thread", "inprocess", 1) == "fastokens/thread"
    assert servers.variant_name("fastokens", "thread", "inprocess", 2) == (
        "fastokens/thread ×2 procs"
    )
    assert servers.variant_name("hf", "inline", "processes", 1) == "hf/inline +worker procs"


_FAKE_SUPERVISOR = """
import sys, time
for i, port in enumerate((41001, 41002)):
    print(f"headwater: process {i} pid {4000 + i} at http://127.0.0.1:{port}")
print("headwater: serving deepseek-v4 on http://127.0.0.1:41000", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
async def test_a_supervisors_start_up_lines_name_the_members(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        child = await processes.spawn_frontend(
            nursery,
            [sys.executable, "-c", _FAKE_SUPERVISOR],
            name="fake",
            log_path=tmp_path / "fake.log",
            ready_within=20,
        )
        try:
            pids, serving, urls = servers.process_layout(child.pid, child.members, [99])
        finally:
            await child.stop(5)
    assert child.address == "http://127.0.0.1:41000"
    assert pids == (child.pid, 4000, 4001, 99)
    assert serving == (4000, 4001)
    assert urls == ("http://127.0.0.1:41001", "http://127.0.0.1:41002")


def test_the_multi_process_variant_is_planned(tmp_path: Path) -> None:
    def cfg(n: int, **kw: Any) -> suite.SuiteConfig:
        return suite.SuiteConfig(
            out_dir=tmp_path,
            repo_root=tmp_path,
            quick=True,
            matrix=False,
            profile=False,
            frontend_processes=n,
            **kw,
        )

    assert suite.headwater_variants(cfg(2)) == [
        suite.HeadwaterVariant("inprocess", 1),
        suite.HeadwaterVariant("inprocess", 2),
    ]
    assert (
        suite.headwater_variants(cfg(0))
        == suite.headwater_variants(cfg(1))
        == [suite.HeadwaterVariant("inprocess", 1)]
    )
    both = cfg(3, topologies=("inprocess", "processes"))
    assert [(v.topology, v.frontend_processes) for v in suite.headwater_variants(both)] == [
        ("inprocess", 1),
        ("processes", 1),
        ("inprocess", 3),
        ("processes", 3),
    ]
    plan = len(suite.main_plan(cfg(2)))
    # Per Dynamo tokenizer: each spec once per headwater server and once for Dynamo.
    assert suite.Suite(cfg(2)).planned_runs(2) == plan * 3 * 2
    assert suite.Suite(cfg(1)).planned_runs(0) == plan
    assert suite.Suite(cfg(2, rounds=3)).planned_runs(2) == plan * 3 * 2 * 3


def test_each_round_pairs_its_own_runs() -> None:
    spec = measure.RunSpec("short", True, 64, 100)
    assert suite.pair_id("vs dynamo fastokens", spec, 0, 1) == (
        "vs dynamo fastokens: short stream c64"
    )
    ids = {suite.pair_id("vs dynamo fastokens", spec, i, 3) for i in range(3)}
    assert ids == {f"vs dynamo fastokens: short stream c64 #{i}" for i in (1, 2, 3)}


def test_bench_cli_chooses_the_process_count(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)

    def count(*argv: str) -> int:
        args = parser.parse_args(["--dynamo-install-dir", str(tmp_path), *argv])
        n: int = bench._config(args, tmp_path / "run").frontend_processes
        return n

    assert count("--frontend-processes", "3") == 3
    assert count("--frontend-processes", "0") == 0
    cpus = len(os.sched_getaffinity(0))
    assert count() == (cpus if cpus > 1 else 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--frontend-processes", "-1"])
    assert "--frontend-processes 0" in bench._command(
        parser.parse_args(["--frontend-processes", "0"])
    )
    rounds = parser.parse_args(["--dynamo-install-dir", str(tmp_path), "--rounds", "3"])
    assert bench._config(rounds, tmp_path / "run").rounds == 3
    assert "--rounds 3" in bench._command(rounds)
    assert "--rounds" not in bench._command(parser.parse_args([]))


async def test_the_suite_runs_beside_the_dynamo_tokenizers_asked_for(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dynamo-tokenizers", "fastokens,sentencepiece"])
    asked = parser.parse_args(
        [
            "--dynamo-install-dir",
            str(tmp_path),
            "--dynamo-tokenizers",
            "fastokens",
            "--requests-scale",
            "6",
        ]
    )
    command = bench._command(asked)
    assert "--dynamo-tokenizers fastokens" in command
    assert "--requests-scale 6" in command
    plain = parser.parse_args([])
    assert "--dynamo-tokenizers" not in bench._command(plain)
    assert "--requests-scale" not in bench._command(plain)

    async def installed(*_: Any) -> str:
        return "1.6.1"

    monkeypatch.setattr(suite, "ensure_dynamo", installed)
    both = parser.parse_args(["--dynamo-install-dir", str(tmp_path)])
    for args, phases in ((asked, ["fastokens"]), (both, ["default", "fastokens"])):
        cfg = bench._config(args, tmp_path / "run")
        assert await suite.Suite(cfg)._check_dynamo() == phases


def _multi(**overrides: Any) -> dict[str, Any]:
    return _record(
        variant="fastokens/thread ×2 procs",
        label="headwater fastokens/thread ×2 procs",
        frontend_processes=2,
        **overrides,
    )


def test_report_judges_the_multi_process_variant_beside_the_default() -> None:
    pair = "vs dynamo fastokens: long unary c16"
    runs = [
        *_pair_runs(120.0, 100.0),
        _multi(
            pair=pair,
            req_per_s=190.0,
            loop_max_ms=35.0,
            started_unix=1012.0,
            rss_end_mb=600.0,
            peak_rss_mb=640.0,
            prompt_tokens_per_s=7_000_000.0,
        ),
    ]
    label = "headwater fastokens/thread ×2 procs"
    results = _results(
        runs,
        idle_rss_mb={
            "headwater fastokens/thread": 290.0,
            "headwater fastokens/thread (after warm-up)": 300.0,
            label: 570.0,
            label + " (after warm-up)": 590.0,
            "dynamo fastokens": 285.0,
        },
    )
    assert report.multi_process_labels(results) == [label]
    default = {t.name: t.passed for t in report.targets(results)}
    multi = {t.name: t for t in report.targets(results, label)}
    assert default["long prompts c16: loop max delay"] is True  # the default's 12 ms
    assert multi["long prompts c16: loop max delay"].passed is False  # the variant's 35 ms
    assert default["long prompts c16: req/s vs Dynamo + fastokens"] is False  # 1.2 < 1.5
    assert multi["long prompts c16: req/s vs Dynamo + fastokens"].measured == (
        "long unary c16 1.90×"
    )
    assert multi["long prompts c16: req/s vs Dynamo + fastokens"].passed is True
    assert multi["frontend RSS idle, default tokenizer"].passed is False  # 570 MB in total
    assert "over 2 processes + supervisor" in multi["frontend RSS idle, default tokenizer"].measured
    header, _, *rows = report.all_targets_table(results).splitlines()
    # Judged on the group (headwater serve's default); the one process beside it.
    assert report.judged_label(results) == label
    assert header.endswith("| fastokens/thread |")
    loop_row = next(r for r in rows if r.startswith("| long prompts c16: loop max delay"))
    assert "| worst 35.0 ms over 1 runs | **missed** |" in loop_row
    assert loop_row.endswith("(met) |")
    memory = {row[0]: row[1] for row in report.memory_rows(results)}
    assert memory[f"{label} (total: supervisor + 2 processes)"] == "570"
    assert memory[f"{label} (after warm-up; total: supervisor + 2 processes)"] == "590"
    assert memory["headwater fastokens/thread (after warm-up)"] == "300"
    assert (
        memory[f"{label}: peak RSS (VmHWM) over the main phase (total: supervisor + 2 processes)"]
        == "640"
    )
    (fastokens,) = report.limit_rows(results)
    assert fastokens["achieved"] == 7_000_000.0  # the variant's run is the best
    assert fastokens["run"].endswith("(fastokens/thread ×2 procs)")
    text = report.render(results)
    assert "`headwater serve`'s default (a process per usable core)" in text
    assert "| fastokens/thread ×2 procs | long unary c16 |" in text  # its ratio row
    # Without such a run the report is as before: no extra column.
    plain = _results(_pair_runs(120.0, 100.0))
    assert report.all_targets_table(plain) == report.targets_table(report.targets(plain))
    assert "a process per usable core" not in report.render(plain)


def test_report_judges_whether_a_group_shares_its_memory() -> None:
    label = "headwater fastokens/thread ×2 procs"
    runs = [*_pair_runs(120.0, 100.0), _multi(pair="vs dynamo fastokens: long unary c16")]

    def judged(group_pss: float) -> report.Target:
        memory = {
            "headwater fastokens/thread": {"rss_mb": 240.0, "pss_mb": 220.0},
            label: {
                "rss_mb": 860.0,
                "pss_mb": group_pss,
                "uss_mb": 80.0,
                "processes": [
                    {"role": "supervisor", "pid": 1, "rss_mb": 220.0, "pss_mb": 60.0, "uss_mb": 5.0}
                ],
            },
        }
        results = _results(runs, idle_memory_mb=memory)
        (target,) = [
            t for t in report.targets(results, label) if t.name.startswith("frontend PSS idle")
        ]
        return target

    shared = judged(270.0)
    assert shared.passed is True
    assert "1.23× one process's 220 MB" in shared.measured
    assert judged(300.0).passed is False  # 1.36×
    results = _results(
        runs,
        idle_memory_mb={
            "headwater fastokens/thread": {"rss_mb": 240.0, "pss_mb": 220.0, "uss_mb": 215.0}
        },
    )
    (one,) = [t for t in report.targets(results) if t.name.startswith("frontend PSS idle")]
    assert one.passed is None  # the reference itself
    assert "220 MB (the reference)" in one.measured
    rows = {row[0]: row[1:] for row in report.memory_rows(results)}
    assert rows["headwater fastokens/thread"] == ("290", "220", "215")


# --- report ----------------------------------------------------------------------------


def test_targets_judge_pass_and_miss() -> None:
    good = _results(
        [
            *_pair_runs(160.0, 100.0),
            *_pair_runs(1100.0, 1000.0, key="short unary c16"),
        ]
    )
    verdicts = {t.name: t.passed for t in report.targets(good)}
    assert verdicts["long prompts c16: loop max delay"] is True
    assert verdicts["long prompts c16: loop p99 delay"] is True
    assert verdicts["long prompts c16: req/s vs Dynamo + fastokens"] is True  # 1.6 ≥ 1.5
    assert verdicts["short prompts: req/s vs Dynamo + fastokens"] is True  # 1.1 ≥ 1.0
    assert verdicts["shared prefix: req/s vs Dynamo + fastokens"] is None  # not run
    assert verdicts["every scenario: req/s vs Dynamo (default tokenizer)"] is None
    assert verdicts["frontend RSS idle, default tokenizer"] is True  # 290 < 300
    assert verdicts["frontend RSS flat across the run"] is True  # 300 → 305 MB

    bad_runs = _pair_runs(140.0, 100.0) + _pair_runs(950.0, 1000.0, key="short unary c16")
    bad_runs[0].update(loop_max_ms=35.0, loop_p99_ms=6.0, rss_end_mb=400.0)
    bad = _results(
        bad_runs,
        idle_rss_mb={
            "headwater fastokens/thread": 310.0,
            "headwater fastokens/thread (after warm-up)": 300.0,
        },
    )
    verdicts = {t.name: t.passed for t in report.targets(bad)}
    assert not any(
        verdicts[n]
        for n in (
            "long prompts c16: loop max delay",
            "long prompts c16: loop p99 delay",
            "long prompts c16: req/s vs Dynamo + fastokens",
            "short prompts: req/s vs Dynamo + fastokens",
            "frontend RSS idle, default tokenizer",
            "frontend RSS flat across the run",
        )
    )


@pytest.mark.parametrize(("second_pass_mb", "flat"), [(345.0, True), (400.0, False)])
def test_rss_flat_compares_the_two_passes(second_pass_mb: float, flat: bool) -> None:
    runs = [
        _record(phase="vs dynamo default", started_unix=1.0, rss_end_mb=330.0),
        _record(phase="vs dynamo default", started_unix=2.0, rss_end_mb=340.0),
        _record(phase="vs dynamo fastokens", started_unix=3.0, rss_end_mb=350.0),
        _record(phase="vs dynamo fastokens", started_unix=4.0, rss_end_mb=second_pass_mb),
    ]
    target = report.rss_flat(_results(runs))
    assert target.passed is flat
    assert "after pass 1 340 MB" in target.measured


def test_ratio_table_divides_adjacent_runs() -> None:
    runs = _pair_runs(150.0, 100.0)
    (pair,) = report.pairs(runs)
    assert pair.ratio("req_per_s") == pytest.approx(1.5)
    assert pair.ratio("ttft_p50_ms") == pytest.approx(0.5)
    assert pair.ratio("itl_p50_ms") is None  # unary: no ITL
    row = report.ratio_table([pair]).splitlines()[2]
    assert "| 1.50 |" in row
    assert "0.50 / 1.00" in row  # TTFT p50 / p99 ratios


def _rounds(key: str, hw_dyn: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """The runs of *key* repeated over rounds, each round its own pair."""
    runs = []
    for i, (hw, dyn) in enumerate(hw_dyn, 1):
        for r in _pair_runs(hw, dyn, key=key):
            r["pair"] += f" #{i}"
            runs.append(r)
    return runs


def test_rounds_are_summarised_by_their_median() -> None:
    runs = _rounds("short unary c16", [(900.0, 1000.0), (1300.0, 1000.0), (1150.0, 1000.0)])
    (group,) = report.group_pairs(report.pairs(runs))
    assert len(group.pairs) == 3
    assert group.ratio("req_per_s") == pytest.approx(1.15)
    assert group.ratio_range("req_per_s") == pytest.approx((0.9, 1.3))
    assert group.median("headwater", "req_per_s") == 1150.0
    row = report.ratio_table(report.pairs(runs)).splitlines()[2]
    assert "| 1,150 | 1,000 | 1.15 (0.90-1.30, 3 rounds) |" in row
    # The verdict goes by the median round, not by the best or the worst one.
    target = {t.name: t for t in report.targets(_results(runs))}[
        "short prompts: req/s vs Dynamo + fastokens"
    ]
    assert target.passed is True  # 1.15 ≥ 1.0, though one round read 0.90
    assert target.measured == "short unary c16 1.15× (0.90-1.30, 3 rounds)"
    low = _rounds("short unary c16", [(900.0, 1000.0), (950.0, 1000.0), (1300.0, 1000.0)])
    assert {t.name: t for t in report.targets(_results(low))}[
        "short prompts: req/s vs Dynamo + fastokens"
    ].passed is False  # median 0.95


def test_render_and_update_docs_keep_the_prose(tmp_path: Path) -> None:
    results = _results(
        [
            *_pair_runs(120.0, 100.0),
            _record(
                phase="matrix",
                variant="hf/inline",
                label="headwater hf/inline",
                loop_max_ms=900.0,
                loop_max_exact=False,
                req_per_s=5.0,
            ),
        ]
    )
    text = report.render(results, [("chart", "img/chart.png")])
    assert "### Targets" in text
    assert "headwater ÷ Dynamo" in text
    assert "hf/inline" in text
    assert "≤ 900" in text  # a bound, not an exact maximum
    assert "![chart](img/chart.png)" in text
    page = tmp_path / "performance.md"
    page.write_text(f"# Perf\n\nhand-written notes\n\n{report.BEGIN}\nold\n{report.END}\n\ntail\n")
    report.update_docs(page, text, skeleton="unused")
    updated = page.read_text()
    assert "hand-written notes" in updated
    assert updated.endswith("tail\n")
    assert "old" not in updated
    assert text.strip() in updated
    page.write_text(f"{report.END} before {report.BEGIN}")
    with pytest.raises(ValueError):
        report.update_docs(page, text, skeleton="unused")


def test_the_docs_section_links_every_run_to_a_page_of_its_own() -> None:
    results = _results(_pair_runs(120.0, 100.0))
    header = "| phase | server | run | ok/req |"
    inline = report.render(results)
    assert header in inline  # report.md keeps the table
    linked = report.render(results, runs_page="bench-runs.md")
    assert header not in linked
    assert "[bench-runs.md](bench-runs.md)" in linked
    assert "### Targets" in linked
    assert "headwater ÷ Dynamo" in linked
    page = report.render_runs_page(results, command="make bench", results_page="performance.md")
    assert page.startswith("# Benchmark runs")
    assert header in page
    assert "[performance.md](performance.md#results)" in page


@pytest.mark.slow
def test_render_command_publishes_report_and_charts(tmp_path: Path) -> None:
    matrix = [
        _record(
            phase="matrix",
            variant=f"{b}/{m}",
            label=f"headwater {b}/{m}",
            req_per_s=5.0 if b == "hf" else 100.0,
        )
        for b in ("fastokens", "hf")
        for m in ("inline", "thread")
    ]
    profiled = {
        "key": "long unary c16",
        "scenario": "long",
        "requests": 100,
        "req_per_s": 50,
        "frontend_cpu_ms_per_req": 25.0,
        "loop_busy_s": 1.0,
        "loop_idle_s": 1.0,
        "stage_ms_per_req": {s: 1.0 for s in (*profile.STAGES, "other threads")},
        "stage_share_of_loop": {s: 1 / len(profile.STAGES) for s in profile.STAGES},
        "session": "x",
    }
    results = _results(
        [*_pair_runs(120.0, 100.0), *_pair_runs(900.0, 1000.0, "short unary c16"), *matrix],
        profile=[profiled],
    )
    path = tmp_path / "run" / "results.json"
    path.parent.mkdir()
    path.write_bytes(orjson.dumps(results))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(["--render", str(path)])) == 0
    text = (path.parent / "report.md").read_text()
    assert "Frontend CPU per request by stage" in text
    images = sorted(p.name for p in (path.parent / "img").iterdir())
    assert images == sorted(
        [
            "throughput.png",
            "ttft.png",
            "loop_delay_by_mode.png",
            "matrix.png",
            "stages.png",
            "rss_over_time.png",
        ]
    )
    for name in images:
        data = (path.parent / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG")
        assert len(data) > 5000
    assert plots.plot_all(_results([]), tmp_path / "empty") == []


# --- one real run -----------------------------------------------------------------------

RECORD_FIELDS = {
    "phase",
    "server",
    "variant",
    "label",
    "scenario",
    "key",
    "stream",
    "concurrency",
    "requests",
    "ok",
    "failed",
    "req_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "frontend_cpu_ms_per_req",
    "server_cpu_ms_per_req",
    "peak_rss_mb",
    "loop_p99_ms",
    "loop_max_ms",
    "loop_max_exact",
    "stalls",
    "client_cpu_s",
    "client_cpu_pct",
    "threads_cpu_ms_per_req",
    "timeline",
}


@pytest.mark.slow
async def test_a_tiny_real_run_writes_complete_records(tmp_path: Path) -> None:
    cfg = suite.SuiteConfig(
        out_dir=tmp_path / "out",
        repo_root=bench.REPO_ROOT,
        scenarios=("short",),
        quick=True,
        dynamo=True,
        dynamo_scripts=tmp_path / "no-dynamo-here",
        dynamo_install=tmp_path / "dyn",
        matrix=False,
        profile=False,
        progress=False,
        requests={("short", 4): 10},
        concurrency={"short": (4,)},
        time_limit_s=30.0,
        idle_settle_s=0.2,
        frontend_processes=2,
    )
    with trio.fail_after(90):
        results = await suite.Suite(cfg, log=lambda _: None).run()
    assert results.finished
    assert any("no Dynamo peer scripts" in s for s in results.skipped)
    lines = (cfg.out_dir / "runs.jsonl").read_bytes().splitlines()
    records = [orjson.loads(line) for line in lines]
    multi = "headwater fastokens/thread ×2 procs"
    assert [(r["key"], r["label"]) for r in records] == [
        ("short unary c4", "headwater fastokens/thread"),
        ("short unary c4", multi),
        ("short stream c4", "headwater fastokens/thread"),
        ("short stream c4", multi),
    ]
    for r in records:
        assert r.keys() >= RECORD_FIELDS
        assert (r["ok"], r["requests"], r["failed"]) == (10, 10, 0), r["first_error"]
        assert r["server"] == "headwater"
        assert r["req_per_s"] > 0
        assert r["frontend_cpu_ms_per_req"] > 0
        assert r["peak_rss_mb"] > 50 * r["frontend_processes"]
        assert r["loop_p99_ms"] is not None
        assert r["loop_max_ms"] is not None
        assert r["threads_cpu_ms_per_req"]["loop"] > 0
        assert r["prompt_tokens_mean"] > 100  # ~100 content tokens + the chat template
        assert len(r["timeline"]) >= 1
    assert records[2]["itl_p50_ms"] is not None  # streamed: gaps between chunks
    assert records[0]["itl_p50_ms"] is None
    single, double = records[0], records[1]
    assert (single["frontend_processes"], double["frontend_processes"]) == (1, 2)
    assert single["frontend_group_pids"] == single["server_pids"][:1]
    # The supervisor, its zygote and two members; their PSS together is the group's.
    assert len(set(double["frontend_group_pids"])) == 4
    assert double["pss_end_mb"] < double["rss_end_mb"]  # the members share the tokenizer
    saved = orjson.loads((cfg.out_dir / "results.json").read_bytes())
    assert saved["runs"] == records
    assert saved["idle_rss_mb"]["headwater fastokens/thread"] > 50
    # Two whole frontends (and a supervisor) hold more than one.
    assert saved["idle_rss_mb"][multi] > saved["idle_rss_mb"]["headwater fastokens/thread"]
    roles = [p["role"] for p in saved["idle_memory_mb"][multi]["processes"]]
    assert roles == ["supervisor", "zygote", "process 0", "process 1"]
    assert saved["machine"]["usable_cpus"] >= 1
