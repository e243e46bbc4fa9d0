"""A/B of two checkouts of headwater on the same load, alternated, medians over rounds.

    python scripts/ab_checkouts.py --a /path/to/old-checkout --b . --rounds 3 \\
        --run "long 16 unary 320" --run "short 16 stream 2000"

``--loadgen-arg`` passes a flag to every load run (``--loadgen-arg=--agentic``: tools and
thinking in every request); ``--a-arg`` / ``--b-arg`` pass one to that side's server, so
one checkout can be measured against itself with an option off and on.

Each round starts A's server, runs every ``--run`` against it with the repository's
load client (``scripts.bench.loadgen``, out of process), stops it, then does the same
for B, then the next round starts with the other side first (ABBA), so that a drift of
the machine over the session falls on both. Servers are ``headwater serve`` on a free
loopback port with the in-process mocker at ``--speedup-ratio 1000`` (the frontend
alone), started from their checkout directory so that each imports its own code.
Prints one line per run and a table of medians with their ranges (req/s, and the
server's CPU per request from /proc), and the medians of the rounds' B/A ratios (a round's
two sides ran next to each other in time). ``--interleave`` keeps both servers up and
alternates single runs instead, each side warmed up first: on a machine shared with
other work the two sides of a pair then meet about the same neighbours (the loop's max
is then since the server started). ``--together`` also runs each pair's two loads at
the same moment. Loopback only; every run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from headwater.ports import free_port

SERVE_ARGS = ("--speedup-ratio", "1000", "--log-level", "warning")


def serve_command(checkout: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    """How *checkout* starts its frontend (older ones had ``python -m frontend``)."""
    entry = ["-m", "headwater", "serve"]
    if not (checkout / "headwater" / "__main__.py").exists():
        entry = ["-m", "frontend"]
    if takes_processes(checkout):
        entry.append("--processes=1")  # one process: its CPU is one pid's (auto since)
    return [sys.executable, *entry, "--port", str(port), *SERVE_ARGS, *extra]


def takes_processes(checkout: Path) -> bool:
    """Whether *checkout*'s ``serve`` has ``--processes``: once a literal of its own,
    now generated from the config's field. Without ``--processes=1`` it serves a group,
    whose CPU the first pid's /proc does not count."""
    marks = {
        checkout / "headwater" / "cli" / "serve.py": '"--processes"',
        checkout / "frontend" / "config.py": "processes: int = option(",
    }
    return any(path.exists() and mark in path.read_text() for path, mark in marks.items())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(port: int, proc: subprocess.Popen[bytes], within: float = 90.0) -> None:
    import httpx

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server not healthy in time")


@contextlib.contextmanager
def serving(checkout: Path, serve_args: list[str]) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """*checkout*'s server on a free port, healthy, for the block; stopped after it."""
    port = free_port()
    proc = subprocess.Popen(
        serve_command(checkout, port, serve_args),
        cwd=checkout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(port, proc)
        yield port, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def load(
    port: int,
    proc: subprocess.Popen[bytes],
    run: tuple[str, int, bool, int],
    loadgen_args: list[str],
) -> dict[str, float]:
    """One load run against the server on *port*: its req/s, the server's CPU per
    request, and the loop's delays."""
    scenario, concurrency, stream, requests = run
    argv = [
        sys.executable,
        "-m",
        "scripts.bench.loadgen",
        "--url",
        f"http://127.0.0.1:{port}",
        "--scenario",
        scenario,
        "--concurrency",
        str(concurrency),
        "--requests",
        str(requests),
        "--time-limit",
        "120",
        "--no-progress",
        "--metrics-url",
        f"http://127.0.0.1:{port}/metrics",
        *loadgen_args,
    ]
    if stream:
        argv.append("--stream")
    before = cpu_seconds(proc.pid)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    cpu = cpu_seconds(proc.pid) - before
    record = json.loads(done.stdout.splitlines()[0])
    loop = record.get("loop") or {}
    return {
        "req_per_s": record["req_per_s"],
        "ok": record["ok"],
        "cpu_ms_per_req": 1000 * cpu / max(1, record["ok"]),
        "loop_p99_ms": 1000 * (loop.get("delay_p99_s") or 0.0),
        "loop_max_ms": 1000 * (loop.get("max_delay_s") or 0.0),
    }


def one_side(
    checkout: Path,
    runs: list[tuple[str, int, bool, int]],
    loadgen_args: list[str],
    serve_args: list[str],
) -> list[dict[str, float]]:
    with serving(checkout, serve_args) as (port, proc):
        return [load(port, proc, run, loadgen_args) for run in runs]


def parse_run(text: str) -> tuple[str, int, bool, int]:
    scenario, concurrency, kind, requests = text.split()
    return scenario, int(concurrency), kind == "stream", int(requests)


def main() -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="checkout B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--run",
        action="append",
        type=parse_run,
        required=True,
        metavar="'SCENARIO CONCURRENCY unary|stream REQUESTS'",
    )
    p.add_argument(
        "--loadgen-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to every load run, e.g. --loadgen-arg=--agentic",
    )
    p.add_argument(
        "--a-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to A's server (A and B may then be one checkout)",
    )
    p.add_argument(
        "--b-arg", action="append", default=[], metavar="ARG", help="passed to B's server"
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep both servers up and alternate single runs (after a warm-up run each), "
        "rather than a server start per side and round: on a busy machine, each pair of "
        "runs then meets the same neighbours",
    )
    p.add_argument(
        "--together",
        action="store_true",
        help="with --interleave: each round runs A's and B's loads at the same time, run "
        "by run, so that both meet the same neighbours at the same moment (and each "
        "other: compare CPU per request, not req/s)",
    )
    args = p.parse_args()
    sides = {"A": args.a.resolve(), "B": args.b.resolve()}
    results: dict[str, list[list[dict[str, float]]]] = {"A": [], "B": []}

    def report(r: int, side: str, got: list[dict[str, float]]) -> None:
        results[side].append(got)
        for (scenario, c, stream, _), rec in zip(args.run, got, strict=True):
            kind = "stream" if stream else "unary"
            print(
                f"round {r + 1} {side} {scenario} {kind} c{c}: {rec['req_per_s']:.1f} "
                f"req/s, {rec['cpu_ms_per_req']:.2f} ms CPU/req, loop p99 "
                f"{rec['loop_p99_ms']:.1f} ms, max {rec['loop_max_ms']:.1f} ms, "
                f"ok {rec['ok']:.0f}",
                flush=True,
            )

    def order(r: int) -> tuple[str, str]:
        return ("A", "B") if r % 2 == 0 else ("B", "A")

    if args.interleave:
        with (
            serving(sides["A"], args.a_arg) as a,
            serving(sides["B"], args.b_arg) as b,
        ):
            servers = {"A": a, "B": b}
            for side in ("A", "B"):  # warm-up: first requests, the allocator's arenas
                for run in args.run:
                    load(*servers[side], (*run[:3], min(run[3], 300)), args.loadgen_arg)
            for r in range(args.rounds):
                if args.together:
                    got: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
                    for run in args.run:  # A's and B's loads of one run at the same time
                        with concurrent.futures.ThreadPoolExecutor(2) as pool:
                            futures = {
                                side: pool.submit(load, *servers[side], run, args.loadgen_arg)
                                for side in ("A", "B")
                            }
                        for side, future in futures.items():
                            got[side].append(future.result())
                    for side in ("A", "B"):
                        report(r, side, got[side])
                    continue
                for side in order(r):
                    report(
                        r, side, [load(*servers[side], run, args.loadgen_arg) for run in args.run]
                    )
    else:
        for r in range(args.rounds):
            for side in order(r):
                serve_args = args.a_arg if side == "A" else args.b_arg
                report(r, side, one_side(sides[side], args.run, args.loadgen_arg, serve_args))
    print(
        "\n| run | A req/s | B req/s | B/A (paired) | A CPU ms/req | B CPU ms/req | B/A CPU "
        "(paired) | A loop p99 ms | B loop p99 ms | A loop max ms | B loop max ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (scenario, c, stream, _) in enumerate(args.run):

        def spread(key: str, side: str, i: int = i) -> str:
            values = [rnd[i][key] for rnd in results[side]]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        def paired(key: str, i: int = i) -> str:
            ratios = [
                b[i][key] / a[i][key] for a, b in zip(results["A"], results["B"], strict=True)
            ]
            return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"

        p99 = {s: statistics.median(rnd[i]["loop_p99_ms"] for rnd in results[s]) for s in sides}
        top = {s: statistics.median(rnd[i]["loop_max_ms"] for rnd in results[s]) for s in sides}
        kind = "stream" if stream else "unary"
        print(
            f"| {scenario} {kind} c{c} | {spread('req_per_s', 'A')} | "
            f"{spread('req_per_s', 'B')} | {paired('req_per_s')} | "
            f"{spread('cpu_ms_per_req', 'A')} | {spread('cpu_ms_per_req', 'B')} | "
            f"{paired('cpu_ms_per_req')} | {p99['A']:.1f} | {p99['B']:.1f} | "
            f"{top['A']:.1f} | {top['B']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
