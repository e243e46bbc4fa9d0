"""Steady speed: the same server, several consecutive runs, each with a probe beside it.

Issue 21 saw one server serve three consecutive runs of 320 distinct ~39k-token
completions at c16 at 61, 69 and 161 req/s, while a client's probe of ``/v1/models``
took 63, 44 and 13 ms at p99: a slow mode that came and went. This script repeats that
shape against one running server and prints, per run, the rate, the server's CPU per
request (every process of the group, from ``/proc``), the probe's percentiles and the
group's RSS at the end, so a slow run shows whether it was the server (more CPU per
request: more work, or a cache filling) or the machine (the same CPU per request, less
CPU to go round).

    .venv/bin/python -m scripts.measure.steady --url http://127.0.0.1:8000 --pid PID \\
        [--pid PID ...] [--runs 3] [--requests 320] [--concurrency 16]

Start the server yourself (``headwater serve``, any layout) and pass every process's
pid (a group's supervisor, zygote and members: ``pgrep -f "headwater serve"``).
Loopback only; every run is bounded by ``--time-limit``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

PROBE_INTERVAL_S = 0.1


def cpu_s(pids: list[int]) -> tuple[float, float, int]:
    """User and system CPU seconds of *pids* so far, and their minor page faults (gone
    ones count 0): a run that grows the heap pays for it in faults and system time."""
    user = system = 0.0
    faults = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        faults += int(fields[7])
        user += int(fields[11]) / 100.0
        system += int(fields[12]) / 100.0
    return user, system, faults


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            continue
    return total / 1024


async def probe(http: httpx.AsyncClient, url: str, stop: trio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await http.get(f"{url}/v1/models")
        out.append((time.perf_counter() - t) * 1e3)
        await trio.sleep(PROBE_INTERVAL_S)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_run(args: argparse.Namespace, n: int) -> dict[str, float]:
    loadgen = [
        sys.executable,
        "-m",
        "scripts.bench",
        "--url",
        args.url,
        "--endpoint",
        args.endpoint,
        "--scenario",
        args.scenario,
        "--concurrency",
        str(args.concurrency),
        "--requests",
        str(args.requests),
        "--time-limit",
        str(args.time_limit),
        "--no-progress",
    ]
    latencies: list[float] = []
    stop = trio.Event()
    async with httpx.AsyncClient(timeout=10.0) as http:
        cpu0 = cpu_s(args.pid)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, http, args.url, stop, latencies)
            done = await trio.run_process(loadgen, capture_stdout=True, capture_stderr=True)
            stop.set()
        cpu1 = cpu_s(args.pid)
    record = json.loads(done.stdout.decode().splitlines()[0])
    ok = max(1, record["ok"])
    user, system, faults = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    return {
        "run": n,
        "ok": record["ok"],
        "req_per_s": record["req_per_s"],
        "cpu_ms_per_req": round((user + system) * 1e3 / ok, 2),
        "sys_ms_per_req": round(system * 1e3 / ok, 2),
        "minor_faults_per_req": round(faults / ok),
        "probe_p50_ms": round(pct(latencies, 0.5), 1),
        "probe_p99_ms": round(pct(latencies, 0.99), 1),
        "probe_max_ms": round(max(latencies, default=float("nan")), 1),
        "rss_mb": round(rss_mb(args.pid)),
    }


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    for n in range(1, args.runs + 1):
        row = await one_run(args, n)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rates = [r["req_per_s"] for r in rows]
    print(
        f"req/s {', '.join(f'{r:.0f}' for r in rates)} (slowest/fastest "
        f"{min(rates) / max(rates):.2f}); CPU ms/req "
        f"{', '.join(str(r['cpu_ms_per_req']) for r in rows)}; probe p99 ms "
        f"{', '.join(str(r['probe_p99_ms']) for r in rows)}; median req/s "
        f"{statistics.median(rates):.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, action="append", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--scenario", default="long")
    p.add_argument("--endpoint", default="completions")
    p.add_argument("--time-limit", type=float, default=180.0)
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        p.error("loopback only")
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
