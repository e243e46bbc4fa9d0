"""What an idle frontend costs the machine: CPU per second with no request in flight.

Starts ``headwater serve`` (``python -m headwater serve --port 0`` plus any arguments after
``--``) on loopback, waits ``--settle`` seconds for start-up and the monitor's rest to
begin, then reads ``utime + stime`` of the process and every descendant (the members of
``--processes N``, worker processes) from ``/proc`` over ``--window`` seconds. Prints a
JSON record per round and the median, as a percentage of one core. Linux only.

Usage: ``.venv/bin/python scripts/measure/idle_cpu.py [--rounds R] [-- serve args...]``
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
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime in ticks) of *pid*, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces
    return int(fields[1]), int(fields[11]) + int(fields[12])


def tree_ticks(root: int) -> int:
    """CPU ticks of *root* and all its living descendants."""
    stats = {pid: s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(pid := int(p)))}
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo.extend(child for child, (ppid, _) in stats.items() if ppid == pid)
    return total


def one_round(serve_args: list[str], settle_s: float, window_s: float) -> dict[str, object]:
    # One process unless asked (`-- --processes 2`: a later flag wins).
    cmd = [
        sys.executable,
        "-m",
        "headwater",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
        "--processes",
        "1",
        *serve_args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle_s)
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        before, t0 = tree_ticks(proc.pid), time.monotonic()
        time.sleep(window_s)
        after, t1 = tree_ticks(proc.pid), time.monotonic()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    pct = 100 * (after - before) / TICKS / (t1 - t0)
    return {"args": serve_args, "cpu_pct_of_a_core": round(pct, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=10.0, help="seconds after start (default 10)")
    p.add_argument("--window", type=float, default=10.0, help="seconds measured (default 10)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: headwater serve args")
    args = p.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    results = []
    for _ in range(args.rounds):
        record = one_round(serve_args, args.settle, args.window)
        print(json.dumps(record), flush=True)
        results.append(record["cpu_pct_of_a_core"])
    print(json.dumps({"args": serve_args, "median_cpu_pct_of_a_core": statistics.median(results)}))


if __name__ == "__main__":
    main()
