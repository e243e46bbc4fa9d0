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
Prints one line per run and a table of medians (req/s, and the server's CPU per
request from /proc). Loopback only; every run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
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


def one_side(
    checkout: Path,
    runs: list[tuple[str, int, bool, int]],
    loadgen_args: list[str],
    serve_args: list[str],
) -> list[dict[str, float]]:
    port = free_port()
    proc = subprocess.Popen(
        serve_command(checkout, port, serve_args),
        cwd=checkout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(port, proc)
        out = []
        for scenario, concurrency, stream, requests in runs:
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
            out.append(
                {
                    "req_per_s": record["req_per_s"],
                    "ok": record["ok"],
                    "cpu_ms_per_req": 1000 * cpu / max(1, record["ok"]),
                    "loop_p99_ms": 1000 * (loop.get("delay_p99_s") or 0.0),
                    "loop_max_ms": 1000 * (loop.get("max_delay_s") or 0.0),
                }
            )
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    args = p.parse_args()
    sides = {"A": args.a.resolve(), "B": args.b.resolve()}
    results: dict[str, list[list[dict[str, float]]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            serve_args = args.a_arg if side == "A" else args.b_arg
            got = one_side(sides[side], args.run, args.loadgen_arg, serve_args)
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
    print(
        "\n| run | A req/s (median) | B req/s (median) | B/A | A CPU ms/req | B CPU ms/req "
        "| A loop p99 ms | B loop p99 ms | A loop max ms | B loop max ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, (scenario, c, stream, _) in enumerate(args.run):
        med = {s: statistics.median(rnd[i]["req_per_s"] for rnd in results[s]) for s in sides}
        cpu = {s: statistics.median(rnd[i]["cpu_ms_per_req"] for rnd in results[s]) for s in sides}
        p99 = {s: statistics.median(rnd[i]["loop_p99_ms"] for rnd in results[s]) for s in sides}
        top = {s: statistics.median(rnd[i]["loop_max_ms"] for rnd in results[s]) for s in sides}
        kind = "stream" if stream else "unary"
        print(
            f"| {scenario} {kind} c{c} | {med['A']:.1f} | {med['B']:.1f} | "
            f"{med['B'] / med['A']:.3f} | {cpu['A']:.2f} | {cpu['B']:.2f} | "
            f"{p99['A']:.1f} | {p99['B']:.1f} | {top['A']:.1f} | {top['B']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
