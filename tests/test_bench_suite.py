"""The benchmark suite: records, timelines, stage attribution, report, charts, one real run.

Test policy: loopback only; the one end-to-end test starts a real ``headwater serve``
subprocess on a free port (``--port 0``) and sends ten requests per run, bounded by a
time limit; everything else runs on synthetic data. No Dynamo is started: the suite is
pointed at a directory without its scripts and must skip it with a message.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from headwater import bench
from scripts.bench import measure, plots, profile, report, suite, timeline
from scripts.bench.scrape import ProcSample, parse_loop

# --- synthetic data -------------------------------------------------------------------


def _exposition(delays: list[float], max_delay: float) -> str:
    reg = CollectorRegistry()
    hist = Histogram("headwater_frontend_event_loop_delay_seconds", "d", registry=reg,
                     buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1))  # fmt: skip
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
        "phase": "vs dynamo fastokens", "pair": None, "server": "headwater",
        "variant": "fastokens/thread", "label": "headwater fastokens/thread",
        "scenario": "long", "key": "long unary c16", "started_unix": 1000.0,
        "ended_unix": 1010.0, "load_avg_1m": 0.3, "content_tokens_mean": 40000.0,
        "max_tokens": 8, "stream": False, "concurrency": 16, "requests": 100, "ok": 100,
        "failed": 0, "cut_off": 0, "wall_s": 1.0, "req_per_s": 100.0,
        "output_tokens_per_s": 800.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0,
        "itl_p50_ms": None, "itl_p99_ms": None, "e2e_p50_ms": 50.0, "e2e_p99_ms": 90.0,
        "prompt_tokens_mean": 40010.0, "completion_tokens_mean": 8.0, "client_cpu_s": 0.1,
        "client_cpu_pct": 10.0, "first_error": None, "prompt_tokens_per_s": 4_001_000.0,
        "frontend_cpu_s": 1.0, "frontend_cpu_ms_per_req": 10.0, "frontend_cpu_pct": 50.0,
        "server_cpu_ms_per_req": 10.0, "server_pids": [1], "peak_rss_mb": 320.0,
        "rss_start_mb": 300.0, "rss_end_mb": 305.0, "loop_samples": 100,
        "loop_mean_ms": 1.0, "loop_p99_ms": 3.0, "loop_max_ms": 12.0, "loop_max_exact": True,
        "stalls": 0, "stall_threshold_ms": 20.0, "stall_records": 0,
        "stall_record_max_ms": None, "threads_cpu_s": {"loop": 0.8, "tokenizer": 0.15,
                                                       "other": 0.05},
        "threads_cpu_ms_per_req": {"loop": 8.0, "tokenizer": 1.5, "other": 0.5},
        "timeline": [
            {"t_s": 0.25 * i, "loop_samples": 25, "loop_p99_ms": 1.0 + i % 3,
             "loop_max_ms": 5.0, "rss_mb": 300.0 + i, "cpu_pct": 50.0} for i in range(1, 9)
        ],
    }  # fmt: skip
    r.update(overrides)
    return r


def _results(runs: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "config": {}, "started": "2026-11-29T22:00:00", "quick": False,
        "machine": {"nproc": 2, "usable_cpus": 2, "cpu_model": "test CPU", "memory_gb": 8,
                    "os": "Linux", "python": "3.11", "packages": {"trio": "0.35"},
                    "commit": "abc1234", "dirty": False},
        "load_avg_start": [0.2, 0.2, 0.2], "load_avg_end": [0.4, 0.3, 0.2],
        "runs": runs, "calibration": [
            {"backend": "fastokens", "texts": 8, "tokens": 1, "tokens_per_cpu_s": 10_000_000,
             "tokens_per_wall_s": 9_000_000},
        ],
        "idle_rss_mb": {"headwater fastokens/thread": 290.0,
                        "headwater fastokens/thread (after warm-up)": 300.0,
                        "dynamo fastokens": 285.0},
        "profile": [], "skipped": [], "dynamo_version": "1.6.1", "finished": True,
        "elapsed_s": 100.0,
    }  # fmt: skip
    res.update(overrides)
    return res


def _pair_runs(hw_rps: float, dyn_rps: float, key: str = "long unary c16") -> list[dict]:
    scenario = key.split()[0]
    pair = f"vs dynamo fastokens: {key}"
    common = {"pair": pair, "key": key, "scenario": scenario,
              "concurrency": int(key.rsplit("c", 1)[1])}  # fmt: skip
    return [
        _record(**common, req_per_s=hw_rps, ttft_p50_ms=40.0),
        _record(**common, server="dynamo", variant="fastokens", label="dynamo fastokens",
                req_per_s=dyn_rps, ttft_p50_ms=80.0, started_unix=1011.0),
    ]  # fmt: skip


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
    report_rose = measure.loop_report(before, rose)
    assert measure.loop_max(report_rose, before, 0.05) == (0.045, True)
    flat = _snap([0.0005] * 10 + [0.004], 0.030)
    # The gauge still says 30 ms (an earlier run); the run's own bound is the 5 ms bucket.
    assert measure.loop_max(measure.loop_report(before, flat), before, 0.005) == (0.005, False)
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
        ([_frame("get_events", "/v/site-packages/trio/_core/_io_epoll.py"),
          _frame("epoll.poll", "<built-in>")], profile.IDLE),
        ([_frame("_serve", APP), _frame("preprocess", PIPE),
          _frame("render", PRE + "template.py"), _frame("join", "<built-in>")], "template"),
        ([_frame("_serve", APP), _frame("encode", PRE + "pool.py"),
          _frame("encode", PRE + "tokenizer.py")], "tokenize"),
        ([_frame("_parse", APP), _frame("loads", "<built-in>")], "receive+parse"),
        ([_frame("_stream_on", PIPE), _frame("stream", "/r/frontend/plane/memory.py")], "route"),
        ([_frame("step", "/r/workers/engines/mocker/engine.py")], "engine (in-process mocker)"),
        ([_frame("_stream", APP), _frame("delta", "/r/frontend/http/responses.py")], "stream out"),
        ([_frame("render", "/r/frontend/metrics.py")], "observability"),
        ([_frame("protocol_send", "/v/site-packages/hypercorn/trio/tcp_server.py")], "stream out"),
        ([_frame("_read_data", "/v/site-packages/hypercorn/trio/tcp_server.py")], "receive+parse"),
        ([_frame("reschedule", TRIO)], "HTTP server + trio (other)"),
    ],
)  # fmt: skip
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


# --- report ----------------------------------------------------------------------------


def test_targets_judge_pass_and_miss() -> None:
    good = _results([
        *_pair_runs(120.0, 100.0),
        *_pair_runs(800.0, 1000.0, key="short unary c16"),
    ])  # fmt: skip
    verdicts = {t.name: t.passed for t in report.targets(good)}
    assert verdicts["long prompts c16: loop max delay"] is True
    assert verdicts["long prompts c16: loop p99 delay"] is True
    assert verdicts["long prompts c16: req/s vs Dynamo + fastokens"] is True
    assert verdicts["short prompts: req/s vs Dynamo + fastokens"] is True  # 0.8 ≥ 0.7
    assert verdicts["short prompts: req/s vs Dynamo (default tokenizer)"] is None  # not run
    assert verdicts["frontend RSS idle, default tokenizer"] is True  # 290 < 300
    assert verdicts["frontend RSS flat across the run"] is True  # 300 → 305 MB

    bad_runs = _pair_runs(80.0, 100.0) + _pair_runs(600.0, 1000.0, key="short unary c16")
    bad_runs[0].update(loop_max_ms=35.0, loop_p99_ms=6.0, rss_end_mb=400.0)
    bad = _results(bad_runs, idle_rss_mb={"headwater fastokens/thread": 310.0,
                                          "headwater fastokens/thread (after warm-up)": 300.0})
    verdicts = {t.name: t.passed for t in report.targets(bad)}
    assert not any(verdicts[n] for n in (
        "long prompts c16: loop max delay", "long prompts c16: loop p99 delay",
        "long prompts c16: req/s vs Dynamo + fastokens",
        "short prompts: req/s vs Dynamo + fastokens",
        "frontend RSS idle, default tokenizer", "frontend RSS flat across the run",
    ))  # fmt: skip


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


def test_render_and_update_docs_keep_the_prose(tmp_path: Path) -> None:
    results = _results([*_pair_runs(120.0, 100.0), _record(
        phase="matrix", variant="hf/inline", label="headwater hf/inline", loop_max_ms=900.0,
        loop_max_exact=False, req_per_s=5.0)])  # fmt: skip
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


def test_render_command_publishes_report_and_charts(tmp_path: Path) -> None:
    matrix = [_record(phase="matrix", variant=f"{b}/{m}", label=f"headwater {b}/{m}",
                      req_per_s=5.0 if b == "hf" else 100.0)
              for b in ("fastokens", "hf") for m in ("inline", "thread")]  # fmt: skip
    profiled = {"key": "long unary c16", "scenario": "long", "requests": 100, "req_per_s": 50,
                "frontend_cpu_ms_per_req": 25.0, "loop_busy_s": 1.0, "loop_idle_s": 1.0,
                "stage_ms_per_req": {s: 1.0 for s in (*profile.STAGES, "other threads")},
                "stage_share_of_loop": {s: 1 / len(profile.STAGES) for s in profile.STAGES},
                "session": "x"}  # fmt: skip
    results = _results([*_pair_runs(120.0, 100.0), *_pair_runs(900.0, 1000.0, "short unary c16"),
                        *matrix], profile=[profiled])  # fmt: skip
    path = tmp_path / "run" / "results.json"
    path.parent.mkdir()
    path.write_bytes(orjson.dumps(results))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(["--render", str(path)])) == 0
    text = (path.parent / "report.md").read_text()
    assert "Frontend CPU per request by stage" in text
    images = sorted(p.name for p in (path.parent / "img").iterdir())
    assert images == sorted(["throughput.png", "ttft.png", "loop_delay_by_mode.png",
                             "matrix.png", "stages.png", "rss_over_time.png"])  # fmt: skip
    for name in images:
        data = (path.parent / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG")
        assert len(data) > 5000
    assert plots.plot_all(_results([]), tmp_path / "empty") == []


# --- one real run -----------------------------------------------------------------------

RECORD_FIELDS = {
    "phase", "server", "variant", "label", "scenario", "key", "stream", "concurrency",
    "requests", "ok", "failed", "req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
    "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "frontend_cpu_ms_per_req",
    "server_cpu_ms_per_req", "peak_rss_mb", "loop_p99_ms", "loop_max_ms", "loop_max_exact",
    "stalls", "client_cpu_s", "client_cpu_pct", "threads_cpu_ms_per_req", "timeline",
}


async def test_a_tiny_real_run_writes_complete_records(tmp_path: Path) -> None:
    cfg = suite.SuiteConfig(
        out_dir=tmp_path / "out", repo_root=bench.REPO_ROOT, scenarios=("short",),
        quick=True, dynamo=True, dynamo_scripts=tmp_path / "no-dynamo-here",
        dynamo_install=tmp_path / "dyn", matrix=False, profile=False, progress=False,
        requests={("short", 4): 10}, concurrency={"short": (4,)}, time_limit_s=30.0,
        idle_settle_s=0.2,
    )  # fmt: skip
    with trio.fail_after(60):
        results = await suite.Suite(cfg, log=lambda _: None).run()
    assert results.finished
    assert any("no Dynamo peer scripts" in s for s in results.skipped)
    lines = (cfg.out_dir / "runs.jsonl").read_bytes().splitlines()
    records = [orjson.loads(line) for line in lines]
    assert [r["key"] for r in records] == ["short unary c4", "short stream c4"]
    for r in records:
        assert r.keys() >= RECORD_FIELDS
        assert (r["ok"], r["requests"], r["failed"]) == (10, 10, 0), r["first_error"]
        assert r["server"] == "headwater"
        assert r["req_per_s"] > 0
        assert r["frontend_cpu_ms_per_req"] > 0
        assert r["peak_rss_mb"] > 50
        assert r["loop_p99_ms"] is not None
        assert r["loop_max_ms"] is not None
        assert r["prompt_tokens_mean"] > 100  # ~100 content tokens + the chat template
    assert records[1]["itl_p50_ms"] is not None  # streamed: gaps between chunks
    assert records[0]["itl_p50_ms"] is None
    saved = orjson.loads((cfg.out_dir / "results.json").read_bytes())
    assert saved["runs"] == records
    assert saved["idle_rss_mb"]["headwater fastokens/thread"] > 50
    assert saved["machine"]["usable_cpus"] >= 1
