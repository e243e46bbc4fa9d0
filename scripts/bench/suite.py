"""The benchmark suite behind ``make bench``: what is run, in which order, and the records.

Phases (each optional but the first), every one bounded in requests and time:

1. **Calibration**: the tokenizer backends' encode rate on the long prompts' texts, in
   this process on one thread (tokens per CPU-second), so that long-prompt throughput
   can be read against the machine's ceiling (``usable cores × rate``).
2. **Main**: headwater with the defaults (fastokens, ``thread`` mode) runs every
   scenario × {unary, stream} × concurrency, once per worker layout in
   ``topologies`` (mocker workers inside the frontend process, ``headwater serve``'s
   default, and/or as two worker processes, Dynamo's layout), and with
   ``frontend_processes`` > 1 once more as that many frontend processes on one port
   (``headwater serve --processes N``, in-process workers). With Dynamo, the suite
   starts Dynamo's frontend + mockers twice (default tokenizer, then
   ``DYN_TOKENIZER=fastokens``) and alternates runs: headwater, Dynamo, headwater,
   Dynamo... on the same prompts (a fresh prompt set per group), the same client and
   the same ``--speedup-ratio``. The headwater processes live through the whole phase,
   so their RSS is followed across it.
3. **Matrix**: tokenizer backend × tokenize mode, one fresh frontend each, on the long
   scenario (unary, c16): loop delay over time, throughput, TTFT.
4. **Profile**: the default frontend under pyinstrument for one short and one long run;
   CPU per request split by stage (:mod:`scripts.bench.profile`).

Each run yields one JSON record (:func:`scripts.bench.measure.build_record`), appended
to ``runs.jsonl`` as soon as it exists (a Ctrl-C keeps what was measured);
``results.json`` holds everything at the end, and :mod:`scripts.bench.report` /
:mod:`scripts.bench.plots` render it.

Cancellation: every server lives in an async context manager that stops it on the way
out (shielded, with deadlines), so Ctrl-C or an error leaves no process behind.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from scripts.bench import profile, prompts
from scripts.bench.loadgen import LoadGenError
from scripts.bench.machine import encode_rate, machine_info
from scripts.bench.measure import (
    IDLE_SETTLE_S,
    Measurement,
    MemoryMB,
    RunSpec,
    bodies_for,
    build_record,
    current_memory_mb,
    idle_memory_mb,
    make_prompt_set,
    measure,
    warm_up,
)
from scripts.bench.servers import (
    DynamoUnavailable,
    ServerError,
    ServerInfo,
    dynamo_server,
    ensure_dynamo,
    headwater_server,
)

SCENARIOS: tuple[str, ...] = ("short", "long", "shared-prefix")
CONCURRENCY: Mapping[str, tuple[int, ...]] = {
    "short": (16, 64),
    "long": (4, 16),
    "shared-prefix": (4, 16),
}
#: Requests per run by (scenario, concurrency): full and --quick. Full runs last 1-14 s
#: on 2 cores (2-11 s on average per scenario). A sixth of these, the counts before, made
#: runs of 0.4-2.4 s on average, whose ramp at the start and drain at the end moved
#: ratios by up to 0.4 (docs/performance.md, Method: "Runs of seconds").
FULL_REQUESTS: Mapping[tuple[str, int], int] = {
    ("short", 16): 4800,
    ("short", 64): 7200,
    ("long", 4): 480,
    ("long", 16): 960,
    ("shared-prefix", 4): 480,
    ("shared-prefix", 16): 1200,
}
QUICK_REQUESTS: Mapping[tuple[str, int], int] = {
    ("short", 16): 80,
    ("long", 16): 16,
    ("shared-prefix", 16): 16,
}
#: --quick runs one concurrency per scenario.
QUICK_CONCURRENCY: Mapping[str, tuple[int, ...]] = {s: (16,) for s in SCENARIOS}
#: Where progress lines go (stderr by default).
Log = Callable[[str], None]
DEFAULT_BACKEND, DEFAULT_MODE = "fastokens", "thread"
MATRIX_BACKENDS: tuple[str, ...] = ("fastokens", "hf")
MATRIX_MODES: tuple[str, ...] = ("inline", "thread-gil", "thread")
MATRIX_CONCURRENCY = 16
DYNAMO_TOKENIZERS: tuple[str, ...] = ("default", "fastokens")


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    """What one ``make bench`` run measures; see ``python -m scripts.bench.run --help``."""

    out_dir: Path
    repo_root: Path
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    dynamo: bool = True
    #: Dynamo's tokenizers to run beside, each a phase of its own (DYNAMO_TOKENIZERS).
    dynamo_tokenizers: tuple[str, ...] = DYNAMO_TOKENIZERS
    matrix: bool = True
    profile: bool = True
    dynamo_scripts: Path | None = None
    dynamo_install: Path | None = None
    speedup_ratio: float = 1000.0
    server_args: tuple[str, ...] = ()
    #: headwater's worker layouts in the main phase ("inprocess", "processes"); each
    #: runs beside Dynamo. The first is the one the targets are judged on.
    topologies: tuple[str, ...] = ("inprocess",)
    #: With N > 1, one more headwater in the main phase: ``--processes N`` (N frontend
    #: processes on one port, in-process workers). 0 or 1: no such variant.
    frontend_processes: int = 1
    requests_scale: float = 1.0
    #: Each main-phase run is repeated this often, a fresh prompt set each time, still
    #: alternating with Dynamo; the report gives medians over the rounds.
    rounds: int = 1
    time_limit_s: float | None = None  # per run; None: 60 s quick, 180 s full
    progress: bool = True
    #: Explicit request counts by (scenario, concurrency); overrides the tables.
    requests: Mapping[tuple[str, int], int] | None = None
    #: Override of CONCURRENCY per scenario.
    concurrency: Mapping[str, tuple[int, ...]] | None = None
    streams: tuple[bool, ...] = (False, True)
    matrix_requests: int | None = None
    calibration_texts: int | None = None
    idle_settle_s: float = IDLE_SETTLE_S

    @property
    def run_time_limit_s(self) -> float:
        if self.time_limit_s is not None:
            return self.time_limit_s
        return 60.0 if self.quick else 180.0


def requests_for(cfg: SuiteConfig, scenario: str, concurrency: int) -> int:
    """The request count of one run, after ``requests_scale`` (at least the concurrency)."""
    table = cfg.requests or (QUICK_REQUESTS if cfg.quick else FULL_REQUESTS)
    base = table.get((scenario, concurrency), 8 * concurrency)
    return max(concurrency, round(base * cfg.requests_scale))


def main_plan(cfg: SuiteConfig) -> list[RunSpec]:
    """Every (scenario, unary/stream, concurrency) of the main phase, in run order."""
    plan = []
    concurrency = cfg.concurrency or (QUICK_CONCURRENCY if cfg.quick else CONCURRENCY)
    for scenario in cfg.scenarios:
        for stream in cfg.streams:
            for c in concurrency[scenario]:
                plan.append(RunSpec(scenario, stream, c, requests_for(cfg, scenario, c)))
    return plan


def pair_id(phase: str, spec: RunSpec, round_index: int, rounds: int) -> str:
    """What ties a headwater run to the Dynamo run beside it: one id per round."""
    base = f"{phase}: {spec.key}"
    return f"{base} #{round_index + 1}" if rounds > 1 else base


@dataclass(frozen=True, slots=True)
class HeadwaterVariant:
    """One headwater server of the main phase: its worker layout and frontend processes."""

    topology: str = "inprocess"
    frontend_processes: int = 1


def headwater_variants(cfg: SuiteConfig) -> list[HeadwaterVariant]:
    """The main phase's headwater servers, in run order: one per topology, then, with
    several frontend processes configured, that group once per topology too (in-process
    workers: ``headwater serve``'s default; worker processes: Dynamo's layout)."""
    out = [HeadwaterVariant(topology) for topology in cfg.topologies]
    if cfg.frontend_processes > 1:
        out += [HeadwaterVariant(t, cfg.frontend_processes) for t in cfg.topologies]
    return out


def matrix_spec(cfg: SuiteConfig) -> RunSpec:
    """The long-prompt run each backend × mode frontend gets."""
    n = cfg.matrix_requests or (16 if cfg.quick else 64)
    return RunSpec("long", False, MATRIX_CONCURRENCY, max(1, round(n * cfg.requests_scale)))


def profile_specs(cfg: SuiteConfig) -> list[RunSpec]:
    short, long_ = (100, 16) if cfg.quick else (600, 100)
    return [RunSpec("short", False, 16, short), RunSpec("long", False, 16, long_)]


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
    #: The same moments' RSS, PSS and USS, with each process's (``MemoryMB`` as JSON).
    idle_memory_mb: dict[str, dict[str, Any]] = field(default_factory=dict)
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
            config={
                k: str(v) if isinstance(v, Path) else v
                for k, v in asdict(cfg).items()
                if k not in ("requests", "concurrency")
            },
            machine={},
            started=datetime.datetime.now().isoformat(timespec="seconds"),
            quick=cfg.quick,
            load_avg_start=os.getloadavg(),
        )
        self._bar: Any = None

    # -- progress ----------------------------------------------------------------------

    def planned_runs(self, dynamo_phases: int) -> int:
        servers = len(headwater_variants(self.cfg)) + (1 if dynamo_phases else 0)
        main = len(main_plan(self.cfg)) * servers * max(1, dynamo_phases) * self.cfg.rounds
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

            self._bar = tqdm(
                total=self.planned_runs(len(dynamo_phases)),
                desc="bench",
                unit="run",
                position=0,
                file=sys.stderr,
            )
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
        return list(cfg.dynamo_tokenizers)

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
        self,
        server: ServerInfo,
        spec: RunSpec,
        ps: prompts.PromptSet,
        phase: str,
        pair: str | None,
    ) -> dict[str, Any] | None:
        bodies = bodies_for(ps, spec, server.model)
        mean = sum(p.tokens for p in ps.prompts) / len(ps)
        try:
            m = await measure(
                server,
                spec,
                bodies,
                phase=phase,
                pair=pair,
                content_tokens_mean=mean,
                time_limit_s=self.cfg.run_time_limit_s,
                progress=self.cfg.progress,
            )
        except LoadGenError as exc:
            self._skip(f"{server.label} {spec.key}: load client failed: {exc}")
            self._tick()
            return None
        return await self._record(m)

    def _headwater(
        self,
        backend: str = DEFAULT_BACKEND,
        mode: str = DEFAULT_MODE,
        *,
        variant: HeadwaterVariant = HeadwaterVariant(),
        profile_path: Path | None = None,
    ) -> AbstractAsyncContextManager[ServerInfo]:
        return headwater_server(
            backend=backend,
            mode=mode,
            speedup_ratio=self.cfg.speedup_ratio,
            log_dir=self.logs,
            topology=variant.topology,
            extra_args=self.cfg.server_args,
            profile_path=profile_path,
            frontend_processes=variant.frontend_processes,
        )

    def _idle(self, label: str, memory: MemoryMB) -> None:
        """Record a server's memory at rest (RSS, PSS and USS, each process's too)."""
        self.results.idle_rss_mb[label] = memory.rss
        self.results.idle_memory_mb[label] = {
            "rss_mb": memory.rss,
            "pss_mb": memory.pss,
            "uss_mb": memory.uss,
            "processes": [
                dict(zip(("role", "pid", "rss_mb", "pss_mb", "uss_mb"), row, strict=True))
                for row in memory.processes
            ],
        }

    async def main_phase(self, dynamo_phases: Sequence[str]) -> None:
        cfg = self.cfg
        plan = main_plan(cfg)
        async with AsyncExitStack() as stack:
            hws: list[ServerInfo] = []
            # The prompt synthesiser loads its tokenizer while the servers start. The
            # nursery is on the stack, under the servers, so scopes nest as they exit.
            nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(partial(trio.to_thread.run_sync, prompts.default_counter))
            for variant in headwater_variants(cfg):
                try:
                    hws.append(await stack.enter_async_context(self._headwater(variant=variant)))
                except ServerError as exc:
                    if variant.frontend_processes == 1:
                        raise
                    # The multi-process frontend is an extra: the others run without it.
                    self._skip(f"headwater ×{variant.frontend_processes} procs: {exc}")
            for hw in hws:
                self._idle(hw.label, await idle_memory_mb(hw, cfg.idle_settle_s))
                await warm_up(hw, cfg.scenarios)
                self._idle(
                    hw.label + " (after warm-up)",
                    await trio.to_thread.run_sync(current_memory_mb, hw),
                )
            if not dynamo_phases:
                for spec in plan:
                    for _ in range(cfg.rounds):
                        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                        for hw in hws:
                            await self._run_one(hw, spec, ps, "main", None)
                return
            for tokenizer in dynamo_phases:
                await self._dynamo_phase(hws, tokenizer, plan)

    async def _dynamo_phase(
        self, hws: Sequence[ServerInfo], tokenizer: str, plan: list[RunSpec]
    ) -> None:
        cfg = self.cfg
        assert cfg.dynamo_scripts is not None
        assert cfg.dynamo_install is not None
        phase = f"vs dynamo {tokenizer}"
        done = 0
        try:
            async with dynamo_server(
                scripts_dir=cfg.dynamo_scripts,
                install_dir=cfg.dynamo_install,
                tokenizer=tokenizer,
                speedup_ratio=cfg.speedup_ratio,
                log_dir=self.logs,
            ) as dyn:
                self._idle(dyn.label, await idle_memory_mb(dyn, cfg.idle_settle_s))
                await warm_up(dyn, cfg.scenarios)
                for spec in plan:
                    for rnd in range(cfg.rounds):
                        ps = await trio.to_thread.run_sync(make_prompt_set, spec)
                        pair = pair_id(phase, spec, rnd, cfg.rounds)
                        for hw in hws:  # alternating: headwater, Dynamo, headwater, Dynamo...
                            await self._run_one(hw, spec, ps, phase, pair)
                        await self._run_one(dyn, spec, ps, phase, pair)
                        done += 1
                return
        except (DynamoUnavailable, ServerError) as exc:
            self._skip(f"Dynamo ({tokenizer}) skipped: {exc}")
        # Dynamo could not run: headwater's runs of this phase still happen.
        for i in range(done, len(plan) * cfg.rounds):
            spec = plan[i // cfg.rounds]
            ps = await trio.to_thread.run_sync(make_prompt_set, spec)
            for hw in hws:
                await self._run_one(hw, spec, ps, phase, None)
            self._tick()  # the Dynamo run that was planned beside them

    async def matrix_phase(self) -> None:
        spec = matrix_spec(self.cfg)
        for backend in MATRIX_BACKENDS:
            for mode in MATRIX_MODES:
                try:
                    async with self._headwater(backend, mode) as server:
                        self._idle(
                            server.label, await idle_memory_mb(server, self.cfg.idle_settle_s)
                        )
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
