"""Start-up time: from starting ``headwater serve`` to its first ``/health`` 200, cold and warm.

    .venv/bin/python scripts/measure/startup.py [--rounds 3] [--processes auto 1]
        [--dynamo-dir DIR] [--json] [-- more serve options]

Each round starts the server, polls ``GET /health`` every 20 ms until it answers 200 (a
request can be served: the tokenizer is loaded and warm, the workers are routable),
records the wall time and the CPU time the server's processes used until then, and
stops it (SIGINT). ``--processes`` lists the layouts measured (default: ``auto``, the
default, and ``1``).

**Cold** here means the first start after ``make venv`` with nothing of it in memory:
before the run, the page cache of every file of the venv and of the checkout is dropped
(``posix_fadvise(DONTNEED)`` on each file: no root needed, and no other file of the
machine is touched), and the checkout's own bytecode is deleted (pip compiled the
installed packages' bytecode; a checkout's is written at its first import). The
interpreter and its standard library stay cached (other programs use them). **Warm**
is the next starts, everything cached.

With ``--dynamo-dir`` (the peer's install, ``scripts/peers/dynamo/install.sh``), Dynamo's
frontend and one mocker are measured the same way (``start_agg.sh``; ready when its
``/v1/models`` lists the model, as the peer scripts judge it), its venv dropped from the
page cache for the cold start. It binds port 8000: the script refuses to run it when
the port is taken.

The machine's load average is printed with the results: on a loaded machine wall times
stretch, the CPU seconds less so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")
POLL_S = 0.02
READY_WITHIN_S = 180.0
DYNAMO_PORT = 8000


def evict(root: Path) -> int:
    """Drop *root*'s files from the page cache (clean pages only); returns how many."""
    n = 0
    for path in root.rglob("*"):
        try:
            if not path.is_file() or path.is_symlink():
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def drop_checkout_bytecode(root: Path) -> None:
    """Delete the checkout's own ``__pycache__`` directories (not the venv's)."""
    for package in ("headwater", "frontend", "workers", "scripts"):
        for cache in (root / package).rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def tree_cpu_s(root: int) -> float:
    """user + system CPU seconds of *root* and its descendants (alive ones)."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # ppid is field 4, utime 14, stime 15 (proc(5)); fields[0] is field 3.
        stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo.extend(child for child, (ppid, _) in stats.items() if ppid == pid)
    return total / TICKS


def http_status(port: int, path: str) -> tuple[int, bytes]:
    """GET on 127.0.0.1:*port*; (0, b"") when nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return 0, b""
    try:
        return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]
    except (IndexError, ValueError):
        return 0, b""


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def headwater_once(processes: str, extra: Sequence[str]) -> dict[str, float]:
    """One start of ``headwater serve --processes PROCESSES``: seconds to the serving line
    and to the first /health 200, and the CPU seconds spent until then."""
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
        processes,
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        assert proc.stdout is not None
        port = None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("headwater: serving"):
                port = int(line.split()[-1].rsplit(":", 1)[1])
                break
        if port is None:
            raise SystemExit(f"headwater exited ({proc.wait()}) before serving: {cmd}")
        listening = time.perf_counter() - t0
        while http_status(port, "/health")[0] != 200:
            if time.perf_counter() - t0 > READY_WITHIN_S:
                raise SystemExit("headwater: /health not 200 in time")
            time.sleep(POLL_S)
        ready = time.perf_counter() - t0
        cpu = tree_cpu_s(proc.pid)
    finally:
        stop(proc)
    return {
        "listening_s": round(listening, 2),
        "healthy_s": round(ready, 2),
        "cpu_s": round(cpu, 2),
    }


def dynamo_once(dynamo_dir: Path) -> dict[str, float]:
    """One start of Dynamo's frontend + one mocker through the peer's start_agg.sh."""
    scripts = REPO / "scripts" / "peers" / "dynamo"
    env = {**os.environ, "DYN_DIR": str(dynamo_dir)}
    t0 = time.perf_counter()
    starter = subprocess.Popen(
        ["bash", str(scripts / "start_agg.sh"), "--speedup-ratio", "1000"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            status, body = http_status(DYNAMO_PORT, "/v1/models")
            if status == 200 and b"deepseek-v4" in body:
                break
            if time.perf_counter() - t0 > READY_WITHIN_S:
                raise SystemExit("Dynamo: the model not listed in time")
            time.sleep(POLL_S)
        ready = time.perf_counter() - t0
        pids = []
        for name in ("frontend.pid", "mocker.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int((dynamo_dir / name).read_text().strip()))
        cpu = sum(tree_cpu_s(pid) for pid in pids)
    finally:
        starter.wait()
        subprocess.run(
            ["bash", str(scripts / "stop.sh")], env=env, check=False, capture_output=True
        )
        deadline = time.monotonic() + 20
        while http_status(DYNAMO_PORT, "/v1/models")[0] and time.monotonic() < deadline:
            time.sleep(0.2)
    return {"healthy_s": round(ready, 2), "cpu_s": round(cpu, 2)}


def summary(runs: list[dict[str, float]]) -> dict[str, object]:
    keys = runs[0].keys()
    return {
        k: {"median": round(statistics.median(r[k] for r in runs), 2), "all": [r[k] for r in runs]}
        for k in keys
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="warm starts per layout")
    p.add_argument(
        "--processes", nargs="+", default=["auto", "1"], help="the --processes values measured"
    )
    p.add_argument("--no-cold", dest="cold", action="store_false", help="warm starts only")
    p.add_argument(
        "--dynamo-dir",
        type=Path,
        default=None,
        help="measure Dynamo too, installed here by the peer's install.sh",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: serve options")
    args = p.parse_args()
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    venv = Path(sys.prefix)
    out: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg_start": os.getloadavg(),
        "nproc": os.cpu_count(),
    }
    for processes in args.processes:
        label = f"headwater --processes {processes}"
        result: dict[str, object] = {}
        if args.cold:
            drop_checkout_bytecode(REPO)
            evicted = evict(venv) + evict(REPO)
            result["cold"] = headwater_once(processes, extra)
            result["cold_evicted_files"] = evicted
        result["warm"] = summary([headwater_once(processes, extra) for _ in range(args.rounds)])
        out[label] = result
        print(f"{label}: {json.dumps(result)}", file=sys.stderr)
    if args.dynamo_dir is not None:
        if http_status(DYNAMO_PORT, "/")[0]:
            raise SystemExit(f"port {DYNAMO_PORT} is taken: Dynamo's scripts need it")
        result = {}
        if args.cold:
            evict(args.dynamo_dir)
            result["cold"] = dynamo_once(args.dynamo_dir)
        result["warm"] = summary([dynamo_once(args.dynamo_dir) for _ in range(args.rounds)])
        out["dynamo (frontend + 1 mocker)"] = result
        print(f"dynamo: {json.dumps(result)}", file=sys.stderr)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
