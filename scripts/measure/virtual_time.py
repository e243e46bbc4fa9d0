"""What a headwater.testing test costs in real time: a minute of generation on trio's
virtual clock, and a server's start and stop.

One in-process server on the scripted engine (one token a second, 60 tokens) under an
autojump MockClock, as pytest-trio's ``autojump_clock`` runs it; each round is a
60-second generation through the OpenAI SDK. Then servers started and stopped in a row
(the tokenizer is loaded once per process, before: reported apart). docs/testing.md has
the figures:

    python -m scripts.measure.virtual_time [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio
import trio.testing

from headwater.testing import open_server

SCRIPT = [{"default": True, "text": "tick " * 100}]


async def measure(rounds: int) -> None:
    started = time.perf_counter()
    async with open_server(script=SCRIPT, token_delay=1.0) as server:
        print(f"first start (loads the tokenizers): {time.perf_counter() - started:.2f} s")
        client = server.openai_client()
        walls = []
        for _ in range(rounds):
            virtual, wall = trio.current_time(), time.perf_counter()
            await client.chat.completions.create(
                model="deepseek-v4", messages=[{"role": "user", "content": "go"}], max_tokens=60
            )
            walls.append(time.perf_counter() - wall)
            assert trio.current_time() - virtual == 60.0
    print(
        f"60 s of generation: median {statistics.median(walls) * 1000:.0f} ms, "
        f"max {max(walls) * 1000:.0f} ms of real time over {rounds} rounds"
    )
    starts = []
    for _ in range(rounds):
        wall = time.perf_counter()
        async with open_server(script=SCRIPT):
            pass
        starts.append(time.perf_counter() - wall)
    print(f"a server's start and stop: median {statistics.median(starts) * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    trio.run(measure, args.rounds, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    main()
