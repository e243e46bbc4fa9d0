"""How long parsing a request body takes on the event loop: JSON decode plus validation
into the frontend's request model (``frontend.http.schema.parse_request``), for a
benchmark-sized chat body (~40k tokens, ~240 kB) and a short one.

Median over many runs, each timed alone with ``perf_counter``; the JSON decode alone is
reported beside it, so the validation's share shows. Run it on two checkouts to compare
them (docs/performance.md has the figures):

    python -m scripts.measure.parse [--runs 2000]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from frontend.http.schema import parse_request
from scripts.bench.prompts import WORDS


def bodies() -> dict[str, bytes]:
    """The bodies measured: what the benchmark's long and short scenarios send."""
    rng = random.Random(7)
    long_text = " ".join(rng.choices(WORDS, k=40_000))
    common = {
        "model": "deepseek-v4",
        "max_tokens": 64,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return {
        "long chat (40k tokens)": orjson.dumps(
            {
                **common,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": long_text},
                ],
            }
        ),
        "short chat": orjson.dumps(
            {**common, "messages": [{"role": "user", "content": "Write a haiku about rivers."}]}
        ),
    }


def median_us(fn: Callable[[bytes], Any], body: bytes, runs: int) -> float:
    for _ in range(min(runs, 100)):  # warm-up
        fn(body)
    times = []
    gc.disable()  # the collector's pauses are not the parser's
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn(body)
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    for name, body in bodies().items():
        decode = median_us(orjson.loads, body, args.runs)
        full = median_us(lambda b: parse_request(orjson.loads(b), "chat"), body, args.runs)
        print(
            f"{name:24s} {len(body):>8,d} B   decode {decode:7.1f} us   "
            f"decode + validate {full:7.1f} us   (median of {args.runs})"
        )


if __name__ == "__main__":
    main()
