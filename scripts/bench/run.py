"""Run the benchmark suite: ``make bench`` (``python -m scripts.bench.run``).

Starts every server itself on loopback (headwater on free ports; NVIDIA Dynamo's
frontend + mocker, when its peer scripts are present, on the port they fix), drives
them with the out-of-process aiohttp client and writes, under --out/<timestamp>/:
runs.jsonl (a record per run, as it finishes), results.json, report.md and img/*.png.
--docs also puts the tables and charts into docs/performance.md and docs/img/.

Every run is bounded in requests and time; Ctrl-C stops the servers and keeps what
was measured. It runs from a source checkout: the suite is part of the repository,
not of the installed package.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headwater.cli.options import positive_float
from headwater.machine import usable_cpus
from scripts.bench import suite

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = Path("docs") / "performance.md"
RUNS_PAGE = Path("docs") / "bench-runs.md"  # the table of every run, linked from DOCS_PAGE
DOCS_IMG = Path("docs") / "img"


def _names_from(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated, non-empty list of names from *allowed*."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated)")
        return names

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 0, got {text!r}")
    return value


def default_frontend_processes() -> int:
    """The multi-process variant's size: the CPUs this process may use, if more than one
    (else 0: no variant)."""
    cpus = usable_cpus()
    return cpus if cpus > 1 else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="small counts: a smoke run of the whole suite in about two minutes",
    )
    p.add_argument(
        "--scenarios",
        type=_names_from(suite.SCENARIOS),
        default=suite.SCENARIOS,
        help="comma-separated: short, long, shared-prefix",
    )
    p.add_argument(
        "--compare-dynamo",
        dest="dynamo",
        action="store_true",
        default=True,
        help="also run NVIDIA Dynamo's frontend + mocker and report ratios",
    )
    p.add_argument(
        "--no-dynamo",
        dest="dynamo",
        action="store_false",
        help="headwater only",
        default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--dynamo-tokenizers",
        type=_names_from(suite.DYNAMO_TOKENIZERS),
        default=suite.DYNAMO_TOKENIZERS,
        metavar="NAMES",
        help="comma-separated: which of Dynamo's tokenizers to run beside "
        "(default, fastokens; default: both). The targets are judged "
        "against fastokens; its default tokenizer is ~10× slower on long "
        "prompts, so longer runs (--requests-scale) are quicker without it",
    )
    p.add_argument(
        "--matrix",
        dest="matrix",
        action="store_true",
        default=True,
        help="tokenizer backend × tokenize mode on long prompts",
    )
    p.add_argument(
        "--no-matrix",
        dest="matrix",
        action="store_false",
        help="skip the matrix",
        default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--profile",
        dest="profile",
        action="store_true",
        default=True,
        help="CPU per request by stage, from a pyinstrument profile",
    )
    p.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip the profile",
        default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="results go to OUT/<timestamp>/"
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="write the tables into docs/performance.md and charts into docs/img/",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="measure nothing: render report (and --docs) from an earlier results.json",
    )
    p.add_argument(
        "--dynamo-dir",
        type=Path,
        default=REPO_ROOT / "scripts" / "peers" / "dynamo",
        help="the Dynamo peer scripts (install.sh, start_disagg.sh, stop.sh)",
    )
    p.add_argument(
        "--dynamo-install-dir",
        type=Path,
        default=None,
        help="where Dynamo is (or gets) installed; default $DYN_DIR or "
        "${TMPDIR:-/tmp}/dynamo-peer, never inside the repository",
    )
    p.add_argument(
        "--topology",
        choices=["inprocess", "processes", "both"],
        default=None,
        help="headwater's mocker workers in the main phase: inside the frontend "
        "process (`headwater serve`'s default), as two worker processes "
        "(Dynamo's layout), or both side by side (default: both; "
        "inprocess with --quick)",
    )
    p.add_argument(
        "--frontend-processes",
        type=_count,
        default=None,
        metavar="N",
        help="also run headwater as N frontend processes on one port "
        "(`headwater serve --processes N`, in-process workers) in the main "
        "phase; 0 or 1: not (default: the usable CPUs, when more than one)",
    )
    p.add_argument(
        "--speedup-ratio",
        type=positive_float,
        default=1000.0,
        help="the mocker timing model is divided by this (both servers)",
    )
    p.add_argument(
        "--requests-scale",
        type=positive_float,
        default=1.0,
        help="multiply every run's request count",
    )
    p.add_argument(
        "--rounds",
        type=_count,
        default=1,
        metavar="N",
        help="repeat each main-phase run N times (fresh prompts, still "
        "alternating with Dynamo); ratios and verdicts use the medians. "
        "Runs on a shared machine swing by tens of percent",
    )
    p.add_argument(
        "--time-limit",
        type=positive_float,
        default=None,
        help="seconds per run (default 60 with --quick, else 180)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `headwater serve` options for every headwater server",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long for the 1-minute load average to drop "
        "below --quiet-load (other work skews the figures)",
    )
    p.add_argument("--quiet-load", type=float, default=1.0)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def wait_for_quiet(limit_s: float, threshold: float) -> float:
    """Sleep until the 1-minute load average is below *threshold* or *limit_s* passed.

    Returns the last load average seen. (A blocking wait before any event loop runs.)
    """
    deadline = time.monotonic() + limit_s
    load = os.getloadavg()[0]
    while load >= threshold and time.monotonic() < deadline:
        print(
            f"load average {load:.2f} ≥ {threshold}: waiting for a quiet machine...",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    return load


def cli(argv: list[str] | None = None) -> int:
    """``python -m scripts.bench.run [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench.run",
        description=(__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


def main(args: argparse.Namespace) -> int:
    import orjson

    if args.render is not None:
        results = orjson.loads(args.render.read_bytes())
        run_dir = args.render.parent
    else:
        if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet, args.quiet_load)
        stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
        run_dir = args.out / stamp
        cfg = _config(args, run_dir)
        results = _measure(cfg)
        if results is None:
            print(f"interrupted; what was measured is in {run_dir}/runs.jsonl", file=sys.stderr)
            return 130
    _publish(results, run_dir, docs=args.docs, command=_command(args))
    return 0


def _config(args: argparse.Namespace, run_dir: Path) -> suite.SuiteConfig:
    from scripts.bench.servers import default_dynamo_install_dir

    install = args.dynamo_install_dir or default_dynamo_install_dir()
    if install.resolve().is_relative_to(REPO_ROOT):
        raise SystemExit(
            f"--dynamo-install-dir {install} is inside the repository; use a scratch directory"
        )
    return suite.SuiteConfig(
        out_dir=run_dir,
        repo_root=REPO_ROOT,
        scenarios=args.scenarios,
        quick=args.quick,
        dynamo=args.dynamo,
        dynamo_tokenizers=args.dynamo_tokenizers,
        matrix=args.matrix,
        profile=args.profile,
        dynamo_scripts=args.dynamo_dir.resolve(),
        dynamo_install=install,
        speedup_ratio=args.speedup_ratio,
        server_args=tuple(shlex.split(args.server_args)),
        topologies=_topologies(args),
        frontend_processes=_frontend_processes(args),
        requests_scale=args.requests_scale,
        rounds=max(1, args.rounds),
        time_limit_s=args.time_limit,
        progress=args.progress,
    )


def _topologies(args: argparse.Namespace) -> tuple[str, ...]:
    choice = args.topology or ("inprocess" if args.quick else "both")
    return ("inprocess", "processes") if choice == "both" else (choice,)


def _frontend_processes(args: argparse.Namespace) -> int:
    n = args.frontend_processes
    return default_frontend_processes() if n is None else n


def _measure(cfg: suite.SuiteConfig) -> dict[str, Any] | None:
    """Run the suite; ``None`` if SIGINT or SIGTERM stopped it (servers stopped first)."""
    import signal

    import trio

    print(f"make bench: results in {cfg.out_dir}", file=sys.stderr, flush=True)
    outcome: dict[str, Any] = {}

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            # A signal cancels the suite: every server's context manager stops it on the
            # way out. (Background jobs of a non-interactive shell ignore SIGINT, hence
            # SIGTERM too.)
            async def watch() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        print(
                            f"\n{signal.Signals(signum).name}: stopping the servers...",
                            file=sys.stderr,
                            flush=True,
                        )
                        outcome["interrupted"] = True
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            outcome["results"] = await suite.Suite(cfg).run()
            nursery.cancel_scope.cancel()

    trio.run(run)
    if outcome.get("interrupted") or "results" not in outcome:
        return None
    return dict(outcome["results"].to_json())


def _command(args: argparse.Namespace) -> str:
    flags = [f"--scenarios {','.join(args.scenarios)}"] if len(args.scenarios) < 3 else []
    flags += [f"--topology {args.topology}"] if args.topology else []
    n = args.frontend_processes
    flags += [f"--frontend-processes {n}"] if n is not None else []
    flags += [f"--rounds {args.rounds}"] if args.rounds > 1 else []
    if args.requests_scale != 1.0:
        flags += [f"--requests-scale {args.requests_scale:g}"]
    if args.dynamo and tuple(args.dynamo_tokenizers) != suite.DYNAMO_TOKENIZERS:
        flags += [f"--dynamo-tokenizers {','.join(args.dynamo_tokenizers)}"]
    flags += [
        f
        for f, on in (
            ("--quick", args.quick),
            ("--no-dynamo", not args.dynamo),
            ("--no-matrix", not args.matrix),
            ("--no-profile", not args.profile),
            ("--docs", True),
        )
        if on
    ]
    return f"make bench ARGS='{' '.join(flags)}'"


def _publish(results: dict[str, Any], run_dir: Path, *, docs: bool, command: str) -> None:
    from scripts.bench import plots, report

    images = plots.plot_all(results, run_dir / "img")
    local = [(title, f"img/{path.name}") for title, path in images]
    (run_dir / "report.md").write_text(
        "# headwater bench\n\n" + report.render(results, local, command=command)
    )
    print(report.all_targets_table(results))
    print(f"\nreport: {run_dir / 'report.md'}", file=sys.stderr)
    if not docs:
        return
    if results.get("quick"):
        print("note: writing --quick figures into the docs", file=sys.stderr)
    img_dir = REPO_ROOT / DOCS_IMG
    img_dir.mkdir(parents=True, exist_ok=True)
    for _, path in images:
        shutil.copy2(path, img_dir / path.name)
    section = report.render(
        results,
        [(t, f"img/{p.name}") for t, p in images],
        command=command,
        runs_page=RUNS_PAGE.name,
    )
    page = REPO_ROOT / DOCS_PAGE
    report.update_docs(page, section, skeleton=_SKELETON)
    (REPO_ROOT / RUNS_PAGE).write_text(
        report.render_runs_page(results, command=command, results_page=DOCS_PAGE.name)
    )
    print(f"docs: {page}, {REPO_ROOT / RUNS_PAGE} and {img_dir}/", file=sys.stderr)


_SKELETON = """# Performance

How fast headwater's frontend is on this kind of machine, how it compares with NVIDIA
Dynamo's, and how to reproduce the figures: `make bench ARGS='--docs'`.

## Results

<!-- bench:begin -->
<!-- bench:end -->
"""


if __name__ == "__main__":
    sys.exit(cli())
