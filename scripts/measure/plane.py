"""Request-plane overhead: TCP loopback vs the in-process memory plane, one process.

The engine yields its chunks at once, so the time from ``stream()`` to the first
chunk is the plane's own cost: encode, loopback send, decode, ACK, runtime hand-off,
and back. Client and worker share this process and its one event loop, so the
figures count both sides' CPU. Prints one JSON object::

    .venv/bin/python scripts/measure/plane.py [--requests 3000] [--concurrency 32]

:func:`first_chunk_s` and :func:`latency_ms` are reused by
``scripts/bench/cluster_bench.py``, which measures the same across two processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headwater.plane.base import WorkerClient, WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.memory import MemoryWorkerClient
from headwater.plane.server import PlaneServer
from headwater.wire import (
    Chunk,
    FinishReason,
    GenerateRequest,
    Role,
    SamplingParams,
)
from workers.engines.base import Engine, EngineError, EngineStats
from workers.runtime import open_runtime


class InstantEngine(Engine):
    """Yields ``max_tokens`` one-token chunks without waiting: zero engine time."""

    role = Role.AGG

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        n = request.sampling.max_tokens
        for i in range(n):
            yield Chunk(request.request_id, [3 + i], FinishReason.LENGTH if i == n - 1 else None)

    async def release_transfer(self, transfer_id: str) -> int:
        raise EngineError("kv_transfer_failed", "no transfers here")

    def statistics(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0)


def _request(i: int, prompt: list[int], tokens: int) -> GenerateRequest:
    return GenerateRequest(f"b{i}", "bench", prompt, SamplingParams(max_tokens=tokens))


async def first_chunk_s(client: WorkerClient, req: GenerateRequest) -> float:
    """Seconds from stream() to the first chunk; drains the rest."""
    start = time.perf_counter()
    first = None
    async with client.stream(req) as chunks:
        async for _ in chunks:
            if first is None:
                first = time.perf_counter() - start
    assert first is not None
    return first


async def _measure(client: WorkerClient, args: argparse.Namespace) -> dict[str, float]:
    prompt = list(range(3, 3 + args.prompt_tokens))
    for i in range(args.warmup):
        await first_chunk_s(client, _request(-i - 1, prompt, args.tokens))
    latencies = sorted(
        [
            await first_chunk_s(client, _request(i, prompt, args.tokens))
            for i in range(args.requests)
        ]
    )
    start = time.perf_counter()
    for i in range(args.requests):
        await first_chunk_s(client, _request(i, prompt, args.tokens))
    serial_rps = args.requests / (time.perf_counter() - start)

    counter = iter(range(args.requests))

    async def worker() -> None:
        for i in counter:
            await first_chunk_s(client, _request(i, prompt, args.tokens))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(args.concurrency):
            nursery.start_soon(worker)
    concurrent_rps = args.requests / (time.perf_counter() - start)
    return {
        **latency_ms(latencies, "first_chunk"),
        "req_per_s_serial": round(serial_rps, 1),
        f"req_per_s_c{args.concurrency}": round(concurrent_rps, 1),
    }


def latency_ms(latencies: list[float], name: str) -> dict[str, float]:
    """``{name}_p50_ms``, ``{name}_p99_ms`` of *latencies* (seconds; at least 2)."""
    q = statistics.quantiles(latencies, n=100)
    return {f"{name}_p50_ms": round(q[49] * 1e3, 4), f"{name}_p99_ms": round(q[98] * 1e3, 4)}


async def main(args: argparse.Namespace) -> dict[str, object]:
    result: dict[str, object] = {
        "requests": args.requests,
        "chunks_per_request": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "python": sys.version.split()[0],
    }
    async with open_runtime(InstantEngine(), "bench") as runtime, trio.open_nursery() as nursery:
        instance = WorkerInstance("bench", Role.AGG, "bench", "memory://bench")
        result["memory"] = await _measure(MemoryWorkerClient(instance, runtime), args)

        server = PlaneServer(runtime, role=Role.AGG, model="bench")
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(partial(server.serve, listeners))
        port = listeners[0].socket.getsockname()[1]
        tcp_instance = WorkerInstance("bench", Role.AGG, "bench", f"tcp://127.0.0.1:{port}")
        client = await connect_worker(tcp_instance, nursery, secret=None)
        result["tcp"] = await _measure(client, args)
        tcp, mem = result["tcp"], result["memory"]
        assert isinstance(tcp, dict)
        assert isinstance(mem, dict)
        result["tcp_overhead_p50_ms"] = round(
            tcp["first_chunk_p50_ms"] - mem["first_chunk_p50_ms"], 4
        )
        await client.aclose()
        nursery.cancel_scope.cancel()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1, help="chunks per request")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    print(json.dumps(trio.run(main, parser.parse_args()), indent=2))
