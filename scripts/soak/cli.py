"""``python -m scripts.soak`` (``make soak``): the command line, the run, the verdict."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import trio

from scripts.soak import mix as mixes
from scripts.soak import report
from scripts.soak.run import Settings, analyse, machine, soak, summary_lines
from scripts.soak.targets import ROOT, TARGETS


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


async def run_all(
    names: Sequence[str], settings: Settings, mix_settings: mixes.MixSettings, out_dir: Path
) -> dict[str, Any]:
    _say(f"building prompts ({', '.join(map(str, mix_settings.long_tokens))} tokens) ...")
    pool = await trio.to_thread.run_sync(mixes.build_prompts, mix_settings)
    results: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "settings": {
            **{k: getattr(settings, k) for k in settings.__dataclass_fields__},
            "warmup_s": settings.warmup,
            "load_s": settings.load,
        },
        "mix": {
            "weights": dict(mix_settings.weights),
            "long_tokens": mix_settings.long_tokens,
            "seed": mix_settings.seed,
        },
        "machine": machine(),
        "targets": [],
    }
    for name in names:
        measured = await soak(name, settings, mixes.Mix(pool, mix_settings), out_dir, _say)
        record = analyse(measured, settings)
        results["targets"].append(record)
        for line in summary_lines(record):
            _say(line)
        (out_dir / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    results["machine"]["load_avg_after"] = machine()["load_avg"]
    results["passed"] = all(t["passed"] for t in results["targets"])
    return results


def _weights(text: str) -> dict[str, float]:
    weights = dict(mixes.DEFAULT_WEIGHTS)
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, _, w = item.partition("=")
        if kind not in weights:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}")
        weights[kind] = float(w)
    return weights


def parser() -> argparse.ArgumentParser:
    d, m = Settings(), mixes.MixSettings()
    p = argparse.ArgumentParser(
        prog="python -m scripts.soak",
        description=(sys.modules["scripts.soak"].__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--targets", default=",".join(TARGETS), help="comma-separated, from serve, launch")
    a(
        "--duration",
        type=float,
        default=d.duration_s,
        help="seconds of load per target, warm-up included",
    )
    a(
        "--warmup",
        type=float,
        default=None,
        help="seconds of warm-up load before the baseline (default: 10%% of --duration, "
        "at least 30)",
    )
    a("--settle", type=float, default=d.settle_s, help="quiet seconds before each idle read")
    a("--interval", type=float, default=d.interval_s, help="seconds between reads")
    a("--idle-reads", type=int, default=d.idle_reads, help="reads compared at each end")
    a("--concurrency", type=int, default=d.concurrency, help="clients sending at once")
    a(
        "--storm-every",
        type=float,
        default=d.storm_every_s,
        help="seconds between disconnect storms, which reset every connection in flight (0: none)",
    )
    a(
        "--deadline",
        type=float,
        default=d.deadline_s,
        help="seconds a request may take before it counts as lost",
    )
    a(
        "--rss-growth",
        type=float,
        default=d.rss_growth,
        help="largest allowed rise of idle RSS after the warm-up (0.05: 5%%)",
    )
    a(
        "--heap",
        type=int,
        default=0,
        metavar="FRAMES",
        help="run every process under tracemalloc with this many frames per traceback, "
        "and record what each process's Python heap gained between the idle points "
        "(/debug/heap; slows every process about 2x: a leak hunt, not a verdict run)",
    )
    a(
        "--engine-args",
        default="",
        help='engine options for the target\'s workers, one string: "--speedup-ratio 10" '
        "(default: none, the engine's defaults, as make serve)",
    )
    a(
        "--weights",
        type=_weights,
        default=dict(mixes.DEFAULT_WEIGHTS),
        help="kind=weight,... over the defaults: "
        + ", ".join(f"{k}={v:g}" for k, v in mixes.DEFAULT_WEIGHTS.items()),
    )
    a(
        "--long-tokens",
        default=",".join(map(str, m.long_tokens)),
        help="sizes of the long prompts, tokens",
    )
    a("--seed", type=int, default=m.seed, help="the mix's and the prompts' seed")
    a(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: bench-results/soak-<timestamp>)",
    )
    a(
        "--render",
        type=Path,
        default=None,
        help="only redraw the figure and tables from this results.json",
    )
    a("--docs", action="store_true", help="also write docs/img/soak.png and docs/data/soak.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 if every target passed, 1 if any check failed, 2 on bad options."""
    args = parser().parse_args(argv)
    if args.render is not None:
        results = orjson.loads(args.render.read_bytes())
        out_dir = args.render.parent
    else:
        names = [n.strip() for n in args.targets.split(",") if n.strip()]
        if not names or set(names) - set(TARGETS):
            print(f"--targets: choose from {', '.join(TARGETS)}", file=sys.stderr)
            return 2
        settings = Settings(
            duration_s=args.duration,
            warmup_s=args.warmup,
            settle_s=args.settle,
            interval_s=args.interval,
            idle_reads=args.idle_reads,
            concurrency=args.concurrency,
            storm_every_s=args.storm_every,
            deadline_s=args.deadline,
            engine_args=tuple(shlex.split(args.engine_args)),
            heap_frames=args.heap,
            rss_growth=args.rss_growth,
        )
        mix_settings = mixes.MixSettings(
            weights=args.weights,
            seed=args.seed,
            long_tokens=tuple(int(x) for x in args.long_tokens.split(",") if x.strip()),
        )
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = args.out or ROOT / "bench-results" / f"soak-{stamp}"
        out_dir.mkdir(parents=True, exist_ok=True)
        results = trio.run(run_all, names, settings, mix_settings, out_dir)
        (out_dir / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(report.process_table(results))
    print()
    print(report.request_table(results))
    print()
    print("RSS floor (MiB) per minute of load:")
    print(report.floor_table(results))
    png = report.plot(results, out_dir / "soak.png")
    _say(f"results: {out_dir / 'results.json'}; plot: {png}")
    if args.docs:
        report.plot(results, ROOT / "docs" / "img" / "soak.png")
        data = ROOT / "docs" / "data" / "soak.json"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_bytes(orjson.dumps(report.slim(results)) + b"\n")
        _say(f"docs: {ROOT / 'docs' / 'img' / 'soak.png'}, {data}")
    for t in results["targets"]:
        for line in summary_lines(t):
            print(line)
    passed = all(t["passed"] for t in results["targets"])
    print("soak: PASS" if passed else "soak: FAIL (see the checks above)")
    return 0 if passed else 1
