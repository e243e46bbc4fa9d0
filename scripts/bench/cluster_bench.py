"""The request plane across processes: its cost per request, and a small cluster's req/s.

Two measurements, both on loopback, both with real processes:

1. :func:`plane_overhead` — how long a request spends in the plane. The same mocker
   (sped up so far that its step times vanish) is reached two ways from this
   process: in-process through the memory plane, and in a worker process
   (``headwater worker``) through the frontend's TCP client. Each request has one
   output token, so ``stream()`` to first chunk is plane + engine; the engine's part
   is the same on both paths, so **TCP minus memory is the plane's cost**: encode,
   loopback send, the worker's decode, ACK, runtime hand-off, and back. Serial
   requests, distinct prompts (no prefix-cache hits). The one-process, one-loop
   figure of ``scripts/measure/plane.py`` (an engine that answers at once) is included.
2. :func:`cluster_throughput` — short prompts (~100 tokens, 8 output tokens) through
   one frontend, one prefill and one decode worker process (``--workers``, no etcd),
   and, for reference, through one frontend with the same pair in-process
   (``headwater serve``'s default), driven by the aiohttp load generator in its own
   process. Mocker at ``--speedup-ratio 1000``, the benchmark suite's setting. Reports
   req/s, TTFT and the CPU each process used per request.

    .venv/bin/python -m scripts.bench.cluster_bench [--quick] [--json out.json]

:func:`run` does both and returns one JSON-ready dict; :func:`markdown` renders it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import trio

from headwater.cluster.recipes import ChildProcess, start_frontend, start_worker, wait_healthy
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.memory import MemoryWorkerClient
from headwater.wire import GenerateRequest, Role, SamplingParams
from scripts.bench import prompts
from scripts.bench.loadgen import run_load_trio
from scripts.bench.scrape import ProcSample, read_proc
from scripts.bench.stats import summarise
from scripts.measure.plane import first_chunk_s, latency_ms
from scripts.measure.plane import main as plane_main
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.runtime import WorkerRuntime

MODEL = "deepseek-v4"
ENGINE_FREE = 1e6  # mocker speedup at which a step's simulated time is ~0
THROUGHPUT_SPEEDUP = 1000.0  # as the benchmark suite: engine far faster than the frontend
MAX_TOKENS = 8


def _request(i: int, prompt_tokens: int) -> GenerateRequest:
    # Distinct first tokens: no request hits another's prefix cache.
    prompt = [3 + i % 50_000, *range(100, 100 + prompt_tokens - 1)]
    return GenerateRequest(f"b{i}", MODEL, prompt, SamplingParams(max_tokens=1, ignore_eos=True))


async def plane_overhead(
    workdir: Path, *, requests: int = 2000, warmup: int = 200, prompt_tokens: int = 128
) -> dict[str, Any]:
    """First-chunk latency over the memory plane and over TCP to a worker process.

    Returns ``memory`` / ``tcp`` p50 and p99 (ms) and their differences, the TCP
    plane's overhead per request; plus ``one_process``, measure.plane.s figures.
    """
    result: dict[str, Any] = {"requests": requests, "prompt_tokens": prompt_tokens}
    async with trio.open_nursery() as nursery:
        engine = MockerEngine(MockerConfig(speedup_ratio=ENGINE_FREE), Role.AGG, "mem-0")
        runtime = WorkerRuntime(engine, "mem-0")
        await nursery.start(runtime.run)
        memory = MemoryWorkerClient(
            WorkerInstance("mem-0", Role.AGG, MODEL, "memory://mem-0"), runtime
        )

        worker = await start_worker(
            nursery,
            "agg",
            log_dir=workdir,
            name="overhead-agg",
            model=MODEL,
            engine_args=["--speedup-ratio", f"{ENGINE_FREE:g}"],
            extra_args=["--log-level", "warning"],
        )
        instance = WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address)
        tcp = await connect_worker(instance, nursery, secret=None)

        for name, client in (("memory", memory), ("tcp", tcp)):
            for i in range(warmup):
                await first_chunk_s(client, _request(-1 - i, prompt_tokens))
            latencies = [
                await first_chunk_s(client, _request(i, prompt_tokens)) for i in range(requests)
            ]
            result[name] = latency_ms(latencies, "first_chunk")
        await tcp.aclose()
        await worker.stop()
        nursery.cancel_scope.cancel()
    mem, net = result["memory"], result["tcp"]
    for q in ("p50", "p99"):
        key = f"first_chunk_{q}_ms"
        result[f"overhead_{q}_ms"] = round(net[key] - mem[key], 4)
    one = argparse.Namespace(
        requests=requests, warmup=warmup, concurrency=32, tokens=1, prompt_tokens=prompt_tokens
    )
    result["one_process"] = await plane_main(one)
    return result


def _cpu(samples: dict[str, ProcSample], child: ChildProcess) -> float:
    return read_proc(child.pid).cpu_s - samples[child.name].cpu_s


async def cluster_throughput(
    workdir: Path,
    *,
    concurrency: Sequence[int] = (16, 64),
    requests: int = 1000,
    streams: Sequence[bool] = (False, True),
    topologies: Sequence[str] = ("processes", "inprocess"),
    time_limit: float = 60.0,
    frontend_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Short-prompt runs, one record per (topology, stream, concurrency).

    Topology ``processes``: 1 frontend + 1 prefill + 1 decode worker process over the
    TCP plane (``--workers``); ``inprocess``: ``headwater serve``'s default, the same
    pair inside the frontend process (the reference). Each record is the load
    generator's summary plus each process's CPU milliseconds per successful request.
    """
    prompt_set = prompts.make_prompts("short", requests, seed=7)
    runs: list[dict[str, Any]] = []
    for topology in topologies:
        async with trio.open_nursery() as nursery:
            children = await _start_topology(nursery, workdir, topology, frontend_args)
            url = children[0].address + prompts.ENDPOINT_PATHS["chat"]
            warm = prompts.build_bodies(
                prompt_set.prompts[:32], stream=False, max_tokens=MAX_TOKENS
            )
            warmed = summarise(await run_load_trio(url, warm, 4, 32, time_limit, False))
            if warmed.ok != warmed.requests:
                raise RuntimeError(f"warm-up requests failed: {warmed.first_error}")
            label = "1+1+1" if topology == "processes" else "in-process"
            for stream in streams:
                bodies = prompts.build_bodies(prompt_set, stream=stream, max_tokens=MAX_TOKENS)
                for c in concurrency:
                    before = {child.name: read_proc(child.pid) for child in children}
                    load = await run_load_trio(url, bodies, c, requests, time_limit, stream)
                    summary = summarise(load, f"{label} {'stream' if stream else 'unary'} c{c}")
                    ok = max(1, summary.ok)
                    record = {"topology": topology, **summary.to_json()}
                    record["cpu_ms_per_request"] = {
                        child.name: round(1000 * _cpu(before, child) / ok, 3) for child in children
                    }
                    runs.append(record)
            for child in children:
                await child.stop()
            nursery.cancel_scope.cancel()
    return runs


async def _start_topology(
    nursery: trio.Nursery, workdir: Path, topology: str, frontend_args: Sequence[str]
) -> list[ChildProcess]:
    """The frontend first in the list, then its worker processes (if any)."""
    quiet = ["--log-level", "warning"]
    workers = []
    if topology == "processes":
        workers = [
            await start_worker(
                nursery,
                role,
                log_dir=workdir,
                model=MODEL,
                engine_args=["--speedup-ratio", f"{THROUGHPUT_SPEEDUP:g}"],
                extra_args=quiet,
            )
            for role in ("prefill", "decode")
        ]
    elif topology != "inprocess":
        raise ValueError(f"unknown topology {topology!r}")
    frontend = await start_frontend(
        nursery,
        log_dir=workdir,
        name=f"frontend-{topology}",
        model=MODEL,
        workers=",".join(w.static_url(MODEL) for w in workers),
        extra_args=[*quiet, "--speedup-ratio", f"{THROUGHPUT_SPEEDUP:g}", *frontend_args],
    )
    await wait_healthy(frontend.address, child=frontend)
    return [frontend, *workers]


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


async def run(workdir: Path | None = None, *, quick: bool = False) -> dict[str, Any]:
    """Both measurements; *quick* runs fewer requests and one concurrency."""
    with tempfile.TemporaryDirectory(prefix="headwater-cluster-bench-") as tmp:
        where = workdir or Path(tmp)
        started = time.time()
        results: dict[str, Any] = {"machine_start": machine()}
        results["plane_overhead"] = await plane_overhead(
            where, requests=500 if quick else 3000, warmup=100 if quick else 300
        )
        results["throughput"] = await cluster_throughput(
            where,
            concurrency=(16,) if quick else (16, 64),
            requests=200 if quick else 1500,
        )
        results["machine_end"] = machine()
        results["elapsed_s"] = round(time.time() - started, 1)
    return results


def markdown(results: dict[str, Any]) -> str:
    """The figures as the Performance section of docs/request-plane.md shows them."""
    po = results["plane_overhead"]
    one = po["one_process"]
    lines = [
        "| plane (first chunk, 1 output token) | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| memory, in-process mocker | {po['memory']['first_chunk_p50_ms']:.3f} | "
        f"{po['memory']['first_chunk_p99_ms']:.3f} |",
        f"| TCP loopback, worker process | {po['tcp']['first_chunk_p50_ms']:.3f} | "
        f"{po['tcp']['first_chunk_p99_ms']:.3f} |",
        f"| **TCP plane overhead** (difference) | **{po['overhead_p50_ms']:.3f}** | "
        f"{po['overhead_p99_ms']:.3f} |",
        f"| one process, one loop (measure/plane.py): TCP − memory | "
        f"{one['tcp_overhead_p50_ms']:.3f} | |",
        "",
        "| run | ok/req | req/s | TTFT p50/p99 ms | e2e p50/p99 ms | CPU ms/req "
        "(frontend + prefill + decode) | client CPU % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["throughput"]:
        cpu = " + ".join(f"{v:.2f}" for v in r["cpu_ms_per_request"].values())
        lines.append(
            f"| {r['label']} | {r['ok']}/{r['requests']} | {r['req_per_s']:.0f} | "
            f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} | {r['e2e_p50_ms']}/{r['e2e_p99_ms']} | "
            f"{cpu} | {r['client_cpu_pct']} |"
        )
        if r["failed"]:
            lines.append(f"|  ↳ {r['failed']} failed: {r['first_error']} | | | | | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, c16 only")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the process logs here")
    args = parser.parse_args(argv)
    results = trio.run(lambda: run(args.workdir, quick=args.quick))
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(markdown(results))
    print(
        f"\nload average {results['machine_start']['load_avg']} → "
        f"{results['machine_end']['load_avg']}; {results['elapsed_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
