"""One soak of one target: start it, warm it up, read it idle, load it, read it idle again.

The phases, each labelling the samples taken during it::

    warmup        the mix at full concurrency (default: the first 10% of --duration,
                  at least 30 s), so that caches, pools and allocator arenas reach
                  their working size before anything is compared; and on, in steps of
                  15 s (at most WARMUP_CAP_S more), until the frontends' bounded
                  tokenizer caches (--tokenizer-cache-mb) hold 90% of their budget or
                  stopped growing (by 1% of it in a step; evicting, the cache levels
                  off below its budget): a cache still filling up would look like a leak
    settle_start  no load (--settle, 20 s): trio's idle worker threads exit (10 s),
                  kept-alive connections are long closed (the client closes its own)
    idle_start    no load, --idle-reads reads: the baseline
    load          the mix for the rest of --duration
    settle_end    as settle_start
    idle_end      as idle_start: what is compared with the baseline

Then the end state is read (requests in flight, KV held, every process still the one
that started, ``/health``), the target is stopped with SIGTERM and its exit status
kept, and its logs are scanned for errors. :func:`analyse` turns it all into the
target's record, checks included (:mod:`scripts.soak.judge`).
"""

from __future__ import annotations

import os
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from scripts.soak.client import (
    FAILING,
    Outcome,
    PoolStatistics,
    Result,
    fetch,
    get,
    tokenizer_cache,
)
from scripts.soak.judge import (
    Check,
    Limits,
    Sample,
    judge_end_state,
    judge_process,
    judge_requests,
    loaded_trend,
    name_leaks,
)
from scripts.soak.load import Storms, drive
from scripts.soak.mix import Mix, kind_family
from scripts.soak.procs import alive
from scripts.soak.sampler import Sampler
from scripts.soak.targets import Target, Watched, start_target

HOST = "127.0.0.1"
#: Seconds the target gets to exit after SIGTERM (the launcher's own frontend grace is 45).
STOP_GRACE_S = 90.0
#: The warm-up's longest extension while a tokenizer cache fills, and its step.
WARMUP_CAP_S, WARMUP_STEP_S = 300.0, 15.0
CACHE_FULL = 0.9  # of its budget


@dataclass(frozen=True, slots=True)
class Settings:
    duration_s: float = 1800.0
    #: None: 10% of the duration, at least 30 s.
    warmup_s: float | None = None
    settle_s: float = 20.0
    interval_s: float = 5.0
    idle_reads: int = 3
    concurrency: int = 16
    storm_every_s: float = 60.0
    deadline_s: float = 120.0
    #: Engine options for the target's workers (``--speedup-ratio 10``); none: defaults.
    engine_args: tuple[str, ...] = ()
    rss_growth: float = 0.05
    #: Frames per traceback of tracemalloc in every process (0: off); with it, each
    #: process's ``/debug/heap`` is marked at the first idle point and read at the last.
    heap_frames: int = 0

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else max(30.0, 0.1 * self.duration_s)

    @property
    def load(self) -> float:
        return max(1.0, self.duration_s - self.warmup)


@dataclass(slots=True)
class Phase:
    name: str
    start_s: float
    end_s: float = 0.0


@dataclass(slots=True)
class Measured:
    """Everything one target's soak measured, before analysis."""

    target: str
    url: str
    processes: list[Watched]
    samples: list[Sample]
    results: list[Result]
    phases: list[Phase]
    storms: Storms
    pools: list[PoolStatistics]
    end: dict[str, Any]
    logs: dict[str, dict[str, Any]]
    t0: float


async def soak(
    name: str, settings: Settings, mix: Mix, out_dir: Path, say: Any = print
) -> Measured:
    """Run the phases against target *name*; its logs go to ``out_dir/name``."""
    tdir = out_dir / name
    await trio.Path(tdir).mkdir(parents=True, exist_ok=True)
    async with trio.open_nursery() as nursery:
        env = {"PYTHONTRACEMALLOC": str(settings.heap_frames)} if settings.heap_frames else {}
        target = await start_target(name, nursery, tdir, settings.engine_args, env)
        heaps: dict[str, Any] = {}
        say(
            f"{name}: up at {target.url}: "
            + ", ".join(f"{p.name} (pid {p.pid})" for p in target.processes)
        )
        t0 = trio.current_time()
        sampler = Sampler(target.processes, t0)
        results: list[Result] = []
        storms, pools, phases = Storms(), list[PoolStatistics](), list[Phase]()

        def enter(phase: str) -> None:
            now = trio.current_time() - t0
            if phases:
                phases[-1].end_s = now
            phases.append(Phase(phase, now))
            sampler.phase = phase
            say(f"{name}: {phase} at {now:.0f} s ({len(results)} requests so far)")

        async with trio.open_nursery() as sampling:
            enter("warmup")
            await sampling.start(sampler.run, settings.interval_s)
            for phase, seconds in (("warmup", settings.warmup), ("load", settings.load)):
                if phase == "load":
                    enter("load")
                extended, held = 0.0, -1
                while True:
                    pools.append(
                        await drive(
                            mix,
                            HOST,
                            target.port,
                            concurrency=settings.concurrency,
                            duration_s=seconds,
                            deadline_s=settings.deadline_s,
                            storm_every_s=settings.storm_every_s or None,
                            results=results,
                            storms=storms,
                        )
                    )
                    if phase != "warmup" or extended >= WARMUP_CAP_S:
                        break
                    now_held, budget = await tokenizer_caches(target.processes)
                    if now_held >= CACHE_FULL * budget or now_held - held < 0.01 * budget:
                        break
                    held = now_held
                    seconds = WARMUP_STEP_S
                    extended += seconds
                suffix = "start" if phase == "warmup" else "end"
                enter(f"settle_{suffix}")
                await trio.sleep(settings.settle_s)
                enter(f"idle_{suffix}")
                # That many ticks of the sampler, or one more.
                await trio.sleep(settings.idle_reads * settings.interval_s + 0.5)
                if settings.heap_frames:  # after the idle reads: a snapshot stalls a loop
                    heaps[suffix] = await heap_reports(target.processes, mark=suffix == "start")
            enter("stop")
            sampling.cancel_scope.cancel()
        end = await end_state(target)
        if heaps:
            end["heap"] = heaps
        say(f"{name}: end state {end}; stopping (SIGTERM)")
        end["exit_status"] = await target.child.stop(grace=STOP_GRACE_S)
        phases[-1].end_s = trio.current_time() - t0
    logs = {
        str(p.relative_to(out_dir)): await trio.to_thread.run_sync(scan_log, p)
        for p in target.logs
        if p.exists()
    }
    return Measured(
        name,
        target.url,
        target.processes,
        sampler.samples,
        results,
        phases,
        storms,
        pools,
        end,
        logs,
        t0,
    )


async def tokenizer_caches(processes: Sequence[Watched]) -> tuple[int, int]:
    """Bytes the frontends' tokenizer caches hold, and their budgets, summed (a frontend
    without a cache, or that cannot be asked, adds nothing)."""
    held = budget = 0
    for p in processes:
        if p.role != "frontend" or p.runtime_port is None:
            continue
        try:
            bytes_held, max_bytes = await tokenizer_cache(HOST, p.runtime_port)
        except (OSError, ValueError, KeyError, TypeError, trio.TooSlowError):
            continue
        held += bytes_held
        budget += max_bytes
    return held, budget


def _gauge(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


async def heap_reports(processes: Sequence[Watched], *, mark: bool) -> dict[str, Any]:
    """Each process's ``/debug/heap`` (headwater/instrumentation/heap.py): a mark, or
    what grew since it, with what ``malloc_trim`` gives back."""
    reports: dict[str, Any] = {}
    for p in processes:
        if p.runtime_port is not None:
            path = "/debug/heap?mark" if mark else "/debug/heap?trim"
            # A snapshot of a traced process walks all it holds: seconds, not a poll's 5.
            reports[p.name] = orjson.loads(await get(HOST, p.runtime_port, path, limit_s=600))
    return reports


async def end_state(target: Target) -> dict[str, Any]:
    """What must be zero or unchanged once the target is idle at the end."""
    inflight: dict[str, Any] = {}
    kv: dict[str, dict[str, Any]] = {}
    metrics = (await get(HOST, target.port, "/metrics")).decode()
    inflight["frontend"] = _gauge(metrics, "headwater_frontend_inflight_requests")
    for view in orjson.loads(await get(HOST, target.port, "/debug/workers")):
        inflight[f"frontend→{view['worker_id']}"] = view["inflight"]
    for w in target.processes:
        if w.metrics_port is None:
            continue
        text = (await get(HOST, w.metrics_port, "/metrics")).decode()
        inflight[w.name] = _gauge(text, "headwater_worker_inflight_requests")
        kv[w.name] = {
            "kv_blocks_used": _gauge(text, "headwater_worker_kv_blocks_used"),
            "kv_transfers_held": _gauge(text, "headwater_worker_kv_transfers_held"),
        }
    health, _ = await fetch(HOST, target.port, "/health")
    end: dict[str, Any] = {
        "inflight": inflight,
        "restarted": [w.name for w in target.processes if not alive(w.pid)],
        "health": health,
    }
    if kv:
        end["kv"] = kv
    return end


_LEVEL = re.compile(r" (ERROR|CRITICAL) ")


def scan_log(path: Path) -> dict[str, Any]:
    """Lines logged at ERROR or CRITICAL and tracebacks, with the first few of them."""
    errors = tracebacks = warnings = 0
    first: list[str] = []
    with open(path, errors="replace") as f:
        for line in f:
            is_error = bool(_LEVEL.search(line))
            tracebacks += line.startswith("Traceback (most recent call last)")
            warnings += " WARNING " in line
            if is_error:
                errors += 1
                if len(first) < 5:
                    first.append(line.rstrip()[:300])
    return {"errors": errors, "tracebacks": tracebacks, "warnings": warnings, "first_errors": first}


# --- analysis (pure) ------------------------------------------------------------------------


def _idle(samples: Sequence[Sample], phase: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("rss_bytes", "pss_bytes", "uss_bytes", "fds", "threads", "tasks"):
        vs = [getattr(s, name) for s in samples if s.phase == phase]
        vs = [v for v in vs if v is not None]
        if not vs:
            out[name] = None
        elif name.endswith("_bytes"):
            out[name] = int(statistics.median(vs))
        else:
            out[name] = [min(vs), max(vs)]
    return out


def analyse(m: Measured, settings: Settings) -> dict[str, Any]:
    """The target's record: figures per process, requests by outcome, checks, samples."""
    limits = Limits(rss_growth=settings.rss_growth)
    checks: list[Check] = []
    processes = []
    for w in m.processes:
        own = [s for s in m.samples if s.process == w.name]
        rss = [s.rss_bytes for s in own if s.rss_bytes is not None]
        start, end = _idle(own, "idle_start"), _idle(own, "idle_end")
        growth = None
        if start["rss_bytes"] and end["rss_bytes"]:
            growth = (end["rss_bytes"] - start["rss_bytes"]) / start["rss_bytes"]
        processes.append(
            {
                "name": w.name,
                "pid": w.pid,
                "role": w.role,
                "judged": w.judged,
                "has_tasks": w.runtime_port is not None,
                "idle_start": start,
                "idle_end": end,
                "peak_rss_bytes": max(rss, default=None),
                "rss_growth": growth,
                "loaded_rss_trend": loaded_trend(own),
                "task_names_grown": name_leaks(own),
                "read_errors": sum(s.error is not None for s in own),
            }
        )
        if w.judged:
            checks += judge_process(
                w.name, own, has_tasks=w.runtime_port is not None, limits=limits
            )
    counts = Counter(r.outcome.value for r in m.results)
    bad = [r for r in m.results if r.outcome in FAILING]
    examples = [f"{r.kind} ({r.how}) at {r.started - m.t0:.0f} s: {r.detail}" for r in bad]
    checks += judge_requests(counts, examples)
    checks += judge_end_state(m.end)
    logged = {k: v["errors"] + v["tracebacks"] for k, v in m.logs.items()}
    checks.append(
        Check("logs", not any(logged.values()), f"ERROR lines and tracebacks per log: {logged}")
    )
    by_kind: dict[str, Counter[str]] = {}
    for r in m.results:
        by_kind.setdefault(kind_family(r.kind), Counter())[r.outcome.value] += 1
    details = Counter(
        f"{r.outcome.value}: {r.detail}"
        for r in m.results
        if r.outcome in (*FAILING, Outcome.ERROR)
    )
    load = next((p for p in m.phases if p.name == "load"), None)
    in_load = [r for r in m.results if load and load.start_s <= r.started - m.t0 < load.end_s]
    return {
        "target": m.target,
        "url": m.url,
        "passed": all(c.passed for c in checks),
        "checks": [c.to_dict() for c in checks],
        "processes": processes,
        "requests": {
            "total": len(m.results),
            "by_outcome": dict(sorted(counts.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "problems": dict(details.most_common(20)),
            "failing_examples": examples[:20],
            "load_phase_per_s": round(len(in_load) / load_seconds(m.phases), 2) if load else None,
            "durations_s": _percentiles(
                [r.duration_s for r in m.results if r.outcome is Outcome.OK]
            ),
            "timeline": request_bins(m.results, m.t0),
        },
        "storms": {"count": len(m.storms.times), "reset": m.storms.reset},
        "connections": [asdict(p) for p in m.pools],
        "phases": [asdict(p) for p in m.phases],
        "end_state": m.end,
        "logs": m.logs,
        "samples": [s.to_dict(names=s.phase.startswith("idle")) for s in m.samples],
    }


def load_seconds(phases: Sequence[Phase]) -> float:
    return sum(p.end_s - p.start_s for p in phases if p.name == "load") or 1.0


def _percentiles(vs: Sequence[float]) -> dict[str, float] | None:
    if not vs:
        return None
    q = sorted(vs)

    def at(p: float) -> float:
        return round(q[min(len(q) - 1, int(p * len(q)))], 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(q[-1], 3)}


BIN_S = 10.0


def request_bins(
    results: Sequence[Result], t0: float, bin_s: float = BIN_S
) -> list[dict[str, Any]]:
    """Requests that ended in each *bin_s* bin, by outcome."""
    bins: dict[int, Counter[str]] = {}
    for r in results:
        index = int((r.started + r.duration_s - t0) // bin_s)
        bins.setdefault(index, Counter())[r.outcome.value] += 1
    if not bins:
        return []
    return [
        {"t_s": i * bin_s, **dict(bins.get(i, Counter()))} for i in range(min(bins), max(bins) + 1)
    ]


def machine() -> dict[str, Any]:
    import platform
    import sys

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def summary_lines(record: Mapping[str, Any]) -> list[str]:
    """The human summary of one target: the verdict, then each failed check."""
    verdict = "PASS" if record["passed"] else "FAIL"
    lines = [
        f"{record['target']}: {verdict} ({record['requests']['total']} requests: "
        f"{record['requests']['by_outcome']})"
    ]
    for c in record["checks"]:
        mark = "ok  " if c["passed"] else "FAIL"
        who = f"{c['process']}: " if c["process"] else ""
        lines.append(f"  {mark} {c['name']:<16} {who}{c['detail']}")
    return lines
