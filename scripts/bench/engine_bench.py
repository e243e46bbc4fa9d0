"""The simulated engine alone: its CPU per request, with no frontend around it.

A prefill and a decode mocker in this process, joined by the in-process KV transfer, are
driven the way the frontend drives them (prefill leg, then the decode leg with the
handle), by *concurrency* clients in a closed loop, for three prompt shapes:

- ``long``: every prompt distinct, ~40k tokens;
- ``shared-prefix``: one ~40k-token prefix shared by every prompt, plus ~100 distinct tokens;
- ``short``: every prompt distinct, ~100 tokens.

With the mocker in-process (``headwater serve``'s default) this CPU is the frontend's
loop's, so it must stay well below what the frontend itself spends per request
(docs/performance.md, "Where the time goes"). Prints CPU per request (process time,
which includes nothing but the engines and trio here) and req/s per scenario.

    .venv/bin/python -m scripts.bench.engine_bench [--requests 400] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from array import array
from collections.abc import Callable

import trio

from headwater.wire import GenerateRequest, Role, SamplingParams
from headwater.wire.tokens import token_array
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.runtime.kv_transfer import InProcessKvTransfer

PROMPT_TOKENS = 40_000
USER_TOKENS = 100
MAX_TOKENS = 8


def prompt_maker(scenario: str, seed: int) -> Callable[[int], array[int]]:
    """Prompt *i* of *scenario* as a token array (ids in the ordinary vocabulary)."""
    rng = random.Random(seed)

    def draw(n: int) -> array[int]:
        return token_array(rng.randrange(3, 128_000) for _ in range(n))

    if scenario == "shared-prefix":
        prefix = draw(PROMPT_TOKENS)
        return lambda i: prefix + draw(USER_TOKENS)
    size = PROMPT_TOKENS if scenario == "long" else USER_TOKENS
    return lambda i: draw(size)


async def drive(scenario: str, requests: int, concurrency: int, speedup: float) -> dict[str, float]:
    """Serve *requests* prompts of *scenario*; return CPU ms per request and req/s."""
    cfg = MockerConfig(speedup_ratio=speedup)
    transfer = InProcessKvTransfer(bandwidth=cfg.kv_transfer_bandwidth)
    prefill = MockerEngine(cfg, Role.PREFILL, "prefill-0")
    decode = MockerEngine(cfg, Role.DECODE, "decode-0", kv_transfer=transfer)
    transfer.register("prefill-0", prefill)
    make = prompt_maker(scenario, seed=1)
    prompts = [make(i) for i in range(min(requests, 64))]  # drawn before the clock starts
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < requests:
            i = next_index
            next_index += 1
            ids = prompts[i % len(prompts)]
            rid = f"r{i}"
            handle = None
            async for chunk in prefill.generate(GenerateRequest(rid, "m", ids, sampling)):
                handle = chunk.kv_handle
            leg = GenerateRequest(rid, "m", ids, sampling, kv_handle=handle)
            async for _ in decode.generate(leg):
                pass

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        await nursery.start(decode.run)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as clients:
            for _ in range(concurrency):
                clients.start_soon(client)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        nursery.cancel_scope.cancel()
    return {"cpu_ms_per_req": 1000 * cpu / requests, "req_per_s": requests / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--speedup-ratio", type=float, default=1000.0)
    p.add_argument("--rounds", type=int, default=3, help="rounds per scenario; medians shown")
    p.add_argument("--scenario", action="append", choices=["long", "shared-prefix", "short"])
    args = p.parse_args(argv)
    for scenario in args.scenario or ["long", "shared-prefix", "short"]:
        runs = [
            trio.run(drive, scenario, args.requests, args.concurrency, args.speedup_ratio)
            for _ in range(args.rounds)
        ]
        cpu = sorted(r["cpu_ms_per_req"] for r in runs)
        rate = sorted(r["req_per_s"] for r in runs)
        print(
            f"{scenario:14s} c{args.concurrency}: {cpu[len(cpu) // 2]:.3f} ms CPU/req "
            f"(rounds {', '.join(f'{c:.3f}' for c in cpu)}), "
            f"{rate[len(rate) // 2]:.0f} req/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
