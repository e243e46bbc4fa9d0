"""The soak's figure and tables, from a results JSON (no I/O but the PNG written)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Phase backgrounds: the load white, the warm-up tinted, the quiet phases grey.
PHASE_COLORS: Mapping[str, str] = {
    "warmup": "#fff3d6",
    "settle_start": "#eeeeee",
    "idle_start": "#d5dbe8",
    "settle_end": "#eeeeee",
    "idle_end": "#d5dbe8",
    "stop": "#f4f4f4",
}
OUTCOME_COLORS: Mapping[str, str] = {
    "ok": "#4c72b0",
    "rejected": "#8172b3",
    "cancelled": "#55a868",
    "disconnected": "#937860",
    "error": "#e5ae38",
    "lost": "#c44e52",
    "wrong": "#000000",
}
PROCESS_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def plot(results: Mapping[str, Any], path: Path) -> Path:
    """Per target (a column): RSS, trio tasks and open descriptors of every process over
    time, and the requests that ended per 10 s by outcome; phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = results["targets"]
    fig, axes = plt.subplots(
        4,
        len(targets),
        figsize=(7.0 * len(targets), 11.5),
        squeeze=False,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 2, 2, 1.6]},
    )
    for col, t in enumerate(targets):
        ax_rss, ax_tasks, ax_fds, ax_req = (axes[row][col] for row in range(4))
        for ax in (ax_rss, ax_tasks, ax_fds, ax_req):
            for ph in t["phases"]:
                color = PHASE_COLORS.get(ph["name"])
                if color:
                    ax.axvspan(ph["start_s"], ph["end_s"], color=color, lw=0, zorder=0)
            ax.grid(True, alpha=0.3)
        for i, p in enumerate(t["processes"]):
            own = [s for s in t["samples"] if s["process"] == p["name"]]
            color = PROCESS_COLORS[i % len(PROCESS_COLORS)]
            growth = p["rss_growth"]
            label = p["name"] + ("" if growth is None else f" ({growth:+.1%} idle)")
            if not p["judged"]:
                label += ", not judged"
            rss = [(s["t_s"], s["rss_bytes"] / 2**20) for s in own if s["rss_bytes"]]
            ax_rss.plot(*zip(*rss, strict=True), "-", lw=1.3, color=color, label=label)
            tasks = [(s["t_s"], s["tasks"]) for s in own if s["tasks"] is not None]
            if tasks:
                ax_tasks.plot(*zip(*tasks, strict=True), "-", lw=1.2, color=color, label=p["name"])
            fds = [(s["t_s"], s["fds"]) for s in own if s["fds"] is not None]
            if fds:
                ax_fds.plot(*zip(*fds, strict=True), "-", lw=1.2, color=color, label=p["name"])
        bins = t["requests"]["timeline"]
        bottom = [0.0] * len(bins)
        xs = [b["t_s"] for b in bins]
        for outcome, color in OUTCOME_COLORS.items():
            n = [float(b.get(outcome, 0)) for b in bins]
            if any(n):
                ax_req.bar(
                    xs, n, width=10.0, align="edge", bottom=bottom, color=color, label=outcome, lw=0
                )
                bottom = [a + b for a, b in zip(bottom, n, strict=True)]
        verdict = "PASS" if t["passed"] else "FAIL"
        req = t["requests"]
        ax_rss.set_title(
            f"{t['target']}: {verdict}, {req['total']:,} requests, "
            f"{req['by_outcome'].get('lost', 0)} lost",
            fontsize=11,
        )
        ax_rss.set_ylabel("RSS (MiB)")
        ax_rss.set_ylim(bottom=0)
        ax_rss.legend(fontsize=7, loc="lower right")
        ax_tasks.set_ylabel("live trio tasks")
        ax_tasks.set_ylim(bottom=0)
        ax_tasks.legend(fontsize=7, loc="upper right")
        ax_fds.set_ylabel("open file descriptors")
        ax_fds.set_ylim(bottom=0)
        ax_fds.legend(fontsize=7, loc="upper right")
        ax_req.set_ylabel("requests ended / 10 s")
        ax_req.legend(fontsize=7, loc="upper right", ncol=4)
        ax_req.set_xlabel(
            "seconds since the target was up (shaded: warm-up; grey: idle, "
            "darker: the reads compared)"
        )
    s = results["settings"]
    fig.suptitle(
        f"Soak: {s['duration_s']:g} s of mixed load per target at concurrency "
        f"{s['concurrency']}, disconnect storm every {s['storm_every_s']:g} s "
        f"({results['started']}, {results['machine']['cpus']} CPUs, shared)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _span(v: list[int] | None) -> str:
    if v is None:
        return "-"
    return str(v[0]) if v[0] == v[1] else f"{v[0]}–{v[1]}"


def process_table(results: Mapping[str, Any]) -> str:
    """Per process: idle RSS / PSS / USS at start and end, peak, fds, tasks, threads."""
    lines = [
        "| target | process | RSS idle start → end (MiB) | growth | peak RSS | PSS start → end"
        " | USS start → end | fds start → end | trio tasks start → end | threads start → end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results["targets"]:
        for p in t["processes"]:
            a, b = p["idle_start"], p["idle_end"]
            growth = "-" if p["rss_growth"] is None else f"{p['rss_growth']:+.1%}"
            name = p["name"] + ("" if p["judged"] else " (not judged)")
            lines.append(
                f"| {t['target']} | {name} | {_mib(a['rss_bytes'])} → {_mib(b['rss_bytes'])} "
                f"| {growth} | {_mib(p['peak_rss_bytes'])} | {_mib(a['pss_bytes'])} → "
                f"{_mib(b['pss_bytes'])} | {_mib(a['uss_bytes'])} → {_mib(b['uss_bytes'])} | "
                f"{_span(a['fds'])} → {_span(b['fds'])} | {_span(a['tasks'])} → "
                f"{_span(b['tasks'])} | {_span(a['threads'])} → {_span(b['threads'])} |"
            )
    return "\n".join(lines)


OUTCOMES = ("ok", "rejected", "error", "cancelled", "disconnected", "lost", "wrong")


def request_table(results: Mapping[str, Any]) -> str:
    """Requests by kind and outcome, per target."""
    lines = [
        "| target | kind | " + " | ".join(OUTCOMES) + " |",
        "|---|---|" + "---|" * len(OUTCOMES),
    ]
    for t in results["targets"]:
        rows = {**t["requests"]["by_kind"], "all": t["requests"]["by_outcome"]}
        for kind, counts in rows.items():
            cells = " | ".join(f"{counts.get(o, 0):,}" for o in OUTCOMES)
            label = f"**{kind}**" if kind == "all" else kind
            lines.append(f"| {t['target']} | {label} | {cells} |")
    return "\n".join(lines)


def rss_floors(
    samples: Sequence[Mapping[str, Any]], start_s: float, end_s: float, window_s: float = 60.0
) -> list[int | None]:
    """The lowest RSS read in each *window_s* window of ``[start_s, end_s)``: under load RSS
    swings with what is in flight at the instant of the read, its floor does not; a floor
    that keeps rising window after window is memory kept, a flat one is a working size
    reached (reported beside the verdict, not judged). A last window shorter than half
    of *window_s* (the load's run-out) is folded into the one before. None: no read in
    that window."""
    n = max(1, int((end_s - start_s) / window_s + 0.5))
    floors: list[int | None] = [None] * n
    for s in samples:
        t, rss = s["t_s"], s.get("rss_bytes")
        if rss is None or not start_s <= t < end_s:
            continue
        i = min(n - 1, int((t - start_s) // window_s))
        low = floors[i]
        floors[i] = rss if low is None else min(low, rss)
    return floors


def floor_table(results: Mapping[str, Any], window_s: float = 60.0) -> str:
    """Per judged process: idle RSS at the start, the RSS floor of each minute of the
    load, idle RSS at the end (MiB)."""
    rows, width = [], 0
    for t in results["targets"]:
        load = next((p for p in t["phases"] if p["name"] == "load"), None)
        if load is None:
            continue
        for p in t["processes"]:
            if not p["judged"]:
                continue
            own = [s for s in t["samples"] if s["process"] == p["name"]]
            floors = rss_floors(own, load["start_s"], load["end_s"], window_s)
            width = max(width, len(floors))
            rows.append(
                (
                    t["target"],
                    p["name"],
                    p["idle_start"]["rss_bytes"],
                    floors,
                    p["idle_end"]["rss_bytes"],
                )
            )
    minutes = " | ".join(f"{i + 1}" for i in range(width))
    lines = [
        f"| target | process | idle start | {minutes} | idle end |",
        "|---|---|---|" + "---|" * width + "---|",
    ]
    for target, name, start, floors, end in rows:
        cells = " | ".join(_mib(f) for f in [*floors, *[None] * (width - len(floors))])
        lines.append(f"| {target} | {name} | {_mib(start)} | {cells} | {_mib(end)} |")
    return "\n".join(lines)


def slim(results: Mapping[str, Any]) -> dict[str, Any]:
    """The results for docs/data: samples without task names, no per-log first lines."""
    out = dict(results)
    out["targets"] = [
        {
            **t,
            "samples": [{k: v for k, v in s.items() if k != "tasks_by_name"} for s in t["samples"]],
        }
        for t in results["targets"]
    ]
    return out
