"""Markdown from a suite's results: tables, ratios against Dynamo, targets met or missed.

Pure functions of the ``results.json`` dict (:class:`scripts.bench.suite.SuiteResults`),
so a report can be re-rendered from an earlier run (``make bench ARGS='--render ...'``).
:func:`update_docs` rewrites only the part of ``docs/performance.md`` between the
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers; prose outside them is kept.

Conventions: times in ms; a ratio is headwater ÷ Dynamo (req/s above 1 and latency
below 1 favour headwater); ``≤`` marks a loop maximum known only as a histogram bound.
Targets are judged on the default frontend, ``headwater serve``'s default of a process per
usable core (variant ``... ×N procs``, its CPU and RSS summed over its processes); the
one-process frontend and the frontend in front of worker processes get a column each
against the same targets.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
HEADWATER_DEFAULT = "headwater fastokens/thread"

#: Targets (benchmarks, not tests): the figures they name are in docs/performance.md.
LOOP_MAX_TARGET_MS = 20.0
LOOP_P99_TARGET_MS = 5.0
IDLE_RSS_TARGET_MB = 300.0
RSS_GROWTH_LIMIT = 0.10  # "flat": RSS after every run within +10% of the post-warm-up RSS
#: A group's PSS at rest against one process's (the memory it costs is shared), and the
#: ceiling at two processes.
GROUP_PSS_RATIO_TARGET = 1.3
GROUP_PSS_TARGET_MB = 350.0
#: req/s of the default (every core) against Dynamo: long prompts at c16, and the rest.
LONG_RATIO_TARGET = 1.5
RATIO_TARGET = 1.0

Record = Mapping[str, Any]


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; ``-`` for missing."""
    if value is None:
        return "-"
    if abs(value) >= 100 or digits == 0:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def pair_cell(a: float | None, b: float | None, digits: int = 1) -> str:
    return f"{fmt(a, digits)} / {fmt(b, digits)}"


def loop_max_cell(r: Record) -> str:
    value = fmt(r.get("loop_max_ms"))
    return value if r.get("loop_max_exact") or value == "-" else f"≤ {value}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- tables ---------------------------------------------------------------------------


def runs_table(runs: Sequence[Record]) -> str:
    """One row per run: the figures the suite measures."""
    header = [
        "phase",
        "server",
        "run",
        "ok/req",
        "req/s",
        "TTFT p50/p99",
        "ITL p50/p99",
        "e2e p50/p99",
        "FE CPU ms/req",
        "all CPU ms/req",
        "peak RSS MB",
        "loop p99 / max ms",
        "stalls",
        "client CPU %",
    ]
    rows = []
    for r in runs:
        failed = f" ({r['failed']} failed)" if r.get("failed") else ""
        rows.append(
            [
                r["phase"],
                r["label"],
                r["key"],
                f"{r['ok']}/{r['requests']}{failed}",
                fmt(r["req_per_s"]),
                pair_cell(r["ttft_p50_ms"], r["ttft_p99_ms"]),
                pair_cell(r["itl_p50_ms"], r["itl_p99_ms"], 2),
                pair_cell(r["e2e_p50_ms"], r["e2e_p99_ms"]),
                fmt(r["frontend_cpu_ms_per_req"], 2),
                fmt(r["server_cpu_ms_per_req"], 2),
                fmt(r["peak_rss_mb"], 0),
                f"{fmt(r['loop_p99_ms'], 2)} / {loop_max_cell(r)}",
                _stalls(r),
                fmt(r["client_cpu_pct"]),
            ]
        )
    return table(header, rows)


def _stalls(r: Record) -> str:
    if r.get("stalls") is None:
        return "-"
    return f"{r['stalls']} (>{fmt(r['stall_threshold_ms'], 0)} ms)"


@dataclass(frozen=True, slots=True)
class Pair:
    """A headwater run and the Dynamo run beside it (same prompts, adjacent in time)."""

    phase: str
    key: str
    headwater: Record
    dynamo: Record

    def ratio(self, field: str) -> float | None:
        a, b = self.headwater.get(field), self.dynamo.get(field)
        if a is None or b is None or b == 0:
            return None
        return float(a / b)


def pairs(runs: Sequence[Record]) -> list[Pair]:
    """Each headwater run with the Dynamo run of its group (same ``pair`` id)."""
    groups: dict[str, list[Record]] = {}
    for r in runs:
        if r.get("pair") and r.get("ok"):
            groups.setdefault(r["pair"], []).append(r)
    out = []
    for group in groups.values():
        dynamo = [r for r in group if r["server"] == "dynamo"]
        if not dynamo:
            continue
        for h in group:
            if h["server"] == "headwater":
                out.append(Pair(h["phase"], h["key"], h, dynamo[0]))
    return out


@dataclass(frozen=True, slots=True)
class PairGroup:
    """The pairs of one run repeated over rounds (``--rounds``): the same phase, headwater
    server and run key. Figures are medians over the rounds: on a shared machine two runs
    of the same code differ by tens of percent, and the median of alternated rounds is
    what one can repeat."""

    phase: str
    key: str
    pairs: tuple[Pair, ...]

    @property
    def variant(self) -> str:
        return str(self.pairs[0].headwater["variant"])

    def ratio(self, field: str) -> float | None:
        """The median over the rounds of headwater ÷ Dynamo for *field*."""
        xs = self._ratios(field)
        return statistics.median(xs) if xs else None

    def ratio_range(self, field: str) -> tuple[float, float] | None:
        """Lowest and highest round's ratio, when there are several rounds."""
        xs = self._ratios(field)
        return (min(xs), max(xs)) if len(xs) > 1 else None

    def median(self, side: str, field: str) -> float | None:
        """The median of *side*'s (``headwater`` or ``dynamo``) *field* over the rounds."""
        xs = [v for p in self.pairs if (v := getattr(p, side).get(field)) is not None]
        return statistics.median(xs) if xs else None

    def ratio_text(self, field: str, unit: str = "") -> str:
        """``0.81`` for one round; ``0.81 (0.75-0.90, 3 rounds)`` for several."""
        text = fmt(self.ratio(field), 2) + unit
        spread = self.ratio_range(field)
        if spread is not None:
            text += f" ({spread[0]:.2f}-{spread[1]:.2f}, {len(self.pairs)} rounds)"
        return text

    def _ratios(self, field: str) -> list[float]:
        return [x for p in self.pairs if (x := p.ratio(field)) is not None]


def group_pairs(ps: Sequence[Pair]) -> list[PairGroup]:
    """Pairs grouped by (phase, headwater server, run key), in order of first appearance."""
    groups: dict[tuple[str, str, str], list[Pair]] = {}
    for p in ps:
        groups.setdefault((p.phase, p.headwater["label"], p.key), []).append(p)
    return [PairGroup(phase, key, tuple(group)) for (phase, _, key), group in groups.items()]


def ratio_table(ps: Sequence[Pair]) -> str:
    """req/s and latency ratios per run (medians over its rounds); ITL as absolute values
    (Dynamo's median gap is often ~0: several tokens arrive in one read, so a ratio of
    medians says nothing)."""
    header = [
        "against",
        "headwater",
        "run",
        "headwater req/s",
        "Dynamo req/s",
        "req/s ratio",
        "TTFT p50 / p99 ratio",
        "e2e p50 / p99 ratio",
        "ITL p99 ms headwater / Dynamo",
    ]
    rows = []
    for g in group_pairs(ps):
        rows.append(
            [
                g.phase.removeprefix("vs "),
                g.variant,
                g.key,
                fmt(g.median("headwater", "req_per_s")),
                fmt(g.median("dynamo", "req_per_s")),
                g.ratio_text("req_per_s"),
                pair_cell(g.ratio("ttft_p50_ms"), g.ratio("ttft_p99_ms"), 2),
                pair_cell(g.ratio("e2e_p50_ms"), g.ratio("e2e_p99_ms"), 2),
                pair_cell(g.median("headwater", "itl_p99_ms"), g.median("dynamo", "itl_p99_ms"), 2),
            ]
        )
    return table(header, rows)


def matrix_table(runs: Sequence[Record], idle_rss: Mapping[str, float | None]) -> str:
    header = [
        "backend / mode",
        "req/s",
        "prompt tok/s",
        "TTFT p50/p99",
        "loop p99 / max ms",
        "stalls",
        "stall records (max ms)",
        "longest stall: cause, where",
        "FE CPU ms/req",
        "idle RSS MB",
    ]
    rows = []
    for r in runs:
        if r["phase"] != "matrix":
            continue
        rows.append(
            [
                r["variant"],
                fmt(r["req_per_s"]),
                fmt(r["prompt_tokens_per_s"], 0),
                pair_cell(r["ttft_p50_ms"], r["ttft_p99_ms"]),
                f"{fmt(r['loop_p99_ms'], 2)} / {loop_max_cell(r)}",
                _stalls(r),
                f"{r['stall_records']} ({fmt(r['stall_record_max_ms'])})",
                _longest(r),
                fmt(r["frontend_cpu_ms_per_req"], 2),
                fmt(idle_rss.get(r["label"]), 0),
            ]
        )
    return table(header, rows)


def _longest(r: Record) -> str:
    """The longest stall's cause and innermost frame (``file:line in function``)."""
    top = (r.get("stall_longest") or [None])[0]
    if not top:
        return "-"
    where = str(top.get("where", "?")).split(": ", 1)[0].rsplit("/", 1)[-1]
    return f"{top.get('cause')}, `{where}`"


def multi_process_labels(results: Record) -> list[str]:
    """Labels of the main phase's headwater servers of several frontend processes."""
    labels = [
        r["label"]
        for r in results["runs"]
        if r["server"] == "headwater"
        and r["phase"] not in ("matrix", "profile")
        and (r.get("frontend_processes") or 1) > 1
    ]
    return list(dict.fromkeys(labels))


def frontend_processes(results: Record, label: str) -> int:
    """How many processes serve for the server *label* (1 unless a record says more)."""
    counts = [r.get("frontend_processes") or 1 for r in results["runs"] if r["label"] == label]
    return max(counts, default=1)


def _total_note(results: Record, label: str) -> str:
    n = frontend_processes(results, label)
    return f" (total: supervisor + {n} processes)" if n > 1 else ""


def _idle_label(results: Record, label: str) -> str:
    """An ``idle_rss_mb`` key for the memory table, its total noted for several processes."""
    base = label.removesuffix(" (after warm-up)")
    n = frontend_processes(results, base)
    if n == 1:
        return label
    warm = "after warm-up; " if base != label else ""
    return f"{base} ({warm}total: supervisor + {n} processes)"


def limit_rows(results: Record) -> list[dict[str, Any]]:
    """Long-prompt tokens/s against ``usable cores × single-thread encode rate``."""
    cores = results["machine"].get("usable_cpus") or 1
    out = []
    for cal in results.get("calibration", []):
        backend = cal["backend"]
        rate = cal.get("tokens_per_cpu_s")
        ceiling = rate * cores if rate else None
        thread = f"{backend}/thread"  # and its variants ("... ×2 procs"), not thread-gil
        candidates = [
            r
            for r in results["runs"]
            if r["server"] == "headwater"
            and r["scenario"] == "long"
            and r["phase"] != "profile"
            and r["ok"]
            and (r["variant"] == thread or r["variant"].startswith(thread + " "))
        ]
        best = max(candidates, key=lambda r: r["prompt_tokens_per_s"], default=None)
        achieved = best["prompt_tokens_per_s"] if best else None
        run = None
        if best:
            other = "" if best["variant"] == thread else f" ({best['variant']})"
            run = f"{best['phase']}: {best['key']}{other}"
        out.append(
            {
                "backend": backend,
                "rate": rate,
                "cores": cores,
                "ceiling": ceiling,
                "achieved": achieved,
                "run": run,
                "ratio": achieved / ceiling if achieved and ceiling else None,
            }
        )
    return out


def limit_table(results: Record) -> str:
    header = [
        "backend",
        "encode rate, 1 thread (tok/CPU-s)",
        "usable cores",
        "ceiling (tok/s)",
        "best long-prompt run (tok/s)",
        "share of ceiling",
        "run",
    ]
    rows = [
        [
            r["backend"],
            fmt(r["rate"], 0),
            str(r["cores"]),
            fmt(r["ceiling"], 0),
            fmt(r["achieved"], 0),
            "-" if r["ratio"] is None else f"{r['ratio']:.1%}",
            r["run"] or "-",
        ]
        for r in limit_rows(results)
    ]
    return table(header, rows)


def unprofiled_threads(results: Record, key: str) -> dict[str, float] | None:
    """Median per-thread CPU ms/request of the default frontend's unprofiled *key* runs."""
    runs = [
        r["threads_cpu_ms_per_req"]
        for r in results["runs"]
        if r["label"] == HEADWATER_DEFAULT
        and r["key"] == key
        and r["phase"] != "profile"
        and r.get("threads_cpu_ms_per_req")
    ]
    if not runs:
        return None
    return {k: statistics.median(t[k] for t in runs) for k in ("loop", "tokenizer", "other")}


def scaled_stage_ms(entry: Record, results: Record) -> dict[str, float] | None:
    """Stage ms/request: the profile's loop shares × the *unprofiled* run's loop CPU.

    The profiler slows the loop thread ~2-3×, so its own milliseconds overstate the
    cost; its shares are kept and applied to the CPU measured without it. Tokenizer
    threads are added to ``tokenize``. ``None`` without a matching unprofiled run.
    """
    threads = unprofiled_threads(results, entry["key"])
    if threads is None:
        return None
    out = {stage: share * threads["loop"] for stage, share in entry["stage_share_of_loop"].items()}
    out["tokenize"] = out.get("tokenize", 0.0) + threads["tokenizer"]
    out["other threads"] = threads["other"]
    return out


def stage_table(results: Record) -> str:
    entries = results.get("profile", [])
    if not entries:
        return "_No profile in this run._"
    stages = list(entries[0]["stage_ms_per_req"])
    scaled = [scaled_stage_ms(e, results) for e in entries]
    header = [
        "stage",
        *[f"{e['key']}: ms/req" for e in entries],
        *[f"{e['key']}: share of loop" for e in entries],
    ]
    rows = []
    for stage in stages:
        share = [e["stage_share_of_loop"].get(stage) for e in entries]
        cells = [fmt(sc.get(stage) if sc else None, 3) for sc in scaled]
        rows.append([stage, *cells, *["-" if x is None else f"{x:.0%}" for x in share]])
    totals = [fmt(sum(sc.values()), 3) if sc else "-" for sc in scaled]
    rows.append(["**total**", *totals, *["" for _ in entries]])
    return table(header, rows)


def profile_overhead(results: Record) -> list[str]:
    """One line per profiled run: its CPU/request against the same run unprofiled."""
    lines = []
    for e in results.get("profile", []):
        plain = [
            r["frontend_cpu_ms_per_req"]
            for r in results["runs"]
            if r["label"] == HEADWATER_DEFAULT
            and r["key"] == e["key"]
            and r["phase"] != "profile"
            and r["frontend_cpu_ms_per_req"]
        ]
        if plain and e["frontend_cpu_ms_per_req"]:
            factor = e["frontend_cpu_ms_per_req"] / statistics.median(plain)
            lines.append(
                f"{e['key']}: {fmt(e['frontend_cpu_ms_per_req'], 2)} ms/req profiled "
                f"vs {fmt(statistics.median(plain), 2)} ms/req without the profiler "
                f"(×{factor:.2f})"
            )
    return lines


def memory_rows(results: Record) -> list[tuple[str, str, str, str]]:
    """(what, RSS, PSS, USS) rows: every server at rest, then the default frontend and
    each multi-process one at the end of the main phase and at their peak (VmHWM, RSS
    only). A group's figures are totals over its processes (supervisor and zygote
    included); its PSS is the memory it really holds, its RSS counts shared pages once
    per process."""
    memory = results.get("idle_memory_mb", {})
    rows = []
    for label, mb in results.get("idle_rss_mb", {}).items():
        m = memory.get(label, {})
        rows.append(
            (
                _idle_label(results, label),
                fmt(mb, 0),
                fmt(m.get("pss_mb"), 0),
                fmt(m.get("uss_mb"), 0),
            )
        )
    for label in (HEADWATER_DEFAULT, *multi_process_labels(results)):
        main = _main_headwater(results, label)
        if not main:
            continue
        note = _total_note(results, label)
        last = main[-1]
        rows.append(
            (
                f"{label}: at the end of the main phase{note}",
                fmt(last["rss_end_mb"], 0),
                fmt(last.get("pss_end_mb"), 0),
                fmt(last.get("uss_end_mb"), 0),
            )
        )
        rows.append(
            (
                f"{label}: peak RSS (VmHWM) over the main phase{note}",
                fmt(max(r["peak_rss_mb"] or 0 for r in main), 0),
                "-",
                "-",
            )
        )
    return rows


def process_memory_rows(results: Record) -> list[list[str]]:
    """Each process of every multi-process frontend at rest: role, pid, RSS, PSS, USS."""
    rows = []
    for label in multi_process_labels(results):
        for moment in (label, label + " (after warm-up)"):
            for p in results.get("idle_memory_mb", {}).get(moment, {}).get("processes", []):
                rows.append(
                    [
                        moment.removeprefix("headwater "),
                        p["role"],
                        str(p["pid"]),
                        fmt(p["rss_mb"], 0),
                        fmt(p["pss_mb"], 0),
                        fmt(p["uss_mb"], 0),
                    ]
                )
    return rows


def _main_headwater(results: Record, label: str = HEADWATER_DEFAULT) -> list[Record]:
    return sorted(
        (
            r
            for r in results["runs"]
            if r["label"] == label and r["phase"] not in ("matrix", "profile")
        ),
        key=lambda r: r["started_unix"],
    )


# --- targets ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    goal: str
    measured: str
    passed: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "met", False: "**missed**", None: "not measured"}[self.passed]


def targets(results: Record, label: str = HEADWATER_DEFAULT) -> list[Target]:
    """The project's performance targets, judged on the server *label*'s runs (by
    default the default frontend's; the same targets serve for any headwater variant,
    its figures as the records hold them: CPU and RSS summed over its processes)."""
    out: list[Target] = []
    long16 = [
        r
        for r in _main_headwater(results, label)
        if r["scenario"] == "long" and r["concurrency"] == 16
    ]
    maxes = [r["loop_max_ms"] for r in long16 if r["loop_max_ms"] is not None]
    worst = max(long16, key=lambda r: r["loop_max_ms"] or 0, default=None)
    out.append(
        Target(
            "long prompts c16: loop max delay",
            f"< {LOOP_MAX_TARGET_MS:g} ms",
            f"worst {loop_max_cell(worst)} ms over {len(long16)} runs" if worst else "-",
            bool(maxes) and max(maxes) <= LOOP_MAX_TARGET_MS if long16 else None,
        )
    )
    p99s = [r["loop_p99_ms"] for r in long16 if r["loop_p99_ms"] is not None]
    measured = "-"
    if p99s:
        measured = f"worst {fmt(max(p99s), 2)} ms"
        if len(p99s) > 1:
            measured += f", median {fmt(statistics.median(p99s), 2)} ms over {len(p99s)} runs"
    out.append(
        Target(
            "long prompts c16: loop p99 delay",
            f"< {LOOP_P99_TARGET_MS:g} ms",
            measured,
            max(p99s) < LOOP_P99_TARGET_MS if p99s else None,
        )
    )
    groups = [
        g for g in group_pairs(pairs(results["runs"])) if g.pairs[0].headwater["label"] == label
    ]
    for phase, name, scenarios, floor in (
        (
            "vs dynamo fastokens",
            "long prompts c16: req/s vs Dynamo + fastokens",
            ("long",),
            LONG_RATIO_TARGET,
        ),
        (
            "vs dynamo fastokens",
            "short prompts: req/s vs Dynamo + fastokens",
            ("short",),
            RATIO_TARGET,
        ),
        (
            "vs dynamo fastokens",
            "shared prefix: req/s vs Dynamo + fastokens",
            ("shared-prefix",),
            RATIO_TARGET,
        ),
        (
            "vs dynamo default",
            "every scenario: req/s vs Dynamo (default tokenizer)",
            ("long", "short", "shared-prefix"),
            RATIO_TARGET,
        ),
    ):
        chosen = [
            g
            for g in groups
            if g.phase == phase
            and g.pairs[0].headwater["scenario"] in scenarios
            and (scenarios != ("long",) or g.pairs[0].headwater["concurrency"] == 16)
        ]
        # Each run's median over its rounds must reach the floor.
        ratios = [x for g in chosen if (x := g.ratio("req_per_s")) is not None]
        out.append(
            Target(
                name,
                f"≥ {floor:g}×",
                ", ".join(f"{g.key} {g.ratio_text('req_per_s', '×')}" for g in chosen) or "-",
                min(ratios) >= floor if ratios else None,
            )
        )
    idle = results.get("idle_rss_mb", {}).get(label)
    dyn_idle = [v for k, v in results.get("idle_rss_mb", {}).items() if k.startswith("dynamo")]
    n = frontend_processes(results, label)
    out.append(
        Target(
            "frontend RSS idle, default tokenizer",
            f"< {IDLE_RSS_TARGET_MB:g} MB",
            f"{fmt(idle, 0)} MB"
            + (f" over {n} processes + supervisor" if n > 1 else "")
            + (
                f" (Dynamo frontend: {', '.join(fmt(v, 0) for v in dyn_idle)} MB)"
                if dyn_idle
                else ""
            ),
            idle < IDLE_RSS_TARGET_MB if idle is not None else None,
        )
    )
    out.append(rss_flat(results, label))
    out.append(group_pss(results, label))
    out.append(rss_flat(results, label, "pss"))
    return out


def group_pss(results: Record, label: str = HEADWATER_DEFAULT) -> Target:
    """Is the memory of a group of processes shared? Its total PSS at rest against the
    one-process frontend's (for that one itself: its PSS, the reference)."""
    name = "frontend PSS idle: a group vs one process"
    goal = f"≤ {GROUP_PSS_RATIO_TARGET:g}× (≤ {GROUP_PSS_TARGET_MB:g} MB at 2 processes)"
    memory = results.get("idle_memory_mb", {})
    one = memory.get(HEADWATER_DEFAULT, {}).get("pss_mb")
    n = frontend_processes(results, label)
    if n == 1:
        return Target(
            name, goal, f"{fmt(memory.get(label, {}).get('pss_mb'), 0)} MB (the reference)", None
        )
    group = memory.get(label, {}).get("pss_mb")
    if group is None or not one:
        return Target(name, goal, "-", None)
    ratio = group / one
    passed = ratio <= GROUP_PSS_RATIO_TARGET and (n != 2 or group <= GROUP_PSS_TARGET_MB)
    return Target(
        name,
        goal,
        f"{fmt(group, 0)} MB over {n} processes + supervisor + "
        f"zygote: {ratio:.2f}× one process's {fmt(one, 0)} MB",
        passed,
    )


def rss_flat(results: Record, label: str = HEADWATER_DEFAULT, kind: str = "rss") -> Target:
    """Does the frontend's (*label*'s, by default the default one's) RSS (or, *kind*
    ``"pss"``, PSS) grow across the main phase?

    With two passes over the same traffic (beside Dynamo-default, then Dynamo-fastokens)
    the figure after the second pass is compared with the one after the first: a leak
    shows as growth. With one pass, the highest after a run is compared with the one
    right after warm-up.
    """
    what = kind.upper()
    name, goal = f"frontend {what} flat across the run", f"growth < {RSS_GROWTH_LIMIT:.0%}"
    key = f"{kind}_end_mb"
    main = [r for r in _main_headwater(results, label) if r.get(key)]
    if not main:
        return Target(name, goal, "-", None)
    passes: dict[str, list[Record]] = {}
    for r in main:
        passes.setdefault(r["phase"], []).append(r)
    ends = [r[key] for r in main]
    span = f"range {fmt(min(ends), 0)}-{fmt(max(ends), 0)} MB over {len(main)} runs"
    if len(passes) >= 2:
        ordered = list(passes.values())  # dicts keep the run order
        first, last = ordered[0][-1][key], ordered[-1][-1][key]
        growth = last / first - 1
        return Target(
            name,
            f"pass 2 vs pass 1: {goal}",
            f"after pass 1 {fmt(first, 0)} MB, after pass 2 {fmt(last, 0)} MB "
            f"({growth:+.1%}); {span}",
            growth < RSS_GROWTH_LIMIT,
        )
    moment = label + " (after warm-up)"
    warm = (
        results.get("idle_rss_mb", {}).get(moment)
        if kind == "rss"
        else results.get("idle_memory_mb", {}).get(moment, {}).get(f"{kind}_mb")
    )
    if not warm:
        return Target(name, goal, span, None)
    growth = max(ends) / warm - 1
    return Target(
        name,
        f"vs after warm-up: {goal}",
        f"after warm-up {fmt(warm, 0)} MB, highest after a run "
        f"{fmt(max(ends), 0)} MB ({growth:+.1%}); {span}",
        growth < RSS_GROWTH_LIMIT,
    )


def targets_table(
    ts: Sequence[Target], others: Mapping[str, Sequence[Target]] | None = None
) -> str:
    """The targets, one row each; *others* (server label → the same targets judged on
    that server) add a column each: measured, and the verdict in brackets."""
    others = others or {}
    header = [
        "target",
        "goal",
        "measured",
        "verdict",
        *(label.removeprefix("headwater ") for label in others),
    ]
    rows = []
    for i, t in enumerate(ts):
        extra = [f"{o[i].measured} ({o[i].verdict})" for o in others.values()]
        rows.append([t.name, t.goal, t.measured, t.verdict, *extra])
    return table(header, rows)


def judged_label(results: Record) -> str:
    """The variant the targets are judged on: what ``headwater serve`` runs by default,
    one process per usable core (the main phase's group), else the one-process one."""
    multi = multi_process_labels(results)
    return multi[0] if multi else HEADWATER_DEFAULT


def all_targets_table(results: Record) -> str:
    """The targets judged on the default frontend, with a column for each other
    headwater variant of the main phase (one process; worker processes)."""
    judged = judged_label(results)
    labels = [
        r["label"]
        for r in results["runs"]
        if r["server"] == "headwater" and r["phase"] not in ("matrix", "profile")
    ]
    others = {label: targets(results, label) for label in dict.fromkeys(labels) if label != judged}
    return targets_table(targets(results, judged), others)


# --- the whole report -------------------------------------------------------------------


def machine_table(results: Record) -> str:
    m = results["machine"]
    pkgs = ", ".join(f"{k} {v}" for k, v in m.get("packages", {}).items() if v)
    rows = [
        ["CPU", f"{m.get('cpu_model')} ({m.get('nproc')} CPUs, {m.get('usable_cpus')} usable)"],
        ["memory", f"{m.get('memory_gb')} GB"],
        ["OS / Python", f"{m.get('os')} / Python {m.get('python')}"],
        ["packages", pkgs],
        ["Dynamo", results.get("dynamo_version") or "not run"],
        ["commit", f"{m.get('commit')}{' (with local changes)' if m.get('dirty') else ''}"],
        [
            "load average (1 min) at start / end",
            f"{fmt(results['load_avg_start'][0], 2)} / "
            f"{fmt((results.get('load_avg_end') or [None])[0], 2)}",
        ],
        ["started, duration", f"{results['started']}, {fmt(results.get('elapsed_s'), 0)} s"],
    ]
    return table(["", ""], rows)


def render(
    results: Record,
    images: Sequence[tuple[str, str]] = (),
    *,
    command: str = "make bench ARGS='--docs'",
    runs_page: str | None = None,
) -> str:
    """The results section: machine, targets, tables and (*title*, *path*) images.

    The table of every run is a few hundred lines; with *runs_page* (a relative link)
    the section links to it there (:func:`render_runs_page`) instead of holding it,
    so that the page's prose after the results stays within reach of a reader.
    """
    runs = results["runs"]
    parts = [
        f"_Generated by `headwater bench`{' --quick (smoke counts)' if results['quick'] else ''}"
        f" on {results['started']}. Reproduce: `{command}`._",
        "### Machine",
        machine_table(results),
    ]
    if results.get("skipped"):
        parts += ["**Skipped or failed:**", "\n".join(f"- {s}" for s in results["skipped"])]
    if not results.get("finished"):
        parts.append("**This run did not finish: the tables hold what was measured.**")
    parts += ["### Targets", all_targets_table(results)]
    multi = multi_process_labels(results)
    if multi:
        parts.append(
            f"Verdicts are judged on `{judged_label(results).removeprefix('headwater ')}`, "
            "`headwater serve`'s default (a process per usable core); the other columns "
            "judge the same targets on the one-process frontend and on the frontend in "
            "front of worker processes (Dynamo's layout). A group's RSS is the total over "
            "the supervisor and its processes, its loop p99 over every process's canary "
            "and its loop max the worst process's."
        )
    ps = pairs(runs)
    if ps:
        parts += [
            "### headwater ÷ Dynamo",
            "Ratios of adjacent runs on the same prompts. req/s above 1 and latency "
            "below 1 favour headwater. A run repeated over rounds (`--rounds N`, a "
            "fresh prompt set each) shows medians, and its req/s ratio's range.",
            ratio_table(ps),
        ]
    if runs_page is None:
        parts += ["### Every run", every_run(results)]
    else:
        parts += [
            "### Every run",
            f"Every run's figures (req/s, TTFT, ITL, e2e, CPU, RSS, loop delay), "
            f"round by round: [{runs_page}]({runs_page}).",
        ]
    if any(r["phase"] == "matrix" for r in runs):
        parts += [
            "### Tokenizer backend × tokenize mode (long prompts, unary, c16)",
            matrix_table(runs, results.get("idle_rss_mb", {})),
        ]
    if results.get("calibration"):
        parts += [
            "### The limit: long-prompt tokens/s against the encoder",
            limit_table(results),
            "Ceiling: usable cores × the backend's single-thread rate on the same texts. "
            "Near 100% the frontend is encoder-bound; far below, the limit is elsewhere "
            "(see the stage table). Above 100% the encoder ran faster inside the server "
            "than in the calibration (caches, clock): read it as at the ceiling.",
        ]
    if results.get("profile"):
        parts += [
            "### Frontend CPU per request by stage",
            stage_table(results),
            "\n".join(f"- {line}" for line in profile_overhead(results)),
        ]
    mem = memory_rows(results)
    if mem:
        parts += [
            "### Memory",
            table(["", "RSS MB", "PSS MB", "USS MB"], [list(row) for row in mem]),
            "PSS divides each page among the processes that map it (summed over a group: "
            "the memory it really uses); USS is a process's own pages; RSS counts a shared "
            "page once per process (from `/proc/<pid>/smaps_rollup`).",
        ]
    if procs := process_memory_rows(results):
        parts += [
            "### Memory by process (at rest)",
            table(["frontend", "process", "pid", "RSS MB", "PSS MB", "USS MB"], procs),
        ]
    for title, path in images:
        parts.append(f"![{title}]({path})")
    return "\n\n".join(p for p in parts if p) + "\n"


def every_run(results: Record) -> str:
    """The table of every main-phase run, with the note on groups' sums."""
    text = runs_table([r for r in results["runs"] if r["phase"] != "matrix"])
    if multi_process_labels(results):
        text += (
            "\n\n`×N procs`: FE CPU and peak RSS are summed over the supervisor and "
            "its N processes, all CPU adds the workers."
        )
    return text


def render_runs_page(results: Record, *, command: str, results_page: str) -> str:
    """A page of its own for :func:`every_run` (generated whole, by ``--docs``)."""
    return (
        "\n\n".join(
            [
                "# Benchmark runs",
                f"_Generated by `headwater bench` on {results['started']}, with the results in "
                f"[{results_page}]({results_page}#results). Reproduce: `{command}`; do not edit "
                f"by hand._",
                every_run(results),
            ]
        )
        + "\n"
    )


def update_docs(path: Path, section: str, *, skeleton: str) -> None:
    """Put *section* between the markers in *path* (created from *skeleton* if absent).

    *skeleton* must contain both markers. Raises ValueError if the file has one marker
    without the other.
    """
    text = path.read_text() if path.exists() else skeleton
    if BEGIN not in text and END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path}: expected one {BEGIN} before one {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{BEGIN}\n{section.strip()}\n{END}{tail}")
