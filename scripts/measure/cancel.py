"""How long a client's disconnect takes to reach the engine, over the TCP request plane.

    python scripts/measure/cancel.py [--requests 50]

Starts one aggregated mocker worker process (real GPU timing, so a stream of 2,000
tokens is still running) and one frontend process in front of it, both on loopback.
Then, one request at a time: stream a chat completion, read three content events,
close the connection, and poll the worker's counters over its own plane connection
(every 2 ms) until ``cancelled_total`` grows. The time from the close to that moment
is what the client's disconnect took to free the request's KV on the worker (the
engine frees it when its generator is closed). Prints p50 / p99 / max in ms.
Bounded: at most ``--requests`` requests, each given 10 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from headwater.cluster.recipes import start_frontend, start_worker, wait_healthy
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.wire import Role

MODEL = "deepseek-v4"


async def measure(requests: int) -> list[float]:
    samples: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            worker = await start_worker(
                nursery,
                "agg",
                log_dir=Path(tmp),
                model=MODEL,
                extra_args=["--log-level", "warning"],
            )
            frontend = await start_frontend(
                nursery,
                log_dir=Path(tmp),
                workers=worker.static_url(MODEL),
                extra_args=["--log-level", "warning"],
            )
            await wait_healthy(frontend.address)
            instance = WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address)
            stats = await connect_worker(instance, nursery)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 2000,
                "stream": True,
                "ignore_eos": True,
            }
            async with httpx.AsyncClient(base_url=frontend.address, timeout=10) as http:
                for _ in range(requests):
                    before = (await stats.fetch_stats())["cancelled_total"]
                    with trio.fail_after(10):
                        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                            seen = 0
                            async for line in r.aiter_lines():
                                seen += '"content"' in line
                                if seen == 3:
                                    break
                        closed = time.perf_counter()  # the response is closed here
                        # Polling the worker is the measurement: 2 ms of resolution.
                        while (await stats.fetch_stats())["cancelled_total"] == before:  # noqa: ASYNC110
                            await trio.sleep(0.002)
                    samples.append(time.perf_counter() - closed)
            nursery.cancel_scope.cancel()
    return samples


def main() -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=50)
    args = p.parse_args()
    ms = sorted(1000 * s for s in trio.run(measure, args.requests))
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(
        f"{len(ms)} disconnects: p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
        f"max {ms[-1]:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
