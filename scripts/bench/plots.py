"""PNG charts of a suite's results (matplotlib, Agg backend: no display needed).

Each function takes the ``results.json`` dict and an output directory, writes one PNG
and returns its path, or ``None`` when the results hold nothing to draw (a skipped
phase). :func:`plot_all` draws every chart and returns ``(title, path)`` pairs.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

from scripts.bench.report import scaled_stage_ms

Record = Mapping[str, Any]
_DPI = 110
_STAGE_COLORS = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def loop_delay_timeline(results: Record, out_dir: Path) -> Path | None:
    """Per-250 ms loop delay (p99, and the highest bucket reached) for each matrix run."""
    runs = [r for r in results["runs"] if r["phase"] == "matrix" and r.get("timeline")]
    if not runs:
        return None
    fig, (ax_p99, ax_max) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in runs:
        points = [p for p in r["timeline"] if p["loop_samples"]]
        t = [p["t_s"] for p in points]
        backend, mode = r["variant"].split("/", 1)
        style = {
            "ls": {"thread": "-", "thread-gil": "--", "inline": ":"}.get(mode, "-."),
            "color": "C0" if backend == "fastokens" else "C3",
            "marker": {"thread": "o", "thread-gil": "s", "inline": "^"}.get(mode, "x"),
            "ms": 3,
            "label": r["variant"],
        }
        ax_p99.plot(t, [p["loop_p99_ms"] for p in points], **style)
        ax_max.step(t, [_finite(p["loop_max_ms"]) for p in points], where="post", **style)
    for ax in (ax_p99, ax_max):
        ax.set_yscale("log")
        ax.axhline(20, color="grey", lw=0.8, ls="-.")
        ax.grid(True, which="both", alpha=0.3)
    ax_p99.set_ylabel("loop delay p99 per 250 ms (ms)")
    ax_max.set_ylabel("highest bucket reached (ms)")
    ax_max.set_xlabel(
        "seconds into the run (long prompts, unary, c16); a gap between markers: "
        "the server could not even answer /metrics"
    )
    ax_p99.set_title("Event-loop delay by tokenizer backend / mode (grey: 20 ms stall threshold)")
    ax_p99.legend(fontsize=8, ncol=2)
    return _save(fig, out_dir / "loop_delay_by_mode.png")


def _finite(ms: float | None) -> float | None:
    if ms is None:
        return None
    return 10_000.0 if ms == float("inf") else ms  # above the last bucket: drawn at 10 s


def _series(results: Record, field: str) -> dict[tuple[str, str, bool], dict[int, float]]:
    """(scenario, server label, stream) → {concurrency: median of *field*} over main runs."""
    acc: dict[tuple[str, str, bool], dict[int, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in results["runs"]:
        if r["phase"] in ("matrix", "profile") or r.get(field) is None or not r["ok"]:
            continue
        acc[(r["scenario"], r["label"], r["stream"])][r["concurrency"]].append(r[field])
    return {k: {c: statistics.median(v) for c, v in sorted(cs.items())} for k, cs in acc.items()}


def versus_concurrency(
    results: Record,
    out_dir: Path,
    field: str,
    ylabel: str,
    name: str,
    *,
    p99_field: str | None = None,
) -> Path | None:
    """*field* against concurrency, one panel per scenario, one line per server and mode."""
    series = _series(results, field)
    if not series:
        return None
    upper = _series(results, p99_field) if p99_field else {}
    scenarios = sorted({k[0] for k in series}, key=["short", "long", "shared-prefix"].index)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 4), squeeze=False)
    colors: dict[str, str] = {}
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for (sc, label, stream), points in sorted(series.items()):
            if sc != scenario:
                continue
            color = colors.setdefault(label, f"C{len(colors)}")
            xs = list(points)
            ls = "--" if stream else "-"
            mode = "stream" if stream else "unary"
            ax.plot(
                xs, list(points.values()), ls, marker="o", color=color, label=f"{label} ({mode})"
            )
            hi = upper.get((sc, label, stream))
            if hi:
                ax.plot(list(hi), list(hi.values()), ls, marker="^", color=color, alpha=0.35)
        ax.set_title(scenario)
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for (sc, *_), p in series.items() if sc == scenario for c in p}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    return _save(fig, out_dir / name)


def rss_over_time(results: Record, out_dir: Path) -> Path | None:
    """Frontend RSS through the main phase, per server (from the 4 Hz samples); for a
    frontend of several processes, their total."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    t0 = None
    for r in sorted(results["runs"], key=lambda r: r["started_unix"]):
        if r["phase"] in ("matrix", "profile"):
            continue
        t0 = r["started_unix"] if t0 is None else t0
        label = r["label"] + (" (total)" if (r.get("frontend_processes") or 1) > 1 else "")
        for p in r.get("timeline", []):
            if p["rss_mb"] is not None:
                lines[label].append((r["started_unix"] - t0 + p["t_s"], p["rss_mb"]))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for label, pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, label=label)
    ax.axhline(300, color="grey", lw=0.8, ls="-.")
    ax.set_xlabel("seconds since the first measured run (gaps: other server's runs)")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("Frontend RSS during the main phase (grey: 300 MB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_dir / "rss_over_time.png")


def matrix_bars(results: Record, out_dir: Path) -> Path | None:
    """req/s, TTFT p99 and loop max for each backend × mode."""
    runs = [r for r in results["runs"] if r["phase"] == "matrix"]
    if not runs:
        return None
    names = [r["variant"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("req_per_s", "req/s", False),
        ("ttft_p99_ms", "TTFT p99 (ms)", True),
        ("loop_max_ms", "loop max delay (ms)", True),
    )
    for ax, (field, title, log) in zip(axes, panels, strict=True):
        values = [_finite(r.get(field)) or 0.0 for r in runs]
        ax.barh(names, values, color=["C0" if n.endswith("/thread") else "C3" for n in names])
        ax.set_title(title)
        if log:
            ax.set_xscale("log")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.suptitle("Long prompts, unary, c16: tokenizer backend / tokenize mode")
    return _save(fig, out_dir / "matrix.png")


def stage_bars(results: Record, out_dir: Path) -> Path | None:
    """Stacked frontend CPU ms per request by stage, one bar per profiled run."""
    entries = results.get("profile", [])
    if not entries:
        return None
    stages = list(entries[0]["stage_ms_per_req"])
    fig, axes = plt.subplots(1, len(entries), figsize=(6 * len(entries), 2.8), squeeze=False)
    for ax, e in zip(axes[0], entries, strict=True):
        ms = scaled_stage_ms(e, results) or e["stage_ms_per_req"]
        left = 0.0
        for i, stage in enumerate(stages):
            v = ms.get(stage, 0.0)
            ax.barh([0], [v], left=left, color=_STAGE_COLORS[i % len(_STAGE_COLORS)], label=stage)
            left += v
        ax.set_yticks([])
        ax.set_xlabel("frontend CPU ms per request")
        ax.set_title(e["key"])
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out_dir / "stages.png")


def plot_all(results: Record, out_dir: Path) -> list[tuple[str, Path]]:
    """Every chart that has data; ``(title, path)`` in report order."""
    charts: Sequence[tuple[str, Path | None]] = (
        (
            "Throughput against concurrency",
            versus_concurrency(results, out_dir, "req_per_s", "req/s", "throughput.png"),
        ),
        (
            "TTFT against concurrency (circles p50, triangles p99)",
            versus_concurrency(
                results, out_dir, "ttft_p50_ms", "TTFT (ms)", "ttft.png", p99_field="ttft_p99_ms"
            ),
        ),
        ("Event-loop delay over time by tokenize mode", loop_delay_timeline(results, out_dir)),
        ("Backend × mode", matrix_bars(results, out_dir)),
        ("Frontend CPU per request by stage", stage_bars(results, out_dir)),
        ("Frontend RSS over the main phase", rss_over_time(results, out_dir)),
    )
    return [(title, path) for title, path in charts if path is not None]
