"""What a prefill and a decode worker keep of the requests they served: Python heap, not RSS.

The soak (docs/reliability.md) sees each worker's RSS creep by a few MiB over ten minutes.
RSS cannot tell objects kept from allocator pages not handed back; this counts objects.
A prefill and a decode worker (``serve_worker``, mocker engines at ``--speedup`` so engine
time is negligible) run in this process over the TCP request plane; ``--concurrency``
clients send unique prompts (100 to 40k tokens, each a distinct first token, so no two
share a cached block) through prefill then decode, the soak's way: some decode legs are
closed after two chunks (a cancel), some prefill handles are released unpulled
(``kv_release``). After ``--warmup`` requests (enough to fill and churn both KV caches
once: memory those caches held before tracing started is replaced by traced memory,
which reads as growth once), tracemalloc starts; every ``--step`` requests, once the
workers are idle, the traced total is printed beside the process's RSS, and its RSS
again after glibc's ``malloc_trim(0)`` (``--trim``: the freed pages malloc keeps, handed
back). A per-request leak grows the traced total step after step; RSS that grows while
the traced total does not, and falls back on a trim, is free memory the allocator keeps.
What is left at the end is listed by allocating line.

Usage: ``.venv/bin/python scripts/measure/worker_heap.py [--steps 8] [--step 500]``
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import tracemalloc
from functools import partial
from pathlib import Path

import trio

from headwater.plane.base import WorkerInstance
from headwater.plane.client import TcpWorkerClient, connect_worker
from headwater.wire import Role
from headwater.wire.messages import GenerateRequest, SamplingParams
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

MODEL = "deepseek-v4"
SIZES = (100, 100, 100, 4_000, 12_000, 40_000)
MIB = 2**20


def rss_mib() -> float:
    """This process's resident set (``VmRSS`` in ``/proc/self/status``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: return the free pages of every arena to the kernel."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _instance(w: RunningWorker) -> WorkerInstance:
    return WorkerInstance(w.worker_id, w.role, w.model, w.address)


class Traffic:
    """Unique requests through a prefill and a decode worker, some cut short."""

    def __init__(self, prefill: TcpWorkerClient, decode: TcpWorkerClient, seed: int) -> None:
        self._prefill, self._decode = prefill, decode
        self._rng = random.Random(seed)
        rng = self._rng
        self._pool = {
            n: [[rng.randrange(3, 128_000) for _ in range(n)] for _ in range(8)] for n in set(SIZES)
        }
        self.sent = 0
        self.errors = 0

    async def one(self) -> None:
        rng = self._rng
        self.sent += 1
        n = self.sent
        tokens = list(rng.choice(self._pool[rng.choice(SIZES)]))
        tokens[0] = 3 + n % 100_000  # a distinct first block: nothing cached is shared
        sampling = SamplingParams(max_tokens=rng.randint(4, 64), ignore_eos=True, seed=n)
        mode = rng.random()
        try:
            async with self._prefill.stream(
                GenerateRequest(f"r{n}", MODEL, tokens, sampling)
            ) as chunks:
                handle = [c async for c in chunks][-1].kv_handle
            assert handle is not None
            if mode < 0.15:
                self._prefill.release_kv(handle)  # the client left before the decode leg
                return
            leg = GenerateRequest(f"r{n}", MODEL, tokens, sampling, handle)
            async with self._decode.stream(leg) as chunks:
                seen = 0
                async for _ in chunks:
                    seen += 1
                    if mode < 0.4 and seen >= 2:
                        break  # the client cancelled mid-stream
        except Exception as exc:  # counted: a failure here is not what is measured
            self.errors += 1
            print(f"request r{n}: {type(exc).__name__}: {exc}", flush=True)

    async def send(self, count: int, concurrency: int) -> None:
        limit = trio.Semaphore(concurrency)

        async def go() -> None:
            async with limit:
                await self.one()

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(go)


async def main(args: argparse.Namespace) -> None:
    engine = MockerConfig(speedup_ratio=args.speedup)
    async with trio.open_nursery() as nursery:
        workers = [
            await nursery.start(partial(serve_worker, WorkerConfig(role=r, engine_config=engine)))
            for r in (Role.PREFILL, Role.DECODE)
        ]
        prefill, decode = [await connect_worker(_instance(w), nursery) for w in workers]
        traffic = Traffic(prefill, decode, args.seed)
        await traffic.send(args.warmup, args.concurrency)
        await trio.sleep(args.quiet)
        tracemalloc.start(1)
        gc.collect()
        before = tracemalloc.take_snapshot()
        base = tracemalloc.get_traced_memory()[0]
        print(
            f"{'requests':>9} {'traced since warm-up (MiB)':>27} {'RSS (MiB)':>10}"
            + (f" {'RSS trimmed':>12}" if args.trim else "")
        )
        for _ in range(args.steps):
            await traffic.send(args.step, args.concurrency)
            await trio.sleep(args.quiet)  # idle: expired holds freed, streams closed
            gc.collect()
            grown = (tracemalloc.get_traced_memory()[0] - base) / MIB
            line = f"{traffic.sent:>9} {grown:>27.2f} {rss_mib():>10.1f}"
            if args.trim:
                malloc_trim()
                line += f" {rss_mib():>12.1f}"
            print(line, flush=True)
        after = tracemalloc.take_snapshot()
        print(f"\nkept since warm-up, by allocating line ({traffic.errors} request errors):")
        for stat in after.compare_to(before, "lineno")[: args.top]:
            frame = stat.traceback[0]
            print(
                f"{stat.size_diff / 1024:>9.0f} KiB {stat.count_diff:>6} blocks  "
                f"{frame.filename.rsplit('/', 3)[-1]}:{frame.lineno}"
            )
        nursery.cancel_scope.cancel()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    a = p.add_argument
    a("--warmup", type=int, default=400, help="requests before tracing starts")
    a("--steps", type=int, default=8, help="measured steps")
    a("--step", type=int, default=500, help="requests per step")
    a("--concurrency", type=int, default=16, help="requests in flight")
    a("--speedup", type=float, default=1000.0, help="mocker speedup ratio")
    a("--quiet", type=float, default=12.0, help="idle seconds before each reading")
    a("--top", type=int, default=8, help="allocating lines listed at the end")
    a("--trim", action="store_true", help="also read RSS after malloc_trim(0) each step")
    a("--seed", type=int, default=3)
    return p


if __name__ == "__main__":
    trio.run(main, parser().parse_args())
