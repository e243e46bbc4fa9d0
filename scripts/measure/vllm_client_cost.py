"""What vLLM's engine client costs inside a headwater worker, by thread and by package.

The question it answers (docs/performance-vllm.md, "vLLM's own client, or one written
for trio"): a worker running vLLM in-process (``--vllm-client in-process``) hosts vLLM's
``AsyncLLM`` on an asyncio loop in a thread of its own, beside trio's loop. A client of
vLLM's engine core written for trio would replace that thread's work with the same
ZMQ sockets and msgpack codec waited on by trio; what it could save at most is the
asyncio thread's CPU less the socket and codec work any client does, plus what the
hop between the two loops costs trio's side.

So: ``headwater serve --engine vllm --vllm-client in-process`` on the tiny model, a
warm-up, then ``--requests`` streaming completions of ``--tokens``-token prompts at
``--concurrency``, while

- each thread's CPU time is read from ``/proc`` before and after (exact): trio's loop
  (the main thread), trio's pool (the tokenizer), the rest (the asyncio thread among
  them);
- ``py-spy record`` samples every thread of the process (if ``--py-spy`` names it),
  and each sample of the asyncio thread is put in one bucket by its innermost frame
  of interest: the sockets (``zmq``), the codec (``msgspec`` and vLLM's serial utils),
  vLLM's input processing, its output processing, the hop back to trio, the asyncio
  loop itself; each of trio's loop, the hop into the asyncio thread or not.

Loopback only; one server, bounded in requests and time::

    python -m scripts.measure.vllm_client_cost --requests 240 --py-spy .venv/bin/py-spy
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from headwater.ports import free_port
from scripts.bench import prompts as bench_prompts
from scripts.bench.loadgen import run_load
from scripts.bench.stats import summarise
from scripts.bench_vllm import REPO, greedy_bodies, headwater_server

_TICKS = os.sysconf("SC_CLK_TCK")

#: Buckets of the asyncio thread's samples, the first whose marker a frame's file or
#: function holds, read from the innermost frame outwards.
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("idle (waiting in select)", ("EpollSelector.select",)),
    ("zmq sockets", ("zmq/",)),
    ("msgpack codec", ("msgspec", "serial_utils")),
    ("vLLM output processing", ("output_processor", "detokenizer", "logprobs", "outputs.py")),
    (
        "vLLM input processing",
        ("input_processor", "engine/processor.py", "inputs/", "sampling_params"),
    ),
    ("vLLM stats", ("loggers.py", "stats")),
    ("hop back to trio", ("_entry_queue.py", "_wakeup_socketpair")),
    ("headwater in the thread", ("workers/engines/vllm",)),
    ("vLLM engine client", ("vllm/v1/engine", "vllm/engine")),
    ("asyncio loop", ("asyncio/",)),
)
#: Buckets of trio's loop thread's samples: the hop into the asyncio thread, the rest.
LOOP_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hop to the asyncio thread", ("asyncio_thread.py",)),
    ("the vLLM backend", ("workers/engines/vllm",)),
)


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of *pid*: its name and CPU seconds so far."""
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICKS)
    return out


def group_of(pid: int, tid: int, name: str) -> str:
    """A thread's group by its OS name: Python leaves its own threads' names unset (they
    show the process's), so the asyncio thread is among "other threads"; trio names
    its pool's."""
    if tid == pid:
        return "trio loop"
    if name.startswith(("Trio thread", "fastokens", "tokenizer", "rayon")):
        return "tokenizer and trio threads"
    return "other threads"


def hosting_process(root: int) -> int:
    """The headwater process whose child is vLLM's engine core: it hosts the client.
    (psutil is one of vLLM's dependencies, there whenever this can run.)"""
    import psutil

    for proc in psutil.Process(root).children(recursive=True):
        try:
            if "EngineCore" in proc.name() or "VLLM::" in proc.name():
                parent = proc.parent()
                if parent is not None:
                    return int(parent.pid)
        except psutil.Error:
            continue
    raise RuntimeError("no vLLM engine core under the server")


def bucket_of(frames: list[str], buckets: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """The bucket of one sample, given its frames outermost first."""
    for frame in reversed(frames):
        for bucket, markers in buckets:
            if any(m in frame for m in markers):
                return bucket
    return "other"


def read_samples(raw: Path) -> dict[str, Counter[str]]:
    """py-spy's raw (collapsed) output: samples by thread, found by their outermost
    frames (the asyncio thread runs ``asyncio_thread.py``'s ``_serve``, trio's loop
    ``trio/_core/_run.py``), each thread's by bucket."""
    by_thread: dict[str, Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if any(f.startswith("_serve (") and "asyncio_thread.py" in f for f in frames):
            key, bucket = "asyncio thread (vLLM's client)", bucket_of(frames, BUCKETS)
        elif any("trio/_core/_run.py" in f for f in frames):
            key, bucket = "trio loop", bucket_of(frames, LOOP_BUCKETS)
        else:
            key, bucket = "other threads", "all"
        by_thread.setdefault(key, Counter())[bucket] += int(count)
    return by_thread


def spy_argv(py_spy: str, pid: int, raw: Path) -> list[str]:
    return [
        py_spy,
        "record",
        "-p",
        str(pid),
        "-r",
        "100",
        "--nonblocking",
        "-f",
        "raw",
        "-o",
        str(raw),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "artifacts" / "tiny-llama")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--py-spy", default="", help="py-spy's path: also sample by package")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "vllm-client-cost")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-client-cost-"))
    ps = bench_prompts.make_prompts("long", args.requests + 1, tokens=args.tokens)
    bodies = greedy_bodies(ps, args.max_tokens)
    port = free_port()
    with headwater_server(
        args.model, port, work / "server.log", True, 8192, client="in-process"
    ) as srv:
        url = srv.url + "/v1/completions"
        run_load(url, bodies[-1:], 1, 1, 120, True, progress=False)
        host = hosting_process(srv.process.pid)
        spy = None
        raw = args.out / "py-spy.txt"
        if args.py_spy:
            spy = subprocess.Popen(
                spy_argv(args.py_spy, host, raw),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(2)
        before = thread_cpu(host)
        n = args.requests
        result = run_load(url, bodies[:n], args.concurrency, n, 900, True, progress=False)
        after = thread_cpu(host)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
    summary = summarise(result, f"in-process {args.tokens} c{args.concurrency}")
    per_group: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        start = before.get(tid, (name, 0.0))[1]
        group = group_of(host, tid, name)
        per_group[group] = per_group.get(group, 0.0) + cpu - start
    report: dict[str, object] = {
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "requests": n,
        "ok": summary.ok,
        "req_per_s": summary.req_per_s,
        "cpu_ms_per_request": {g: round(1000 * s / n, 2) for g, s in per_group.items()},
    }
    if args.py_spy and raw.exists():
        report["samples"] = {
            thread: dict(buckets.most_common()) for thread, buckets in read_samples(raw).items()
        }
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
