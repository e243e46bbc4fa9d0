"""One measured run: drive a server, sample it, and reduce everything to a JSON record.

:func:`measure` runs the load client (:func:`~scripts.bench.loadgen.run_load_trio`)
beside a 4 Hz sampler (:mod:`scripts.bench.timeline`), with ``/metrics``, ``/proc`` and
(headwater) ``/debug/stalls`` read before and after; :func:`build_record` is the pure
reduction of that :class:`Measurement` to the record ``runs.jsonl`` holds. Figures are
per run: counters and histograms are differences over the run, never since start-up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import trio

from scripts.bench import profile, prompts, timeline
from scripts.bench.loadgen import LoadResult, run_load_trio
from scripts.bench.scrape import (
    LoopReport,
    LoopSnapshot,
    ProcSample,
    loop_report,
    proc_report,
    read_proc,
    scrape_loop,
)
from scripts.bench.servers import ServerInfo, http_get
from scripts.bench.stats import Summary, summarise

MAX_TOKENS = 8
IDLE_SETTLE_S = 2.0  # s after start-up before the idle RSS is read


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One measured run's traffic."""

    scenario: str
    stream: bool
    concurrency: int
    requests: int
    max_tokens: int = MAX_TOKENS

    @property
    def key(self) -> str:
        return f"{self.scenario} {'stream' if self.stream else 'unary'} c{self.concurrency}"


def make_prompt_set(spec: RunSpec) -> prompts.PromptSet:
    """A fresh prompt set for *spec* (a new nonce: no cache hit from an earlier run)."""
    return prompts.make_prompts(spec.scenario, spec.requests)


def bodies_for(ps: prompts.PromptSet, spec: RunSpec, model: str) -> list[bytes]:
    """Chat bodies (``chat_template_kwargs {"thinking": false}``) for one server's model."""
    return prompts.build_bodies(ps, stream=spec.stream, max_tokens=spec.max_tokens, model=model)


# --- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """What :func:`measure` collected around one load run (inputs of :func:`build_record`)."""

    spec: RunSpec
    server: ServerInfo
    phase: str
    pair: str | None
    result: LoadResult
    started_unix: float
    ended_unix: float
    loop_before: LoopSnapshot | None
    loop_after: LoopSnapshot | None
    procs_before: tuple[ProcSample, ...]
    procs_after: tuple[ProcSample, ...]
    threads: profile.ThreadCpu | None
    timeline: tuple[timeline.TimelinePoint, ...]
    stall_records: tuple[dict[str, Any], ...]
    load_avg: tuple[float, float, float]
    content_tokens_mean: float


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def loop_max(
    report: LoopReport | None,
    before: LoopSnapshot | None,
    delta_top_s: float | None,
) -> tuple[float | None, bool]:
    """The run's largest canary delay in seconds, and whether it is exact.

    Exact when the server's max-delay gauge (max since start) rose during the run;
    otherwise an upper bound: the top of the highest histogram bucket the run reached,
    capped by the gauge's earlier value when there is one.
    """
    gauge_after = report.max_delay_s if report is not None else None
    gauge_before = before.max_delay_s if before is not None else None
    if gauge_after is not None and (gauge_before is None or gauge_after > gauge_before):
        return gauge_after, True
    bounds = [b for b in (delta_top_s, gauge_before) if b is not None]
    return (min(bounds) if bounds else None), False


def build_record(m: Measurement) -> dict[str, Any]:
    """The JSON record of one run (pure). Times in ms, CPU per request in ms, RSS in MB."""
    s: Summary = summarise(m.result)
    report = None
    delta_top = None
    if m.loop_after is not None and m.loop_before is not None:
        report = loop_report(m.loop_before, m.loop_after)
        if m.loop_after.delay is not None and m.loop_before.delay is not None:
            delta_top = timeline.highest_bucket(m.loop_after.delay.minus(m.loop_before.delay))
    max_s, exact = loop_max(report, m.loop_before, delta_top)
    procs = [proc_report(b, a) for b, a in zip(m.procs_before, m.procs_after, strict=True)]
    ok = max(1, s.ok)
    frontend = procs[0] if procs else None
    record: dict[str, Any] = {
        **s.to_json(),  # first: the fields below replace its empty label
        "phase": m.phase,
        "pair": m.pair,
        "server": m.server.kind,
        "variant": m.server.variant,
        "label": m.server.label,
        "scenario": m.spec.scenario,
        "key": m.spec.key,
        "started_unix": round(m.started_unix, 3),
        "ended_unix": round(m.ended_unix, 3),
        "load_avg_1m": round(m.load_avg[0], 2),
        "content_tokens_mean": round(m.content_tokens_mean, 1),
        "max_tokens": m.spec.max_tokens,
        "prompt_tokens_per_s": round(s.req_per_s * (s.prompt_tokens_mean or 0.0), 1),
        "frontend_cpu_s": None if frontend is None else round(frontend.cpu_s, 3),
        "frontend_cpu_ms_per_req": None if frontend is None else round(
            frontend.cpu_s * 1e3 / ok, 3),
        "frontend_cpu_pct": None if frontend is None else round(frontend.cpu_pct, 1),
        "server_cpu_ms_per_req": round(sum(p.cpu_s for p in procs) * 1e3 / ok, 3),
        "server_pids": list(m.server.pids),
        "peak_rss_mb": None if frontend is None else round(frontend.peak_rss_bytes / 2**20, 1),
        "rss_start_mb": _rss(m.procs_before),
        "rss_end_mb": _rss(m.procs_after),
        "loop_samples": report.samples if report else 0,
        "loop_mean_ms": _ms(report.delay_mean_s if report else None),
        "loop_p99_ms": _ms(report.delay_p99_s if report else None),
        "loop_max_ms": _ms(max_s),
        "loop_max_exact": exact,
        "stalls": None if report is None or report.stalls is None else int(report.stalls),
        "stall_threshold_ms": m.server.stall_threshold_ms,
        "stall_records": len(m.stall_records),
        "stall_record_max_ms": _ms(max((r["duration_s"] for r in m.stall_records), default=None)),
        "stall_longest": longest_stalls(m.stall_records),
        "threads_cpu_s": None if m.threads is None else {
            "loop": round(m.threads.loop_s, 4),
            "tokenizer": round(m.threads.tokenizer_s, 4),
            "other": round(m.threads.other_s, 4),
        },
        "threads_cpu_ms_per_req": None if m.threads is None else {
            "loop": round(m.threads.loop_s * 1e3 / ok, 3),
            "tokenizer": round(m.threads.tokenizer_s * 1e3 / ok, 3),
            "other": round(m.threads.other_s * 1e3 / ok, 3),
        },
        "timeline": [p.to_json() for p in m.timeline],
    }  # fmt: skip
    return record


def longest_stalls(records: Sequence[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The *n* longest stall records, each cut to duration, cause, task and innermost frame."""
    top = sorted(records, key=lambda r: r.get("duration_s", 0.0), reverse=True)[:n]
    return [
        {
            "duration_ms": _ms(r.get("duration_s")),
            "cause": r.get("cause"),
            "task": r.get("task"),
            "where": (r.get("stack") or ["?"])[-1],
        }
        for r in top
    ]


def _rss(samples: Sequence[ProcSample]) -> float | None:
    return round(samples[0].rss_bytes / 2**20, 1) if samples else None


# --- measuring --------------------------------------------------------------------------

async def _scrape(server: ServerInfo) -> LoopSnapshot | None:
    try:
        return await trio.to_thread.run_sync(scrape_loop, server.metrics_url,
                                             server.metrics_prefix, 10.0)  # fmt: skip
    except (OSError, ValueError):
        return None


async def _stall_records(server: ServerInfo, start: float, end: float) -> tuple[dict, ...]:
    """headwater's ``/debug/stalls`` records that started within [start, end] (unix)."""
    if server.kind != "headwater":
        return ()
    try:
        status, body = await trio.to_thread.run_sync(http_get, server.base_url + "/debug/stalls")
    except OSError:
        return ()
    if status != 200:
        return ()
    return tuple(r for r in orjson.loads(body) if start <= r.get("started_at", 0) <= end)


def _procs(pids: Sequence[int]) -> tuple[ProcSample, ...]:
    out = []
    for pid in pids:
        try:
            out.append(read_proc(pid))
        except ProcessLookupError:
            continue
    return tuple(out)


async def measure(
    server: ServerInfo,
    spec: RunSpec,
    bodies: Sequence[bytes],
    *,
    phase: str,
    pair: str | None,
    content_tokens_mean: float,
    time_limit_s: float,
    progress: bool,
) -> Measurement:
    """Drive *server* with *bodies* while sampling its loop, CPU and RSS at 4 Hz.

    Raises :class:`LoadGenError` if the load client fails (failed *requests* are data).
    """
    url = server.base_url + prompts.ENDPOINT_PATHS["chat"]
    load_avg = os.getloadavg()
    loop_before = await _scrape(server)
    procs_before = _procs(server.pids)
    threads_before = _threads(server)
    started = time.time()
    raw: list[timeline.RawSample] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            timeline.sample, server.metrics_url, server.metrics_prefix, server.pids[0],
            trio.current_time(), raw,
        )  # fmt: skip
        result = await run_load_trio(
            url, bodies, spec.concurrency, spec.requests, time_limit_s, spec.stream,
            progress=progress, description=f"{server.label}: {spec.key}",
        )  # fmt: skip
        nursery.cancel_scope.cancel()
    ended = time.time()
    procs_after = _procs(server.pids)
    threads_after = _threads(server)
    loop_after = await _scrape(server)
    stalls = await _stall_records(server, started, ended)
    threads = None
    if threads_before is not None and threads_after is not None:
        threads = threads_after.since(threads_before)
    if len(procs_after) != len(procs_before):  # a server process died: keep what matches
        alive = {p.pid for p in procs_after}
        procs_before = tuple(p for p in procs_before if p.pid in alive)
    return Measurement(
        spec=spec, server=server, phase=phase, pair=pair, result=result,
        started_unix=started, ended_unix=ended, loop_before=loop_before,
        loop_after=loop_after, procs_before=procs_before, procs_after=procs_after,
        threads=threads, timeline=tuple(timeline.timeline_points(raw)),
        stall_records=stalls, load_avg=load_avg, content_tokens_mean=content_tokens_mean,
    )  # fmt: skip


def _threads(server: ServerInfo) -> profile.ThreadSample | None:
    if server.kind != "headwater":
        return None
    try:
        return profile.read_threads(server.pids[0])
    except ProcessLookupError:
        return None


async def warm_up(server: ServerInfo, scenarios: Sequence[str]) -> None:
    """A few unmeasured requests per scenario: first-use costs are not part of a run."""
    for scenario in scenarios:
        n, c = (16, 4) if scenario == "short" else (4, 2)
        spec = RunSpec(scenario, False, c, n)
        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
        bodies = bodies_for(ps, spec, server.model)
        await run_load_trio(server.base_url + prompts.ENDPOINT_PATHS["chat"], bodies, c, n,
                            120.0, False, progress=False)  # fmt: skip


def current_rss_mb(server: ServerInfo) -> float | None:
    """The frontend process's RSS now (``None`` if it is gone)."""
    return _rss(_procs(server.pids[:1]))


async def idle_rss_mb(server: ServerInfo, settle_s: float = IDLE_SETTLE_S) -> float | None:
    """The frontend's RSS after *settle_s* seconds of doing nothing."""
    await trio.sleep(settle_s)
    samples = _procs(server.pids[:1])
    return round(samples[0].rss_bytes / 2**20, 1) if samples else None
