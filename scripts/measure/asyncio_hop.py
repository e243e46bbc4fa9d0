"""What it costs to bring a stream's items from the asyncio thread to trio, two ways.

A worker running vLLM in-process gets each request's outputs from an async generator
on an asyncio loop in a thread of its own (``workers/engines/vllm/asyncio_thread.py``).
``run``: one ``AsyncioThread.run`` per item (a task made there, a wake-up each way);
``stream``: ``AsyncioThread.stream`` (one task per stream, the items ready together
brought over in one wake-up). Here ``--streams`` generators at once, each yielding
``--items`` items ``--gap`` seconds apart (a decode step), consumed from trio both
ways, alternated over ``--rounds``; the process's CPU time per item, medians::

    python -m scripts.measure.asyncio_hop --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import trio

from workers.engines.vllm.asyncio_thread import AsyncioThread, open_asyncio_thread


async def steps(items: int, gap: float) -> AsyncGenerator[int, None]:
    for i in range(items):
        await asyncio.sleep(gap)
        yield i


async def by_run(thread: AsyncioThread, items: int, gap: float) -> int:
    gen = await thread.call(lambda: steps(items, gap))
    got = 0
    while await thread.run(lambda: anext(gen, None)) is not None:
        got += 1
    return got


async def by_stream(thread: AsyncioThread, items: int, gap: float) -> int:
    got = 0
    async with aclosing(thread.stream(lambda: steps(items, gap))) as stream:
        async for _ in stream:
            got += 1
    return got


async def one(mode: str, streams: int, items: int, gap: float) -> tuple[float, float]:
    """CPU µs per item and wall seconds of *streams* streams consumed *mode*'s way."""
    consume = by_run if mode == "run" else by_stream
    counts: list[int] = []
    async with open_asyncio_thread("hop") as thread:

        async def go() -> None:
            counts.append(await consume(thread, items, gap))

        cpu, wall = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(go)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert counts == [items] * streams
    return 1e6 * cpu / (streams * items), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--gap", type=float, default=0.005, help="seconds between items")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"run": [], "stream": []}
    for r in range(args.rounds):
        for mode in ("run", "stream") if r % 2 == 0 else ("stream", "run"):
            us, wall = trio.run(one, mode, args.streams, args.items, args.gap)
            results[mode].append(us)
            print(f"round {r} {mode:6} {us:6.1f} µs CPU per item, {wall:.1f} s", flush=True)
    for mode, values in results.items():
        print(
            f"{mode:6} median {statistics.median(values):6.1f} µs per item "
            f"({min(values):.1f}-{max(values):.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
