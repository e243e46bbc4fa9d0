"""One measured run: drive a server, sample it, and reduce everything to a JSON record.

:func:`measure` runs the load client (:func:`~scripts.bench.loadgen.run_load_trio`)
beside a 4 Hz sampler (:mod:`scripts.bench.timeline`), with ``/metrics``, ``/proc`` and
(headwater) ``/debug/stalls`` read before and after; :func:`build_record` is the pure
reduction of that :class:`Measurement` to the record ``runs.jsonl`` holds. Figures are
per run: counters and histograms are differences over the run, never since start-up.

A frontend of several processes (``headwater serve --processes N``) is measured member
by member on each member's own URL (the shared port's ``/metrics`` answers from
whichever member takes the connection) and added up: CPU and RSS over the supervisor
and the members (:attr:`ServerInfo.frontend_group`), loop histograms and stall counters
summed and max-delay gauges maxed (:func:`~scripts.bench.timeline.merge_snapshots`),
stall records and per-thread CPU over every member. The record says how many processes
serve (``frontend_processes``).
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
    ProcReport,
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
    loop_before: LoopSnapshot | None  # every member's, merged (see merge_run_snapshots)
    loop_after: LoopSnapshot | None
    procs_before: tuple[ProcSample, ...]  # every process of the server, one each
    procs_after: tuple[ProcSample, ...]
    threads: profile.ThreadCpu | None  # summed over the members
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


def merge_run_snapshots(
    before: Sequence[LoopSnapshot | None], after: Sequence[LoopSnapshot | None]
) -> tuple[LoopSnapshot | None, LoopSnapshot | None]:
    """The members' snapshots before and after a run, merged into one pair (pure).

    Only members that answered both times count, so each difference is taken over the
    same loops; ``(None, None)`` if none did. Raises ValueError for lists of different
    lengths (one snapshot per member, in member order).
    """
    if len(before) != len(after):
        raise ValueError(f"{len(before)} snapshots before, {len(after)} after")
    both = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and a is not None]
    if not both:
        return None, None
    return (
        timeline.merge_snapshots([b for b, _ in both]),
        timeline.merge_snapshots([a for _, a in both]),
    )


def sum_reports(reports: Sequence[ProcReport]) -> ProcReport | None:
    """Several processes' costs over one run as one (pure): CPU seconds and CPU% add up
    (% of one core, so two busy processes make 200), as do the peak RSS figures (each
    process's own high-water mark: a bound on the peak of their sum). The pid is the
    first report's; ``None`` for no reports."""
    if not reports:
        return None
    return ProcReport(
        pid=reports[0].pid,
        cpu_s=sum(r.cpu_s for r in reports),
        cpu_pct=sum(r.cpu_pct for r in reports),
        peak_rss_bytes=sum(r.peak_rss_bytes for r in reports),
    )


def sum_thread_cpu(cpus: Sequence[profile.ThreadCpu]) -> profile.ThreadCpu | None:
    """Per-thread-group CPU of several processes added up (pure); ``None`` for none."""
    if not cpus:
        return None
    return profile.ThreadCpu(
        loop_s=sum(c.loop_s for c in cpus),
        tokenizer_s=sum(c.tokenizer_s for c in cpus),
        other_s=sum(c.other_s for c in cpus),
    )


def build_record(m: Measurement) -> dict[str, Any]:
    """The JSON record of one run (pure). Times in ms, CPU per request in ms, RSS in MB.

    ``frontend_*`` CPU and the RSS figures are over :attr:`ServerInfo.frontend_group`
    (one process, or a supervisor and its members), ``server_*`` over every process.
    """
    s: Summary = summarise(m.result)
    report = None
    delta_top = None
    if m.loop_after is not None and m.loop_before is not None:
        report = loop_report(m.loop_before, m.loop_after)
        if m.loop_after.delay is not None and m.loop_before.delay is not None:
            delta_top = timeline.highest_bucket(m.loop_after.delay.minus(m.loop_before.delay))
    max_s, exact = loop_max(report, m.loop_before, delta_top)
    p99_s = report.delay_p99_s if report else None
    if p99_s is not None and max_s is not None:
        # Interpolating within a bucket can put the p99 above the run's maximum (exact,
        # or a bound on it); the true p99 is not.
        p99_s = min(p99_s, max_s)
    procs = [proc_report(b, a) for b, a in zip(m.procs_before, m.procs_after, strict=True)]
    ok = max(1, s.ok)
    group = m.server.frontend_group
    frontend = sum_reports([p for p in procs if p.pid in group])
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
        "frontend_cpu_ms_per_req": None
        if frontend is None
        else round(frontend.cpu_s * 1e3 / ok, 3),
        "frontend_cpu_pct": None if frontend is None else round(frontend.cpu_pct, 1),
        "server_cpu_ms_per_req": round(sum(p.cpu_s for p in procs) * 1e3 / ok, 3),
        "server_pids": list(m.server.pids),
        "frontend_processes": m.server.frontend_processes,  # serving; a supervisor aside
        "frontend_group_pids": list(group),  # what the frontend_* and RSS figures sum
        "peak_rss_mb": None if frontend is None else round(frontend.peak_rss_bytes / 2**20, 1),
        "rss_start_mb": _rss(m.procs_before, group),
        "rss_end_mb": _rss(m.procs_after, group),
        "pss_start_mb": _mb(m.procs_before, group, "pss_bytes"),
        "pss_end_mb": _mb(m.procs_after, group, "pss_bytes"),
        "uss_end_mb": _mb(m.procs_after, group, "uss_bytes"),
        "loop_samples": report.samples if report else 0,
        "loop_mean_ms": _ms(report.delay_mean_s if report else None),
        "loop_p99_ms": _ms(p99_s),
        "loop_max_ms": _ms(max_s),
        "loop_max_exact": exact,
        "stalls": None if report is None or report.stalls is None else int(report.stalls),
        "stall_threshold_ms": m.server.stall_threshold_ms,
        "stall_records": len(m.stall_records),
        "stall_record_max_ms": _ms(max((r["duration_s"] for r in m.stall_records), default=None)),
        "stall_longest": longest_stalls(m.stall_records),
        "threads_cpu_s": None
        if m.threads is None
        else {
            "loop": round(m.threads.loop_s, 4),
            "tokenizer": round(m.threads.tokenizer_s, 4),
            "other": round(m.threads.other_s, 4),
        },
        "threads_cpu_ms_per_req": None
        if m.threads is None
        else {
            "loop": round(m.threads.loop_s * 1e3 / ok, 3),
            "tokenizer": round(m.threads.tokenizer_s * 1e3 / ok, 3),
            "other": round(m.threads.other_s * 1e3 / ok, 3),
        },
        "timeline": [p.to_json() for p in m.timeline],
    }
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
            **({"process": r["process"]} if "process" in r else {}),
        }
        for r in top
    ]


def _rss(samples: Sequence[ProcSample], pids: Sequence[int]) -> float | None:
    """The RSS of *pids* together in MB; ``None`` if none of them was sampled."""
    return _mb(samples, pids, "rss_bytes")


def _mb(samples: Sequence[ProcSample], pids: Sequence[int], field: str) -> float | None:
    """*field* (``rss_bytes``, ``pss_bytes``, ``uss_bytes``) of *pids* together in MB;
    ``None`` if none was sampled or one lacks it."""
    chosen = [getattr(p, field) for p in samples if p.pid in pids]
    if not chosen or any(v is None for v in chosen):
        return None
    return round(float(sum(chosen)) / 2**20, 1)


# --- measuring --------------------------------------------------------------------------


async def _scrape(server: ServerInfo) -> list[LoopSnapshot | None]:
    """Every member's loop metrics, in member order (``None`` where a scrape failed)."""
    out: list[LoopSnapshot | None] = []
    for url in server.member_metrics_urls:
        try:
            out.append(await trio.to_thread.run_sync(scrape_loop, url, server.metrics_prefix, 10.0))
        except (OSError, ValueError):
            out.append(None)
    return out


async def _stall_records(
    server: ServerInfo, start: float, end: float
) -> tuple[dict[str, Any], ...]:
    """headwater's ``/debug/stalls`` records that started within [start, end] (unix), of
    every member; with several, each record gets the member's index as ``process``."""
    if server.kind != "headwater":
        return ()
    out: list[dict[str, Any]] = []
    for i, url in enumerate(server.member_urls):
        try:
            status, body = await trio.to_thread.run_sync(http_get, url + "/debug/stalls")
        except OSError:
            continue
        if status != 200:
            continue
        for r in orjson.loads(body):
            if start <= r.get("started_at", 0) <= end:
                out.append({**r, "process": i} if server.frontend_processes > 1 else r)
    return tuple(sorted(out, key=lambda r: r.get("started_at", 0)))


def _procs(pids: Sequence[int], *, memory: bool = True) -> tuple[ProcSample, ...]:
    """Each process's sample (PSS and USS too, with *memory*); a gone one is left out."""
    out = []
    for pid in pids:
        try:
            out.append(read_proc(pid, memory=memory))
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
    loops_before = await _scrape(server)
    procs_before = _procs(server.pids)
    threads_before = _threads(server)
    started = time.time()
    raw: list[timeline.RawSample] = []
    loaded = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            timeline.sample,
            server.member_metrics_urls,
            server.metrics_prefix,
            server.frontend_group,
            trio.current_time(),
            raw,
            loaded,
        )
        result = await run_load_trio(
            url,
            bodies,
            spec.concurrency,
            spec.requests,
            time_limit_s,
            spec.stream,
            progress=progress,
            description=f"{server.label}: {spec.key}",
        )
        loaded.set()  # the sampler takes its closing sample and returns
    ended = time.time()
    procs_after = _procs(server.pids)
    threads_after = _threads(server)
    loop_before, loop_after = merge_run_snapshots(loops_before, await _scrape(server))
    stalls = await _stall_records(server, started, ended)
    threads = sum_thread_cpu(
        [
            threads_after[pid].since(threads_before[pid])
            for pid in threads_after
            if pid in threads_before
        ]
    )
    # A server process that died (or was not read) on either side is left out.
    both = {p.pid for p in procs_before} & {p.pid for p in procs_after}
    procs_before = tuple(p for p in procs_before if p.pid in both)
    procs_after = tuple(p for p in procs_after if p.pid in both)
    return Measurement(
        spec=spec,
        server=server,
        phase=phase,
        pair=pair,
        result=result,
        started_unix=started,
        ended_unix=ended,
        loop_before=loop_before,
        loop_after=loop_after,
        procs_before=procs_before,
        procs_after=procs_after,
        threads=threads,
        timeline=tuple(timeline.timeline_points(raw)),
        stall_records=stalls,
        load_avg=load_avg,
        content_tokens_mean=content_tokens_mean,
    )


def _threads(server: ServerInfo) -> dict[int, profile.ThreadSample]:
    """Each serving process's threads (headwater only; a gone process is left out)."""
    if server.kind != "headwater":
        return {}
    out = {}
    for pid in server.frontend_pids:
        try:
            out[pid] = profile.read_threads(pid)
        except ProcessLookupError:
            continue
    return out


async def warm_up(server: ServerInfo, scenarios: Sequence[str]) -> None:
    """A few unmeasured requests per scenario and serving process (each on its own URL):
    first-use costs are not part of a run."""
    for scenario in scenarios:
        n, c = (16, 4) if scenario == "short" else (4, 2)
        spec = RunSpec(scenario, False, c, n)
        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
        bodies = bodies_for(ps, spec, server.model)
        for base in server.member_urls:
            await run_load_trio(
                base + prompts.ENDPOINT_PATHS["chat"], bodies, c, n, 120.0, False, progress=False
            )


@dataclass(frozen=True, slots=True)
class MemoryMB:
    """A frontend's memory now, over its processes together (MB; ``None``: not read)."""

    rss: float | None
    pss: float | None
    uss: float | None
    #: Each process's (role, pid, RSS, PSS, USS), in ``frontend_group`` order.
    processes: tuple[tuple[str, int, float, float | None, float | None], ...] = ()


def current_memory_mb(server: ServerInfo) -> MemoryMB:
    """The frontend's RSS, PSS and USS now, over its processes together
    (:attr:`ServerInfo.frontend_group`: a group's supervisor and zygote included)."""
    pids = server.frontend_group
    samples = _procs(pids)
    roles = {pid: f"process {i}" for i, pid in enumerate(server.frontend_pids)}
    if server.frontend_processes > 1:
        roles[server.pids[0]] = "supervisor"
    rows = tuple(
        (
            roles.get(p.pid, "zygote"),
            p.pid,
            round(p.rss_bytes / 2**20, 1),
            None if p.pss_bytes is None else round(p.pss_bytes / 2**20, 1),
            None if p.uss_bytes is None else round(p.uss_bytes / 2**20, 1),
        )
        for p in samples
    )
    return MemoryMB(
        _rss(samples, pids), _mb(samples, pids, "pss_bytes"), _mb(samples, pids, "uss_bytes"), rows
    )


def current_rss_mb(server: ServerInfo) -> float | None:
    """The frontend's RSS now, over its processes together (``None`` if they are gone)."""
    return current_memory_mb(server).rss


async def idle_memory_mb(server: ServerInfo, settle_s: float = IDLE_SETTLE_S) -> MemoryMB:
    """The frontend's memory (its processes together) after *settle_s* seconds of doing
    nothing."""
    await trio.sleep(settle_s)
    return await trio.to_thread.run_sync(current_memory_mb, server)


async def idle_rss_mb(server: ServerInfo, settle_s: float = IDLE_SETTLE_S) -> float | None:
    """The frontend's RSS (its processes together) after *settle_s* seconds of doing
    nothing."""
    return (await idle_memory_mb(server, settle_s)).rss
