"""The stall proof: tokenizing long prompts must not stall the event loop.

A lag probe on the loop measures how late a 1 ms sleep wakes up while 8 concurrent
~40k-token prompts are tokenized through the pool. The ``inline`` and ``thread-gil``
modes reproduce the failure; ``thread`` (the default) is the fix. The bounds are
generous, and the fix's lag is the least of three runs: on a busy machine the OS adds
lateness to some runs (never takes it away), while a loop that really stalls is late in
every run. docs/performance.md has the measured figures.
"""

from __future__ import annotations

import random

import pytest
import trio

from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.tokenizer import Tokenizer
from headwater.machine import usable_cpus

# A collection of the session's heap mid-test is a stall these tests did not make.
pytestmark = pytest.mark.usefixtures("frozen_heap")

PROMPTS = 8
WORDS_PER_PROMPT = 30_000  # ~40k DeepSeek-V4 tokens of random words


def _long_prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    return [" ".join(rng.choices(vocab, k=WORDS_PER_PROMPT)) for _ in range(PROMPTS)]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Tokenizer:
    return Tokenizer.load(None, "hf")


@pytest.fixture(scope="module")
def fast_tokenizer() -> Tokenizer:
    return Tokenizer.load(None, "fastokens")


async def _max_lag_while_tokenizing(tokenizer: Tokenizer, mode: str, seed: int) -> float:
    """Max lateness of a 1 ms sleep on the loop while the prompts are encoded."""
    # One thread fewer than cores leaves the loop a core, as a deployment would; the
    # benchmark measures the default (all usable cores) too.
    pool = TokenizerPool(
        tokenizer, mode=mode, threads=max(1, usable_cpus() - 1), inline_max_chars=0
    )
    await pool.warm_up()
    prompts = _long_prompts(seed)
    lags: list[float] = []
    done = trio.Event()

    async def probe() -> None:
        while not done.is_set():
            t0 = trio.current_time()
            await trio.sleep(0.001)
            lags.append(trio.current_time() - t0 - 0.001)

    counts: list[int] = []

    async def encode(text: str) -> None:
        counts.append(len(await pool.encode(text)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        await trio.sleep(0.01)
        async with trio.open_nursery() as work:
            for text in prompts:
                work.start_soon(encode, text)
        done.set()
    assert len(counts) == PROMPTS
    assert min(counts) > 30_000, counts
    return max(lags)


async def _least_lag(tokenizer: Tokenizer, mode: str, seed: int, runs: int = 3) -> float:
    """The least of *runs* max lags (other processes only ever add lateness)."""
    return min([await _max_lag_while_tokenizing(tokenizer, mode, seed + i) for i in range(runs)])


@pytest.mark.slow  # ~10 s of long prompts through HF's encoder, several runs
async def test_thread_mode_keeps_the_loop_free_with_hf(hf_tokenizer: Tokenizer) -> None:
    inline = await _max_lag_while_tokenizing(hf_tokenizer, "inline", seed=1)
    gil = await _max_lag_while_tokenizing(hf_tokenizer, "thread-gil", seed=2)
    thread = await _least_lag(hf_tokenizer, "thread", seed=3)
    # The proof is relative (the same machine, the same moment): the bug, an encode on
    # the loop, lags it by the encode (~100 ms per prompt, several prompts per pass). The
    # absolute bound is only a backstop, generous for a machine under load (60 ms seen
    # at a load average of 10 on 2 cores).
    assert thread < 0.150, f"thread mode lagged {thread * 1000:.1f} ms"
    assert thread * 3 <= inline, (thread, inline)
    assert thread * 3 <= gil, (thread, gil)


@pytest.mark.slow
async def test_fastokens_thread_mode_keeps_the_loop_free(fast_tokenizer: Tokenizer) -> None:
    lag = await _least_lag(fast_tokenizer, "thread", seed=4)
    assert lag < 0.050, f"fastokens thread mode lagged {lag * 1000:.1f} ms"


async def test_cancelled_encode_keeps_its_thread_slot_until_done(
    hf_tokenizer: Tokenizer,
) -> None:
    pool = TokenizerPool(hf_tokenizer, mode="thread", threads=1, inline_max_chars=0)
    text = _long_prompts(5)[0]
    with trio.move_on_after(0.005):
        await pool.encode(text)
    # The caller returned at once, but the encode still runs in its thread and
    # still holds the only slot: the pool never runs more encodes than threads.
    assert pool.statistics().busy == 1
    while pool.statistics().busy:
        await trio.sleep(0.01)
    assert pool.statistics().busy == 0


async def test_an_encode_reports_its_wait_for_a_thread(hf_tokenizer: Tokenizer) -> None:
    """The queue wait a trace's tokenize span shows: the time a text waited for the
    pool's only thread while another held it; none for an inline encode."""
    pool = TokenizerPool(hf_tokenizer, mode="thread", threads=1, inline_max_chars=100)
    _, inline_wait = await pool.encode_timed("short")
    assert inline_wait == 0.0
    text = _long_prompts(1)[0]
    _, idle_wait = await pool.encode_timed(text)
    assert 0.0 <= idle_wait < 0.5  # a free thread: only the hand-over
    waited: list[float] = []

    async def encode() -> None:
        ids, wait = await pool.encode_timed(text)
        assert len(ids) > 0
        waited.append(wait)

    async with trio.open_nursery() as nursery, pool.limiter:  # the only thread: 0.2 s taken
        nursery.start_soon(encode)
        await trio.sleep(0.2)
    (wait,) = waited
    assert wait >= 0.15
