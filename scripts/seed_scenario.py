"""The seed failure chain, reproduced and defeated: a benchmark of worker health under stalls.

The chain (NVIDIA Dynamo's frontend at high concurrency on ~40k-token prompts): the
frontend tokenizes on its event loop, the loop stalls, request-plane ACKs come back
after the frontend stopped waiting, healthy workers are marked down, the traffic piles
onto the rest or gets 503, and throughput collapses while every engine is fine.

This script runs the same load against the same layout several times, changing only
the frontend's options:

* ``chain``: ``--tokenize-mode inline --tokenizer-backend hf --no-stall-attribution``,
  the old design: HF encodes every prompt on the loop, and every missed ACK is blamed
  on the worker;
* ``defaults``: headwater as shipped (tokenizer pool + fastokens, stall attribution);
* ``attribution`` (optional): inline HF again, with attribution on: the loop still
  stalls, but a miss during a stall is not the worker's fault.

Layout, as Dynamo's disaggregated deployment: one prefill and one decode worker process
(mocker at ``--speedup-ratio 1000``: a 40k-token prefill costs it under 1 ms, so the
engines are never the bottleneck), one frontend process reaching them over the TCP
request plane (``--workers``, static) with a short ``--ack-timeout`` (0.5 s: the
chain runs in seconds instead of Dynamo's 5 s steps). Every process is fresh per run.

Load: the same pre-built bodies every run (200 distinct ~40k-token chat prompts,
``scripts/bench/prompts.py``, unary, ``max_tokens`` 8), replayed in a closed loop at
concurrency 16 (the benchmark suite's long-prompt point) by the out-of-process aiohttp
client (``scripts/bench/loadgen.py``) for 60 s.
Recorded per run, in 1 s bins: requests completed and failed (by HTTP status) per
second, the frontend's loop delay (p99 and highest bucket, from its
``event_loop_delay_seconds`` histogram sampled at 4 Hz, ``scripts/bench/timeline.py``),
each worker's routing state (``/debug/workers`` polled at 4 Hz, plus every transition
the router logs, with its time) and each worker's KV cache use (its own counters, over a
plane connection of this script's); and totals from ``/metrics``: req/s,
failures, worker state transitions, excused timeouts. Other processes' CPU use during
each run is measured from ``/proc/stat`` (a shared machine: see ``others_cpu_pct``).

    python scripts/seed_scenario.py                       # chain, defaults, attribution
    python scripts/seed_scenario.py --runs chain,defaults --duration 30 --concurrency 16
    python scripts/seed_scenario.py --render bench-results/seed-.../results.json --docs

Writes ``bench-results/seed-<timestamp>/`` (``results.json``, ``seed_scenario.png``,
every process's log); ``--docs`` also writes ``docs/img/seed_scenario.png`` and
``docs/data/seed_scenario.json`` (the results without per-request records).
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # runnable from a checkout: python scripts/seed_scenario.py

import httpx  # noqa: E402 - after the checkout is on the path
import orjson  # noqa: E402
import trio  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from headwater.cluster.children import child_env  # noqa: E402
from headwater.cluster.recipes import (  # noqa: E402
    ChildProcess,
    WorkerProcess,
    start_frontend,
    start_worker,
    wait_healthy,
)
from headwater.plane.base import PlaneError, WorkerInstance  # noqa: E402
from headwater.plane.client import connect_worker  # noqa: E402
from headwater.wire import Role  # noqa: E402
from scripts.bench import prompts, timeline  # noqa: E402
from scripts.bench.loadgen import LoadResult, RequestRecord, run_load_trio  # noqa: E402
from scripts.bench.scrape import HEADWATER_PREFIX, Histogram, read_proc  # noqa: E402
from scripts.bench.stats import summarise  # noqa: E402

MODEL = prompts.DEFAULT_MODEL
BIN_S = 1.0
POLL_INTERVAL_S = 0.25
#: A worker's drain at the end of a run: a prefill worker waits for KV transfers that the
#: requests cut off at the time limit will never pull; nothing is measured by then.
WORKER_DRAIN_S = 2.0
WORKER_STATS_INTERVAL_S = 0.5
#: States as the plot draws them (``unknown``: before the first observation).
STATE_COLORS: Mapping[str, str] = {
    "healthy": "#55a868",
    "probing": "#dd8452",
    "inhibited": "#c44e52",
    "draining": "#8c8c8c",
    "removed": "#000000",
    "unknown": "#ffffff",
}


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run of the scenario: a name, what it shows, and the frontend's own options."""

    name: str
    title: str
    frontend_args: tuple[str, ...]


RUNS: Mapping[str, RunSpec] = {
    spec.name: spec
    for spec in (
        RunSpec(
            "chain",
            "inline HF tokenizer, no stall attribution (the old design)",
            ("--tokenize-mode", "inline", "--tokenizer-backend", "hf", "--no-stall-attribution"),
        ),
        RunSpec("defaults", "headwater's defaults (tokenizer pool, fastokens, attribution)", ()),
        RunSpec(
            "attribution",
            "inline HF tokenizer, stall attribution on",
            ("--tokenize-mode", "inline", "--tokenizer-backend", "hf"),
        ),
    )
}


# --- pure: per-second figures ------------------------------------------------------------


def failure_label(record: RequestRecord) -> str:
    """What a failed request is counted as: its HTTP status, ``200`` for an error inside
    a 200 response, ``none`` when no response came (connection error, client timeout)."""
    return "none" if record.status is None else str(record.status)


@dataclass(frozen=True, slots=True)
class RequestBin:
    """Requests that ended in ``[t_s, t_s + bin_s)``: completed, and failed by label."""

    t_s: float
    ok: int
    failed: dict[str, int]


def bin_requests(
    records: Iterable[RequestRecord], duration_s: float, bin_s: float = BIN_S
) -> list[RequestBin]:
    """Completed and failed requests per bin, by the time each one ended (``start_s +
    e2e_s``, seconds since the load started). Requests cut off at the time limit are
    neither. Covers ``[0, duration_s)`` and any later bin a request ended in."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be positive, got {bin_s}")
    ok: Counter[int] = Counter()
    failed: dict[int, Counter[str]] = {}
    last = math.ceil(duration_s / bin_s) - 1
    for r in records:
        if r.cut_off:
            continue
        index = max(0, math.floor((r.start_s + r.e2e_s) / bin_s))
        last = max(last, index)
        if r.ok:
            ok[index] += 1
        else:
            failed.setdefault(index, Counter())[failure_label(r)] += 1
    return [
        RequestBin(round(i * bin_s, 6), ok[i], dict(sorted(failed.get(i, Counter()).items())))
        for i in range(last + 1)
    ]


@dataclass(frozen=True, slots=True)
class LoopBin:
    """The canary's observations that reached the frontend's ``/metrics`` in one bin."""

    t_s: float
    samples: int
    p99_ms: float | None
    #: Upper bound of the highest histogram bucket that gained an observation (the
    #: histogram cannot say more); ``None`` without observations.
    max_ms: float | None
    #: The highest observation was above the last finite bucket (``max_ms`` is that bound).
    max_above: bool = False


def bin_loop(
    snapshots: Sequence[tuple[float, Histogram | None]], n_bins: int, bin_s: float = BIN_S
) -> list[LoopBin]:
    """Per-bin loop delay from cumulative histogram snapshots ``(t_s, histogram)``
    (``None``: that scrape failed; a stalled server answers late or not at all).

    The observations between two consecutive good snapshots belong to the bin that
    holds the later one: bin *k* gets the last good snapshot at or before its end minus
    the last good one at or before its start (the first snapshot, if it came later).
    """
    good = sorted((t, h) for t, h in snapshots if h is not None)
    times = [t for t, _ in good]
    bins: list[LoopBin] = []
    for k in range(n_bins):
        start, end = k * bin_s, (k + 1) * bin_s
        t_bin = round(start, 6)
        i_end = bisect.bisect_right(times, end) - 1
        i_start = max(0, bisect.bisect_right(times, start) - 1)
        if i_end <= i_start:
            bins.append(LoopBin(t_bin, 0, None, None))
            continue
        later, earlier = good[i_end][1], good[i_start][1]
        assert later is not None
        assert earlier is not None
        delta = later.minus(earlier)
        count = int(delta.count)
        if count <= 0:
            bins.append(LoopBin(t_bin, 0, None, None))
            continue
        p99 = delta.quantile(0.99)
        top = timeline.highest_bucket(delta)
        above = top is not None and math.isinf(top)
        if above:
            top = max((le for le, _ in delta.buckets if not math.isinf(le)), default=None)
        top_ms = None if top is None else top * 1e3
        bins.append(LoopBin(t_bin, count, None if p99 is None else p99 * 1e3, top_ms, above))
    return bins


# --- pure: worker states over time -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Band:
    """A worker was in *state* from *start_s* to *end_s* (seconds since the load started)."""

    start_s: float
    end_s: float
    state: str


def state_bands(
    observations: Iterable[tuple[float, str]], end_s: float, start_s: float = 0.0
) -> list[Band]:
    """Piecewise-constant state over ``[start_s, end_s]`` from ``(t, state)`` observations,
    each meaning "in *state* from *t* on" (a logged transition, a poll, a poll's
    ``since``). Observations before *start_s* set the state at *start_s*; before the first
    observation the state is ``unknown``. Adjacent equal states are merged."""
    bands: list[Band] = []
    state, since = "unknown", start_s
    for t, new in sorted(observations, key=lambda o: o[0]):
        t = min(max(t, start_s), end_s)
        if new == state:
            continue
        if t > since:
            bands.append(Band(since, t, state))
        state, since = new, t
    if end_s > since or not bands:
        bands.append(Band(since, end_s, state))
    merged: list[Band] = []
    for b in bands:
        if merged and merged[-1].state == b.state:
            merged[-1] = Band(merged[-1].start_s, b.end_s, b.state)
        else:
            merged.append(b)
    return merged


def time_in_states(bands: Iterable[Band]) -> dict[str, float]:
    """Seconds spent in each state."""
    spent: dict[str, float] = {}
    for b in bands:
        spent[b.state] = round(spent.get(b.state, 0.0) + b.end_s - b.start_s, 3)
    return spent


#: A transition as ``frontend.router.router`` logs it (``headwater.cli.options`` format).
_TRANSITION = re.compile(
    r"^(?P<date>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) \w+ frontend\.router\.router: "
    r"worker (?P<worker>\S+): (?P<old>\w+) -> (?P<new>\w+) \((?P<reason>.*)\)$"
)


@dataclass(frozen=True, slots=True)
class LoggedTransition:
    unix: float
    worker_id: str
    old: str
    new: str
    reason: str


def parse_transitions(lines: Iterable[str]) -> list[LoggedTransition]:
    """The router's ``worker X: a -> b (why)`` lines; the log's local time → unix time."""
    found = []
    for line in lines:
        m = _TRANSITION.match(line.rstrip("\n"))
        if m is None:
            continue
        local = datetime.strptime(m["date"], "%Y-%m-%d %H:%M:%S")
        unix = time.mktime(local.timetuple()) + int(m["ms"]) / 1000
        found.append(LoggedTransition(unix, m["worker"], m["old"], m["new"], m["reason"]))
    return found


#: Log lines that tell what happened to an ACK or a heartbeat (frontend/router/dispatch.py,
#: headwater/plane/connection.py), counted per run.
LOG_EVENTS: Mapping[str, str] = {
    "ack_missed_blamed": "unreachable: no ACK",
    "ack_missed_excused": "ACK missed while this loop was stalled",
    "heartbeat_excused": "heartbeat reply late while this loop was stalled",
    "heartbeat_missed": "no heartbeat reply within",
    "migrations": "migrating with",
}


def count_log_events(lines: Iterable[str]) -> dict[str, int]:
    counts = dict.fromkeys(LOG_EVENTS, 0)
    for line in lines:
        for key, needle in LOG_EVENTS.items():
            if needle in line:
                counts[key] += 1
    return counts


# --- pure: totals from /metrics ----------------------------------------------------------

#: Counters whose increase over a run is reported (names without ``_total``).
TOTAL_COUNTERS = tuple(
    HEADWATER_PREFIX + name
    for name in (
        "requests",
        "worker_state_transitions",
        "excused_timeouts",
        "model_migration",
        "event_loop_stall",
    )
)


def counter_values(text: str, names: Sequence[str] = TOTAL_COUNTERS) -> dict[str, float]:
    """``name{label="v",...}`` → value of every ``_total`` sample of the counters *names*."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def counter_increase(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each counter gained between two :func:`counter_values`; zeros left out."""
    return {
        key: round(value - before.get(key, 0.0))
        for key, value in sorted(after.items())
        if round(value - before.get(key, 0.0)) != 0
    }


def transitions_by_kind(increase: Mapping[str, int]) -> dict[str, int]:
    """``{"healthy->inhibited": n, ...}`` from a :func:`counter_increase`."""
    out: dict[str, int] = {}
    pattern = re.compile(r'from="(\w+)",to="(\w+)"')
    for key, n in increase.items():
        if key.startswith(HEADWATER_PREFIX + "worker_state_transitions_total"):
            m = pattern.search(key)
            if m is not None:
                out[f"{m[1]}->{m[2]}"] = out.get(f"{m[1]}->{m[2]}", 0) + n
    return out


def cpu_busy_s(stat_text: str) -> float:
    """Busy CPU seconds of the machine so far, from ``/proc/stat``'s ``cpu`` line (all
    but idle and iowait; guest time is already in user)."""
    fields = stat_text.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError("not /proc/stat")
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


# --- the runs ------------------------------------------------------------------------------


@dataclass(slots=True)
class Settings:
    duration_s: float = 60.0
    concurrency: int = 16
    ack_timeout_s: float = 0.5
    max_tokens: int = 8
    prompt_count: int = 200
    prompt_tokens: int = 40_000
    speedup_ratio: float = 1000.0
    seed: int = 20261130
    warmup_requests: int = 4


@dataclass(slots=True)
class _Polls:
    """``/debug/workers`` answers: (seconds since the epoch, unix time, the workers)."""

    answers: list[tuple[float, float, list[dict[str, Any]]]] = field(default_factory=list)
    failures: int = 0
    slowest_s: float = 0.0


async def _poll_workers(
    url: str, epoch: float, out: _Polls, done: trio.Event, limit_s: float
) -> None:
    """``GET url/debug/workers`` every POLL_INTERVAL_S until *done* (or *limit_s*)."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        tick = trio.current_time()
        with trio.move_on_after(limit_s):
            while not done.is_set():
                sent = trio.current_time()
                try:
                    r = await http.get(url + "/debug/workers")
                    r.raise_for_status()
                    out.answers.append((trio.current_time() - epoch, time.time(), r.json()))
                except (httpx.HTTPError, ValueError):
                    out.failures += 1
                out.slowest_s = max(out.slowest_s, trio.current_time() - sent)
                tick += POLL_INTERVAL_S
                with trio.move_on_at(max(tick, trio.current_time())):
                    await done.wait()


#: What each worker's own counters poll keeps (``stats`` over a plane connection of
#: this script's: the frontend's loop plays no part in it).
WORKER_STATS = (
    "inflight",
    "engine_active_requests",
    "engine_waiting_requests",
    "engine_kv_blocks_used",
    "engine_kv_blocks_total",
    "engine_kv_transfers_held",
)


async def _poll_worker_stats(
    workers: Sequence[WorkerProcess],
    epoch: float,
    out: dict[str, list[dict[str, float]]],
    done: trio.Event,
    limit_s: float,
) -> None:
    """Each worker's counters every WORKER_STATS_INTERVAL_S until *done* (or *limit_s*)."""
    async with trio.open_nursery() as nursery:
        clients = [
            await connect_worker(
                WorkerInstance(w.worker_id, Role(w.role), MODEL, w.address),
                nursery,
                client_id="seed-scenario-stats",
            )
            for w in workers
        ]
        tick = trio.current_time()
        with trio.move_on_after(limit_s):
            while not done.is_set():
                for client in clients:
                    wid = client.instance.worker_id
                    try:
                        with trio.fail_after(2.0):
                            values = await client.fetch_stats()
                    except (trio.TooSlowError, PlaneError):
                        continue
                    point = {"t_s": trio.current_time() - epoch}
                    point.update({k: float(values[k]) for k in WORKER_STATS if k in values})
                    out.setdefault(wid, []).append(point)
                tick += WORKER_STATS_INTERVAL_S
                with trio.move_on_at(max(tick, trio.current_time())):
                    await done.wait()
        for client in clients:
            await client.aclose()
        nursery.cancel_scope.cancel()


async def _get_text(url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0) as http:
        r = await http.get(url)
        r.raise_for_status()
        return r.text


def _others_cpu(
    stat_before: float, stat_after: float, ours_s: float, wall_s: float
) -> dict[str, float]:
    """The machine's busy CPU over *wall_s* seconds (the interval between the two
    ``/proc/stat`` readings), ours (*ours_s*: the three processes, the load client and this
    script) and everyone else's, each in % of one core."""
    total = stat_after - stat_before
    return {
        "machine_busy_cpu_pct": round(100 * total / wall_s, 1),
        "ours_cpu_pct": round(100 * ours_s / wall_s, 1),
        "others_cpu_pct": round(100 * max(0.0, total - ours_s) / wall_s, 1),
    }


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


async def run_one(
    spec: RunSpec, bodies: Sequence[bytes], settings: Settings, workdir: Path
) -> tuple[dict[str, Any], LoadResult]:
    """Start the three processes, warm up, run the load while sampling, stop everything."""
    env = child_env({"PYTHONPATH": str(ROOT)})
    engine_args = ["--speedup-ratio", f"{settings.speedup_ratio:g}"]
    frontend_args = [
        "--ack-timeout",
        f"{settings.ack_timeout_s:g}",
        "--log-level",
        "info",
        *spec.frontend_args,
    ]
    with trio.fail_after(settings.duration_s + 300):
        async with trio.open_nursery() as nursery:
            workers = [
                await start_worker(
                    nursery,
                    role,
                    log_dir=workdir,
                    name=f"{spec.name}-{role}",
                    model=MODEL,
                    engine_args=engine_args,
                    drain_timeout=WORKER_DRAIN_S,
                    extra_args=["--log-level", "info"],
                    env=env,
                )
                for role in ("prefill", "decode")
            ]
            frontend = await start_frontend(
                nursery,
                log_dir=workdir,
                name=f"{spec.name}-frontend",
                model=MODEL,
                workers=",".join(w.static_url(MODEL) for w in workers),
                extra_args=frontend_args,
                env=env,
            )
            await wait_healthy(frontend.address, child=frontend)
            url = frontend.address + prompts.ENDPOINT_PATHS["chat"]
            metrics_url = frontend.address + "/metrics"
            warm = await run_load_trio(
                url, bodies[: settings.warmup_requests], 2, settings.warmup_requests, 120, False
            )
            warm_failed = settings.warmup_requests - len(warm.ok)
            if warm_failed:
                # Possible in the inline runs (two concurrent encodes can outlast a short
                # ACK timeout): reported, and the load waits until the workers are routable.
                print(
                    f"  warm-up: {warm_failed} failed ({summarise(warm).first_error})",
                    file=sys.stderr,
                )
                await wait_healthy(frontend.address, child=frontend)

            children: list[ChildProcess] = [frontend, *workers]
            counters_before = counter_values(await _get_text(metrics_url))
            load_avg_before = os.getloadavg()
            procs_before = {c.name: read_proc(c.pid).cpu_s for c in children}
            stat_before, self_before = cpu_busy_s(_read(Path("/proc/stat"))), _self_cpu_s()
            stat_t0 = time.perf_counter()
            samples: list[timeline.RawSample] = []
            polls = _Polls()
            worker_stats: dict[str, list[dict[str, float]]] = {}
            done = trio.Event()
            epoch = trio.current_time()
            epoch_perf = time.perf_counter()
            limit = settings.duration_s + 120
            async with trio.open_nursery() as sampling:
                sampling.start_soon(
                    timeline.sample,
                    [metrics_url],
                    HEADWATER_PREFIX,
                    [frontend.pid],
                    epoch,
                    samples,
                    done,
                )
                sampling.start_soon(_poll_workers, frontend.address, epoch, polls, done, limit)
                sampling.start_soon(_poll_worker_stats, workers, epoch, worker_stats, done, limit)
                try:
                    load = await run_load_trio(
                        url,
                        bodies,
                        settings.concurrency,
                        10_000_000,
                        settings.duration_s,
                        False,
                        request_timeout=60.0,
                    )
                finally:
                    done.set()
            stat_after, self_after = cpu_busy_s(_read(Path("/proc/stat"))), _self_cpu_s()
            stat_s = time.perf_counter() - stat_t0
            procs_after = {c.name: read_proc(c.pid).cpu_s for c in children}
            load_avg_after = os.getloadavg()
            counters_after = counter_values(await _get_text(metrics_url))
            for child in children:
                await child.stop()
    # Everything relative to the load's own t0 (CLOCK_MONOTONIC, as trio's clock minus
    # an offset that epoch/epoch_perf pin down).
    shift = load.t0 - epoch_perf
    unix_t0 = time.time() - (time.perf_counter() - load.t0)
    ours = (
        sum(procs_after[n] - procs_before[n] for n in procs_before)
        + load.client.cpu_s
        + self_after
        - self_before
    )
    record = analyse(
        spec,
        settings,
        load,
        loop_snapshots=[
            (s.t_s - shift, s.loop.delay if s.loop is not None else None) for s in samples
        ],
        polls=[(t - shift, unix, ws) for t, unix, ws in polls.answers],
        unix_t0=unix_t0,
        frontend_log=_read(workdir / f"{spec.name}-frontend.log").splitlines(),
        counters=counter_increase(counters_before, counters_after),
        worker_stats={
            wid: [{**p, "t_s": round(p["t_s"] - shift, 3)} for p in points]
            for wid, points in worker_stats.items()
        },
    )
    record["warmup_failed"] = warm_failed
    record["process_cpu_s"] = {n: round(procs_after[n] - procs_before[n], 2) for n in procs_before}
    record["machine"] = {
        "load_avg_before": [round(x, 2) for x in load_avg_before],
        "load_avg_after": [round(x, 2) for x in load_avg_after],
        **_others_cpu(stat_before, stat_after, ours, stat_s),
        "cpu_interval_s": round(stat_s, 3),
    }
    record["polls"] = {
        "answered": len(polls.answers),
        "failed": polls.failures,
        "slowest_s": round(polls.slowest_s, 3),
        "loop_scrapes": len(samples),
        "loop_scrapes_failed": sum(s.loop is None for s in samples),
    }
    return record, load


def analyse(
    spec: RunSpec,
    settings: Settings,
    load: LoadResult,
    *,
    loop_snapshots: Sequence[tuple[float, Histogram | None]],
    polls: Sequence[tuple[float, float, Sequence[Mapping[str, Any]]]],
    unix_t0: float,
    frontend_log: Sequence[str],
    counters: Mapping[str, int],
    worker_stats: Mapping[str, Sequence[Mapping[str, float]]] | None = None,
) -> dict[str, Any]:
    """One run's JSON record from what was measured (pure: no I/O). Times are seconds
    since the load started; *unix_t0* is that moment in unix time (for logs, ``since``)."""
    end = load.wall_s
    requests = bin_requests(load.records, settings.duration_s)
    loop = bin_loop(loop_snapshots, len(requests))
    logged = parse_transitions(frontend_log)
    observations: dict[str, list[tuple[float, str]]] = {}
    roles: dict[str, str] = {}
    busy: Counter[str] = Counter()
    seen_polls: Counter[str] = Counter()
    for t, _unix, workers in polls:
        for w in workers:
            wid = str(w["worker_id"])
            roles[wid] = str(w["role"])
            if 0 <= t <= end:
                seen_polls[wid] += 1
                busy[wid] += bool(w.get("busy"))
            seen = observations.setdefault(wid, [])
            seen.append((t, str(w["state"])))
            since = float(w["since"]) - unix_t0
            if since <= t:  # it entered that state then (and has not left it since)
                seen.append((since, str(w["state"])))
    for tr in logged:
        observations.setdefault(tr.worker_id, []).append((tr.unix - unix_t0, tr.new))
    bands = {wid: state_bands(obs, end) for wid, obs in sorted(observations.items())}
    in_run = [tr for tr in logged if 0 <= tr.unix - unix_t0 <= end]
    failures: Counter[str] = Counter()
    for r in load.records:
        if not r.ok and not r.cut_off:
            failures[failure_label(r)] += 1
    summary = summarise(load, spec.name)
    delays = [b.max_ms for b in loop if b.max_ms is not None]
    p99s = [b.p99_ms for b in loop if b.p99_ms is not None]
    return {
        "name": spec.name,
        "title": spec.title,
        "frontend_args": list(spec.frontend_args),
        "summary": summary.to_json(),
        "totals": {
            "req_per_s": summary.req_per_s,
            "ok": summary.ok,
            "failed": summary.failed,
            "failed_by_status": dict(sorted(failures.items())),
            "cut_off": summary.cut_off,
            "transitions": transitions_by_kind(counters),
            "to_inhibited": sum(
                n for k, n in transitions_by_kind(counters).items() if k.endswith("->inhibited")
            ),
            "excused_timeouts": counters.get(HEADWATER_PREFIX + "excused_timeouts_total", 0),
            "loop_p99_ms_worst_bin": max(p99s, default=None),
            "loop_max_ms_worst_bin": max(delays, default=None),
            "log": count_log_events(frontend_log),
        },
        "counters": dict(counters),
        "bins": [
            {**asdict(r), **{f"loop_{k}": v for k, v in asdict(lb).items() if k != "t_s"}}
            for r, lb in zip(requests, loop, strict=True)
        ],
        "workers": {
            wid: {
                "role": roles.get(wid, "?"),
                "bands": [asdict(b) for b in bs],
                "seconds_in": time_in_states(bs),
                "busy_share_of_polls": round(busy[wid] / seen_polls[wid], 3)
                if seen_polls[wid]
                else None,
                "stats": list((worker_stats or {}).get(wid, ())),
            }
            for wid, bs in bands.items()
        },
        "transitions_logged": [
            {
                "t_s": round(tr.unix - unix_t0, 3),
                "worker_id": tr.worker_id,
                "from": tr.old,
                "to": tr.new,
                "reason": tr.reason,
            }
            for tr in in_run
        ],
        "wall_s": round(load.wall_s, 3),
    }


def machine_info() -> dict[str, Any]:
    import platform

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
    }


async def run_all(names: Sequence[str], settings: Settings, out_dir: Path) -> dict[str, Any]:
    print(
        f"building {settings.prompt_count} prompts of ~{settings.prompt_tokens} tokens ...",
        file=sys.stderr,
    )
    prompt_set = await trio.to_thread.run_sync(
        lambda: prompts.make_prompts(
            "long", settings.prompt_count, tokens=settings.prompt_tokens, seed=settings.seed
        )
    )
    bodies = prompts.build_bodies(prompt_set, stream=False, max_tokens=settings.max_tokens)
    results: dict[str, Any] = {
        "scenario": "seed",
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "machine": machine_info(),
        "prompts": {
            "nonce": prompt_set.nonce,
            "count": len(prompt_set),
            "tokens_mean": round(sum(p.tokens for p in prompt_set.prompts) / len(prompt_set), 1),
            "body_bytes_mean": round(sum(map(len, bodies)) / len(bodies)),
        },
        "runs": [],
    }
    for name in names:
        print(f"run {name}: {RUNS[name].title} ...", file=sys.stderr)
        record, load = await run_one(RUNS[name], bodies, settings, out_dir)
        results["runs"].append(record)
        full = {**record, "load": load.to_json()}
        (out_dir / f"{name}.json").write_bytes(orjson.dumps(full))
        print(headline(record), file=sys.stderr)
        (out_dir / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return results


def headline(run: Mapping[str, Any]) -> str:
    t, m = run["totals"], run["machine"]
    return (
        f"{run['name']}: {t['req_per_s']} req/s, {t['ok']} ok, {t['failed']} failed "
        f"{t['failed_by_status']}, transitions {t['transitions']}, excused "
        f"{t['excused_timeouts']}, loop p99 worst bin {t['loop_p99_ms_worst_bin']} ms; "
        f"load avg {m['load_avg_before'][0]} → {m['load_avg_after'][0]}, others' CPU "
        f"{m['others_cpu_pct']}%"
    )


# --- the plot -------------------------------------------------------------------------------


def plot(results: Mapping[str, Any], path: Path) -> Path:
    """Runs side by side: req/s and failures/s, loop delay, worker state bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from scripts.bench.plots import _DPI

    runs = results["runs"]
    settings = results["settings"]
    ack_ms = 1000 * settings["ack_timeout_s"]
    width = BIN_S
    fig, axes = plt.subplots(
        4,
        len(runs),
        figsize=(5.0 * len(runs), 10.4),
        sharex=True,
        sharey="row",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 3, 1.2, 1.8]},
    )
    failure_colors = ("#c44e52", "#e5ae38", "#8172b3", "#937860")
    for col, run in enumerate(runs):
        ax_rate, ax_loop, ax_state, ax_kv = (axes[row][col] for row in range(4))
        bins = run["bins"]
        t = [b["t_s"] for b in bins]
        ax_rate.bar(
            t,
            [b["ok"] for b in bins],
            width=width,
            align="edge",
            color="#4c72b0",
            label="completed",
        )
        statuses = sorted({s for b in bins for s in b["failed"]})
        bottom = [float(b["ok"]) for b in bins]
        for i, status in enumerate(statuses):
            n = [b["failed"].get(status, 0) for b in bins]
            label = "no response" if status == "none" else f"HTTP {status}"
            ax_rate.bar(
                t,
                n,
                width=width,
                align="edge",
                bottom=bottom,
                color=failure_colors[i % len(failure_colors)],
                label=f"failed: {label}",
            )
            bottom = [a + b for a, b in zip(bottom, n, strict=True)]
        tot = run["totals"]
        ax_rate.set_title(
            f"{run['name']}: {tot['req_per_s']:g} req/s, {tot['failed']} failed\n"
            f"{tot['to_inhibited']} times a worker inhibited, "
            f"{tot['excused_timeouts']} misses excused",
            fontsize=10,
        )
        ax_rate.legend(fontsize=7, loc="upper right")
        ax_rate.grid(True, axis="y", alpha=0.3)
        seen = [b for b in bins if b["loop_samples"]]
        lt = [b["t_s"] + width / 2 for b in seen]
        ax_loop.plot(
            lt,
            [b["loop_p99_ms"] for b in seen],
            "-o",
            ms=2.5,
            lw=1,
            color="#4c72b0",
            label="p99 per second",
        )
        ax_loop.plot(
            lt,
            [b["loop_max_ms"] for b in seen],
            "^",
            ms=3.5,
            color="#c44e52",
            alpha=0.7,
            label="highest bucket reached",
        )
        above = [b for b in seen if b.get("loop_max_above")]
        if above:
            ax_loop.plot(
                [b["t_s"] + width / 2 for b in above],
                [b["loop_max_ms"] for b in above],
                "v",
                ms=6,
                color="black",
                label="above 5 s (the last bucket)",
            )
        blind = "no canary reading reached /metrics"
        for i, b in enumerate(b for b in bins if not b["loop_samples"]):
            ax_loop.axvspan(
                b["t_s"], b["t_s"] + width, color="#dddddd", lw=0, label=blind if i == 0 else None
            )
        ax_loop.axhline(ack_ms, color="black", lw=0.9, ls="--", label=f"ACK timeout {ack_ms:g} ms")
        ax_loop.axhline(20, color="grey", lw=0.8, ls="-.", label="stall threshold 20 ms")
        ax_loop.set_yscale("log")
        ax_loop.grid(True, which="both", alpha=0.3)
        ax_loop.legend(fontsize=7, loc="best")
        lanes = sorted(run["workers"].items(), key=lambda kv: kv[1]["role"], reverse=True)
        for lane, (_wid, w) in enumerate(lanes):
            spans = [(b["start_s"], b["end_s"] - b["start_s"]) for b in w["bands"]]
            colors = [STATE_COLORS.get(b["state"], "#cccccc") for b in w["bands"]]
            ax_state.broken_barh(spans, (lane + 0.1, 0.8), facecolors=colors, edgecolor="none")
        ax_state.set_yticks([i + 0.5 for i in range(len(lanes))], [w["role"] for _wid, w in lanes])
        ax_state.set_ylim(0, max(1, len(lanes)))
        for _wid, w in lanes:
            points = [p for p in w.get("stats", ()) if p.get("engine_kv_blocks_total")]
            if not points:
                continue
            held = max(int(p.get("engine_kv_transfers_held", 0)) for p in points)
            ax_kv.plot(
                [p["t_s"] for p in points],
                [100 * p["engine_kv_blocks_used"] / p["engine_kv_blocks_total"] for p in points],
                "-" if w["role"] == "prefill" else "--",
                lw=1.2,
                color="#c44e52" if w["role"] == "prefill" else "#4c72b0",
                label=f"{w['role']} (at most {held} transfers held)"
                if w["role"] == "prefill"
                else w["role"],
            )
        ax_kv.axhline(95, color="black", lw=0.8, ls=":", label="busy at 95%")
        ax_kv.set_ylim(0, 105)
        ax_kv.grid(True, alpha=0.3)
        ax_kv.legend(fontsize=7, loc="best")
        ax_kv.set_xlabel("seconds into the run")
    axes[0][0].set_xlim(0, settings["duration_s"])
    axes[0][0].set_ylabel("requests ended per second")
    axes[1][0].set_ylabel("frontend event-loop delay (ms)")
    axes[2][0].set_ylabel("worker state")
    axes[3][0].set_ylabel("worker KV cache in use (%)")
    shown = {b["state"] for r in runs for w in r["workers"].values() for b in w["bands"]}
    handles = [Patch(color=c, label=s) for s, c in STATE_COLORS.items() if s in shown]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(
        f"The seed failure chain: ~{settings['prompt_tokens'] // 1000}k-token prompts, unary, "
        f"c{settings['concurrency']}, ACK timeout {settings['ack_timeout_s']:g} s, "
        "1 prefill + 1 decode worker over TCP",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


# --- slim JSON for the docs ---------------------------------------------------------------


def markdown_table(results: Mapping[str, Any]) -> str:
    """The runs' totals as the table of docs/fault-tolerance.md."""
    lines = [
        "| run | req/s | completed | failed (by status) | cut off at the end | worker "
        "inhibited (times) | misses excused | ACK misses blamed / excused (log) | loop p99, "
        "worst second | load avg before → after | other processes' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        t, m, log = r["totals"], r["machine"], r["totals"]["log"]
        failed = ", ".join(f"{k}: {v}" for k, v in t["failed_by_status"].items())
        p99 = t["loop_p99_ms_worst_bin"]
        lines.append(
            f"| {r['name']} | {t['req_per_s']:g} | {t['ok']} | {t['failed']}"
            f"{f' ({failed})' if failed else ''} | {t['cut_off']} | {t['to_inhibited']} | "
            f"{t['excused_timeouts']} | {log['ack_missed_blamed']} / {log['ack_missed_excused']} "
            f"| {'-' if p99 is None else f'{p99:,.0f} ms'} | {m['load_avg_before'][0]} → "
            f"{m['load_avg_after'][0]} | {m['others_cpu_pct']}% |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Settings()
    p.add_argument(
        "--runs",
        default="chain,defaults,attribution",
        help=f"comma-separated, from {', '.join(RUNS)} (default: all, in that order)",
    )
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load per run")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--ack-timeout", type=float, default=d.ack_timeout_s)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--prompts", type=int, default=d.prompt_count, help="distinct prompts, cycled")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--speedup-ratio", type=float, default=d.speedup_ratio)
    p.add_argument("--seed", type=int, default=d.seed, help="prompt synthesis seed")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: bench-results/seed-<timestamp>)",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        help="only redraw the plot and table from this results.json",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write docs/img/seed_scenario.png and docs/data/seed_scenario.json",
    )
    args = p.parse_args(argv)
    if args.render is not None:
        results = orjson.loads(args.render.read_bytes())
        out_dir = args.render.parent
    else:
        names = [n.strip() for n in args.runs.split(",") if n.strip()]
        unknown = [n for n in names if n not in RUNS]
        if unknown or not names:
            p.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
        settings = Settings(
            duration_s=args.duration,
            concurrency=args.concurrency,
            ack_timeout_s=args.ack_timeout,
            max_tokens=args.max_tokens,
            prompt_count=args.prompts,
            prompt_tokens=args.prompt_tokens,
            speedup_ratio=args.speedup_ratio,
            seed=args.seed,
        )
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = args.out or ROOT / "bench-results" / f"seed-{stamp}"
        out_dir.mkdir(parents=True, exist_ok=True)
        results = trio.run(run_all, names, settings, out_dir)
    print(markdown_table(results))
    png = plot(results, out_dir / "seed_scenario.png")
    print(f"plot: {png}", file=sys.stderr)
    if args.docs:
        plot(results, ROOT / "docs" / "img" / "seed_scenario.png")
        data = ROOT / "docs" / "data" / "seed_scenario.json"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_bytes(orjson.dumps(results) + b"\n")
        print(f"docs: {ROOT / 'docs' / 'img' / 'seed_scenario.png'}, {data}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
