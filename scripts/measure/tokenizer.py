"""Measure the tokenizer pool's design choices; prints a JSON record per figure.

1. Single-thread encode rate per backend (tokens/s) on random-word text.
2. Short prompts: encoding inline vs the thread hop (why ``--inline-max-chars`` exists).
3. Coalescing: N concurrent long prompts as N single calls through the pool vs one
   batched ``encode_batch`` call (is micro-batching worth it?).
4. Event-loop lag while 8 concurrent ~40k-token prompts are encoded, per backend × mode.

Usage: ``.venv/bin/python scripts/measure/tokenizer.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import random
import time

import trio

from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.tokenizer import Tokenizer


def words_text(rng: random.Random, n_words: int) -> str:
    vocab = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    return " ".join(rng.choices(vocab, k=n_words))


def encode_rate(tok: Tokenizer, texts: list[str]) -> float:
    t0 = time.perf_counter()
    n = sum(len(tok.encode_ids(t)) for t in texts)
    return n / (time.perf_counter() - t0)


async def short_inline_vs_thread(tok: Tokenizer, text: str, reps: int) -> dict[str, float]:
    for _ in range(50):
        tok.encode_ids(text)
    t0 = time.perf_counter()
    for _ in range(reps):
        tok.encode_ids(text)
    inline = (time.perf_counter() - t0) / reps
    limiter = trio.CapacityLimiter(2)
    t0 = time.perf_counter()
    for _ in range(reps):
        await trio.to_thread.run_sync(tok.encode_ids, text, limiter=limiter)
    hop = (time.perf_counter() - t0) / reps
    return {"chars": len(text), "inline_us": inline * 1e6, "thread_us": hop * 1e6}


async def coalesce(tok: Tokenizer, texts: list[str]) -> dict[str, float]:
    pool = TokenizerPool(tok, mode="thread", threads=2, inline_max_chars=0)
    await pool.warm_up()
    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for t in texts:
            n.start_soon(pool.encode, t)
    singles = time.perf_counter() - t0
    t0 = time.perf_counter()
    await trio.to_thread.run_sync(tok.encode_batch, texts)
    batched = time.perf_counter() - t0
    return {"prompts": len(texts), "single_calls_s": singles, "one_batch_call_s": batched}


async def loop_lag(tok: Tokenizer, mode: str, texts: list[str]) -> dict[str, float]:
    pool = TokenizerPool(tok, mode=mode, threads=2, inline_max_chars=0)
    await pool.warm_up()
    lags: list[float] = []
    done = trio.Event()

    async def probe() -> None:
        while not done.is_set():
            t0 = trio.current_time()
            await trio.sleep(0.001)
            lags.append(trio.current_time() - t0 - 0.001)

    async with trio.open_nursery() as n:
        n.start_soon(probe)
        await trio.sleep(0.01)  # the probe is sleeping before the work starts
        t0 = time.perf_counter()
        async with trio.open_nursery() as work:
            for t in texts:
                work.start_soon(pool.encode, t)
        elapsed = time.perf_counter() - t0
        done.set()
    lags.sort()
    return {
        "backend": tok.backend.value,
        "mode": mode,
        "wall_s": elapsed,
        "lag_max_ms": lags[-1] * 1000,
        "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1000,
    }


async def main(quick: bool) -> None:
    rng = random.Random(0)
    long_texts = [words_text(rng, 30_000) for _ in range(4 if quick else 8)]
    for backend in ("fastokens", "hf"):
        tok = Tokenizer.load(None, backend)
        rate = encode_rate(tok, long_texts[:2])
        print(json.dumps({"figure": "encode_rate", "backend": backend, "tokens_per_s": rate}))
        for n_words in (20, 100, 400, 1600):
            r = await short_inline_vs_thread(tok, words_text(rng, n_words), 200 if quick else 1000)
            print(json.dumps({"figure": "inline_vs_thread", "backend": backend, **r}))
        print(
            json.dumps(
                {"figure": "coalesce", "backend": backend, **await coalesce(tok, long_texts)}
            )
        )
        for mode in ("inline", "thread-gil", "thread"):
            print(json.dumps({"figure": "loop_lag", **await loop_lag(tok, mode, long_texts)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    trio.run(main, ap.parse_args().quick)
