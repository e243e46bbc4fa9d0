"""The simulated engine and the in-process KV transfer, on virtual time.

Test policy: every engine test takes ``autojump_clock``, so step durations are exact
and asserted against the timing model with ``pytest.approx``; no sockets, no threads,
no real sleeps. Expected times are computed from :mod:`workers.engines.mocker.timing`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing

from headwater.wire import Chunk, FinishReason, GenerateRequest, KvHandle, Role, SamplingParams
from headwater.wire.tokens import token_array
from workers.engines.base import EngineError
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.engines.mocker.engine import MIN_SLEEP
from workers.engines.mocker.kv_cache import BlockTable, KvCache, KvCacheStats
from workers.engines.mocker.timing import decode_ms, prefill_ms, step_seconds
from workers.runtime.kv_transfer import InProcessKvTransfer

EOS = 1  # DeepSeek-V4's end-of-sentence id


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def request(
    rid: str,
    token_ids: Sequence[int],
    max_tokens: int = 8,
    *,
    kv_handle: KvHandle | None = None,
    eos: tuple[int, ...] = (),
    **sampling: object,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="mock",
        token_ids=token_ids,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        kv_handle=kv_handle,
        eos_token_ids=eos,
    )


@asynccontextmanager
async def running(*engines: MockerEngine) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        for engine in engines:
            await nursery.start(engine.run)
        yield
        nursery.cancel_scope.cancel()


async def collect(engine: MockerEngine, req: GenerateRequest) -> list[Chunk]:
    async with aclosing(engine.generate(req)) as chunks:
        return [chunk async for chunk in chunks]


async def timed(engine: MockerEngine, req: GenerateRequest) -> list[tuple[float, Chunk]]:
    """Chunks with their arrival time relative to the call."""
    start = trio.current_time()
    out = []
    async with aclosing(engine.generate(req)) as chunks:
        async for chunk in chunks:
            out.append((trio.current_time() - start, chunk))
    return out


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def agg(**overrides: object) -> MockerEngine:
    return MockerEngine(MockerConfig(**overrides), Role.AGG, "agg-0")  # type: ignore[arg-type]


# ---- timing and batching ------------------------------------------------------------


def test_timing_model_matches_dynamo_fit() -> None:
    assert prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 15.18344 + 16.50142)
    assert decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 27.005 + 5.74)
    assert decode_ms(5.0) == 1.0  # the floor
    assert step_seconds(100, 0.9, 4.0) == pytest.approx(prefill_ms(100) / 4000)
    assert step_seconds(0, 0.25, 2.0) == pytest.approx(decode_ms(0.25) / 2000)


def _model_times(engine: MockerEngine, p: int, n: int) -> list[float]:
    """When each of a lone request's *n* tokens is due by the timing model."""
    cap, speedup = engine.config.kv_capacity_tokens, engine.config.speedup_ratio
    times = [prefill_ms(p) / 1000 / speedup]
    for k in range(1, n):
        times.append(times[-1] + decode_ms((p + k) / cap) / 1000 / speedup)
    return times


async def test_single_request_duration_is_prefill_plus_decode_steps(autojump_clock: object) -> None:
    engine = agg(speedup_ratio=4.0, num_gpu_blocks=64)  # small cache: u visibly > 0
    p, n = 300, 12
    async with running(engine):
        timeline = await timed(engine, request("r1", prompt(p), n))
    due = _model_times(engine, p, n)
    assert timeline[0][0] == pytest.approx(due[0])
    assert timeline[-1][0] == pytest.approx(due[-1])
    chunks = [c for _, c in timeline]
    assert [len(c.token_ids) for c in chunks] == [1] * n
    assert [c.finish_reason for c in chunks] == [None] * (n - 1) + [FinishReason.LENGTH]
    assert engine.counters.requests_finished == 1
    assert engine.counters.prefill_tokens_computed == p


async def test_a_late_wake_up_does_not_slow_the_simulated_device(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # In-process, the scheduler shares the frontend's loop, and a busy loop wakes it
    # after its step's end. The device keeps its own timeline: the steps that came due
    # meanwhile run at once, and the request ends when the timing model says.
    engine = agg(speedup_ratio=4.0, num_gpu_blocks=64)
    p, n = 300, 12
    due = _model_times(engine, p, n)
    late = (due[-1] - due[0]) / 2

    async def busy_loop() -> None:
        await trio.sleep(due[0] * 1.5)  # mid-decode
        autojump_clock.jump(late)  # time passes while the scheduler cannot run

    async with running(engine), trio.open_nursery() as nursery:
        nursery.start_soon(busy_loop)
        timeline = await timed(engine, request("r1", prompt(p), n))
    assert timeline[0][0] == pytest.approx(due[0])
    assert timeline[-1][0] == pytest.approx(due[-1])  # not due[-1] + late
    assert len(tokens_of([c for _, c in timeline])) == n


async def test_steps_shorter_than_min_sleep_share_a_timer(autojump_clock: object) -> None:
    # At --speedup-ratio 1000 a decode step lasts ~10 us, less than a trio timer costs
    # the loop: the scheduler yields instead, and sleeps once the steps it ran ahead add
    # up to MIN_SLEEP. No token comes MIN_SLEEP or more before the model says, or after.
    engine = agg(speedup_ratio=1000.0, num_gpu_blocks=64)
    p, n = 300, 200
    due = _model_times(engine, p, n)
    async with running(engine):
        timeline = await timed(engine, request("r1", prompt(p), n))
    assert len(timeline) == n
    for (arrived, _), model in zip(timeline, due, strict=True):
        assert model - MIN_SLEEP < arrived <= model + 1e-9
    # One timer per MIN_SLEEP of device time, not one per step.
    instants = {arrived for arrived, _ in timeline}
    assert len(instants) <= due[-1] / MIN_SLEEP + 2 < n / 10


async def _finish_times(engine: MockerEngine, count: int, p: int, n: int) -> list[float]:
    ends: list[float] = []

    async def one(i: int) -> None:
        chunks = await collect(engine, request(f"r{i}", prompt(p, start=1000 + i * p), n))
        assert len(tokens_of(chunks)) == n
        ends.append(trio.current_time())

    start = trio.current_time()
    async with running(engine), trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return sorted(end - start for end in ends)


async def test_continuous_batching_overlaps_requests(autojump_clock: object) -> None:
    count, p, n = 8, 100, 40
    (single,) = await _finish_times(agg(), 1, p, n)
    batched = await _finish_times(agg(), count, p, n)
    assert batched[-1] < 0.3 * count * single
    # One step prefills all eight prompts together, then they decode in lockstep.
    assert batched[0] == pytest.approx(batched[-1])


async def test_max_num_seqs_one_serializes(autojump_clock: object) -> None:
    count, p, n = 5, 100, 20
    (single,) = await _finish_times(agg(max_num_seqs=1), 1, p, n)
    ends = await _finish_times(agg(max_num_seqs=1), count, p, n)
    assert ends == pytest.approx([single * (i + 1) for i in range(count)])


async def test_long_prompt_is_prefilled_in_chunks(autojump_clock: object) -> None:
    engine = agg(max_num_batched_tokens=512)
    async with running(engine):
        timeline = await timed(engine, request("long", prompt(1300), 1))
    assert timeline[0][0] == pytest.approx((2 * prefill_ms(512) + prefill_ms(276)) / 1000)
    assert engine.counters.prefill_tokens_computed == 1300


async def test_running_stream_keeps_decoding_during_a_chunked_prefill(
    autojump_clock: object,
) -> None:
    engine = agg(max_num_batched_tokens=512)
    timelines: dict[str, list[tuple[float, Chunk]]] = {}

    async def run(req: GenerateRequest, delay: float) -> None:
        await trio.sleep(delay)
        timelines[req.request_id] = await timed(engine, req)

    async with running(engine), trio.open_nursery() as nursery:
        nursery.start_soon(run, request("short", prompt(10), 60), 0)
        nursery.start_soon(run, request("long", prompt(1300, start=50_000), 1), 0.05)
    # "long" needs three steps of 511 + 511 + 278 prompt tokens (one budget token goes
    # to "short" each step); "short" gets a token at the end of every one of them.
    assert timelines["long"][0][0] > 2 * prefill_ms(511) / 1000
    short = [t for t, _ in timelines["short"]]
    gaps = [b - a for a, b in itertools.pairwise(short)]
    assert max(gaps) == pytest.approx(prefill_ms(511) / 1000)


# ---- KV cache: prefix reuse, pressure, preemption ------------------------------------


async def test_shared_prefix_is_served_from_cache(autojump_clock: object) -> None:
    engine = agg()
    prefix = prompt(256, start=5000)
    async with running(engine):
        first = await collect(engine, request("a", prefix + prompt(100, start=9000), 4))
        second = await timed(engine, request("b", prefix + prompt(100, start=20000), 4))
    assert first[0].cached_tokens == 0
    assert all(c.cached_tokens == 256 for _, c in second)
    assert engine.counters.prefill_tokens_cached == 256
    assert engine.counters.prefill_tokens_computed == 356 + 100
    assert second[0][0] == pytest.approx(prefill_ms(100) / 1000)


async def test_request_waits_for_kv_blocks(autojump_clock: object) -> None:
    engine = agg(num_gpu_blocks=4)  # 256 tokens: one 200-token prompt at a time
    first_end: list[float] = []
    second_first: list[float] = []

    async def first() -> None:
        await collect(engine, request("a", prompt(200), 10))
        first_end.append(trio.current_time())

    async def second() -> None:
        start = trio.current_time()
        timeline = await timed(engine, request("b", prompt(200, start=9000), 10))
        second_first.append(start + timeline[0][0])

    async with running(engine), trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.sleep(0.01)
        nursery.start_soon(second)
        await trio.sleep(0.01)
        stats = engine.statistics()
        assert (stats.active_requests, stats.waiting_requests) == (1, 1)
        assert stats.kv_blocks_used == 4
    # Admitted only once the first request's blocks came back.
    assert second_first[0] == pytest.approx(first_end[0] + prefill_ms(200) / 1000)
    assert engine.statistics().kv_blocks_used == 0


async def test_preempted_sequence_recomputes_and_keeps_its_tokens(autojump_clock: object) -> None:
    reqs = [request("a", prompt(100), 60, seed=1), request("b", prompt(100, 7000), 60, seed=2)]
    reference = agg()
    async with running(reference):
        expected = [tokens_of(await collect(reference, r)) for r in reqs]

    tight = agg(num_gpu_blocks=4)  # both prompts fit, both outputs do not
    got: dict[str, list[Chunk]] = {}

    async def one(req: GenerateRequest) -> None:
        got[req.request_id] = await collect(tight, req)

    async with running(tight), trio.open_nursery() as nursery:
        for r in reqs:
            nursery.start_soon(one, r)
    assert tight.counters.preemptions >= 1
    assert [tokens_of(got["a"]), tokens_of(got["b"])] == expected
    assert all(got[k][-1].finish_reason is FinishReason.LENGTH for k in got)
    assert tight.statistics().kv_blocks_used == 0


async def test_sequence_that_outgrows_the_cache_finishes_length(autojump_clock: object) -> None:
    engine = agg(num_gpu_blocks=2)  # 128 tokens
    async with running(engine):
        chunks = await collect(engine, request("big", prompt(100), 100))
    assert len(tokens_of(chunks)) == 128 - 100 + 1
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert engine.statistics().kv_blocks_used == 0


def test_kv_cache_reuse_refcount_and_lru_eviction() -> None:
    cache = KvCache(num_blocks=4, block_size=2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]

    def usage() -> tuple[int, int]:
        stats = cache.statistics()
        return stats.used_blocks, stats.cached_free_blocks

    for tokens in (x, y):
        table = cache.allocate(tokens)
        assert table is not None
        assert table.cached_tokens == 0
        cache.commit(table, tokens, len(tokens))
        cache.free(table)
    assert usage() == (0, 4)

    # x was freed before y, and a sequence's tail before its head: x's tail goes first.
    other = cache.allocate([30, 31])
    assert other is not None
    assert other.cached_tokens == 0
    assert usage() == (1, 3)
    y1 = cache.allocate(y)
    assert y1 is not None
    assert y1.cached_tokens == 4
    assert usage() == (3, 1)
    # x's head is cached but its tail needs a block and none is left: no change.
    assert cache.allocate(x) is None
    assert usage() == (3, 1)
    cache.free(other)
    x1 = cache.allocate(x)
    assert x1 is not None
    assert x1.cached_tokens == 2
    assert usage() == (4, 0)

    # Shared blocks are ref-counted: a second holder costs nothing, the last frees.
    y2 = cache.allocate(y)
    assert y2 is not None
    assert y2.cached_tokens == 4
    assert usage() == (4, 0)
    cache.free(y1)
    assert usage() == (4, 0)
    cache.free(y2)
    cache.free(y2)  # idempotent
    assert usage() == (2, 2)


def kv_usage(cache: KvCache) -> tuple[int, int]:
    stats = cache.statistics()
    return stats.used_blocks, stats.cached_free_blocks


def kv_table(cache: KvCache, tokens: list[int], block_hashes: tuple[int, ...] = ()) -> BlockTable:
    table = cache.allocate(tokens, block_hashes)
    assert table is not None
    return table


def kv_cached_then_freed(cache: KvCache, tokens: list[int]) -> list[int]:
    """Allocate, compute and release *tokens*; return the blocks they used."""
    table = kv_table(cache, tokens)
    cache.commit(table, tokens, len(tokens))
    blocks = list(table.blocks)
    cache.free(table)
    return blocks


def test_kv_cache_bulk_allocation_evicts_least_recently_freed_and_forgets_them() -> None:
    cache = KvCache(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    a_blocks = kv_cached_then_freed(cache, a)
    kv_cached_then_freed(cache, b)
    assert kv_usage(cache) == (0, 5)  # one block never used

    # Three blocks: the never-used one, then the two least recently freed (a's tail).
    c = kv_table(cache, [20, 21, 22, 23, 24, 25])
    assert c.cached_tokens == 0
    assert c.blocks[1:] == [a_blocks[2], a_blocks[1]]
    assert kv_usage(cache) == (3, 3)
    cache.free(c)  # never committed: back to the free list, not cached
    assert kv_usage(cache) == (0, 3)

    # a's evicted blocks no longer hit; its head and all of b still do.
    a1 = kv_table(cache, a)
    assert a1.cached_tokens == 2
    assert a1.blocks[0] == a_blocks[0]
    assert kv_table(cache, b).cached_tokens == 4
    assert kv_usage(cache) == (5, 0)


def test_kv_cache_allocation_that_cannot_be_covered_changes_nothing() -> None:
    cache = KvCache(num_blocks=5, block_size=2)
    x = [1, 2, 3, 4]
    kv_cached_then_freed(cache, x)
    kv_table(cache, [9])  # held: 2 blocks left free, x's 2 cached
    before = cache.statistics()
    assert before == KvCacheStats(used_blocks=1, total_blocks=5, cached_free_blocks=2)

    # x's cached blocks are revived, not evicted: 3 more blocks needed, 2 available.
    assert cache.allocate([*x, 5, 6, 7, 8, 9, 10]) is None
    assert cache.statistics() == before

    # Exactly enough: x's two blocks plus the last two free ones.
    full = kv_table(cache, [*x, 5, 6, 7, 8])
    assert full.cached_tokens == 4
    after = cache.statistics()
    assert after == KvCacheStats(used_blocks=5, total_blocks=5, cached_free_blocks=0)
    assert cache.allocate([11]) is None
    assert not cache.append_slot(full)  # its 4 blocks are full
    assert full.num_tokens == 8
    assert cache.statistics() == after


def test_kv_cache_commit_in_chunks_registers_what_one_commit_does() -> None:
    tokens = list(range(100, 121))  # 10 full blocks of 2 and a partial one
    probes = [tokens, [*tokens[:8], 0, 0], tokens[:15], [100, 101, 0]]

    def hits(steps: list[int], allocated: int = len(tokens)) -> list[int]:
        """Cached tokens of each probe after committing *tokens* at *steps*, growing
        the table one slot per step past *allocated* tokens as decoding does."""
        cache = KvCache(num_blocks=32, block_size=2)
        table = kv_table(cache, tokens[:allocated])
        for n in steps:
            while table.num_tokens < n:
                assert cache.append_slot(table)
            cache.commit(table, tokens[: max(n, allocated)], n)
        return [kv_table(cache, probe).cached_tokens for probe in probes]

    at_once = hits([len(tokens)])
    assert at_once == [20, 8, 14, 2]
    assert hits([0, 5, 13, 21]) == at_once  # prefill chunks
    assert hits(list(range(len(tokens) + 1))) == at_once  # a block at a time
    assert hits(list(range(11, len(tokens) + 1)), allocated=11) == at_once  # decode steps
    assert hits([9]) == [8, 8, 8, 2]  # only computed blocks are registered


def test_kv_cache_prefix_hit_revives_a_freed_block_out_of_the_evictable_pool() -> None:
    cache = KvCache(num_blocks=4, block_size=2)
    x, y = [1, 2], [3, 4]
    [x_block] = kv_cached_then_freed(cache, x)
    [y_block] = kv_cached_then_freed(cache, y)
    assert kv_usage(cache) == (0, 2)

    again = kv_table(cache, [*x, 5])
    assert again.cached_tokens == 2
    assert again.blocks[0] == x_block
    assert kv_usage(cache) == (2, 1)  # x is held again, only y is evictable
    assert cache.allocate([6, 7, 8, 9, 10]) is None

    # Freed again, x is now newer than y: y goes first.
    cache.free(again)
    assert kv_usage(cache) == (0, 2)
    other = kv_table(cache, [6, 7, 8, 9, 10])
    assert other.blocks[2] == y_block
    assert x_block not in other.blocks
    cache.free(other)
    assert kv_table(cache, x).cached_tokens == 2
    assert kv_table(cache, y).cached_tokens == 0


def test_kv_cache_run_hashed_while_it_waits_keeps_its_place_in_the_eviction_order() -> None:
    # A freed prompt's unhashed run waits in the pool as one entry; a lookup hashes it
    # there and revives its head. Its other blocks must still go first, tail first, and
    # before anything freed after them.
    cache = KvCache(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    a_blocks = kv_cached_then_freed(cache, a)
    b_blocks = kv_cached_then_freed(cache, [20, 21, 22, 23])
    assert kv_usage(cache) == (0, 6)

    head = kv_table(cache, [1, 2, 3, 4, 99])
    assert head.blocks[:2] == a_blocks[:2]  # the run was hashed for this lookup
    assert kv_usage(cache) == (3, 4)

    new = kv_table(cache, [50, 51, 52, 53, 54, 55, 56, 57])
    assert new.blocks[1:] == [a_blocks[3], a_blocks[2], b_blocks[1]]
    cache.free(new)
    cache.free(head)
    assert kv_table(cache, [1, 2, 3, 4, 5, 6]).cached_tokens == 4
    assert kv_table(cache, [20, 21, 22, 23]).cached_tokens == 2


def test_kv_cache_carried_hashes_stand_in_for_hashing_the_prompt() -> None:
    tokens = list(range(100, 121))  # 10 full blocks of 2 and a partial one
    probes = [tokens, [*tokens[:8], 0, 0], tokens[:15], [100, 101, 0]]
    source = KvCache(num_blocks=32, block_size=2)
    table = kv_table(source, tokens)
    source.commit(table, tokens, 9)
    with pytest.raises(ValueError, match="committed"):
        source.prefix_hashes(table, len(tokens))
    source.commit(table, tokens, len(tokens))
    # Committed blocks get hashed when a lookup first comes for them, not before.
    assert source.prefix_hashes(table, len(tokens)) == ()
    assert kv_table(source, tokens[:5]).cached_tokens == 4
    carried = source.prefix_hashes(table, len(tokens))
    assert len(carried) == 10
    assert source.prefix_hashes(table, 9) == carried[:4]

    def computed(content: list[int], block_hashes: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Commit *content* given *block_hashes* in a fresh cache, free it; return each
        probe's cached tokens, and the chain the table ended with."""
        cache = KvCache(num_blocks=32, block_size=2)
        t = cache.allocate(content, block_hashes)
        assert t is not None
        cache.commit(t, content, len(content))
        cache.free(t)
        return [kv_table(cache, probe).cached_tokens for probe in probes], t.hashes

    hashed_here = computed(tokens, ())
    assert hashed_here == ([20, 8, 14, 2], list(carried))
    assert computed(tokens, carried) == hashed_here
    assert computed(tokens, carried[:4]) == hashed_here  # the rest hashed from the content
    # Carried hashes are taken as given: content never hashed still registers as *tokens*.
    garbage = [0] * len(tokens)
    assert computed(garbage, carried) == hashed_here
    assert computed(garbage, ())[0] == [0, 0, 0, 0]

    # Prefix hits: the known hashes first, then hashing on from the last of them.
    again = kv_table(source, tokens, carried[:4])
    assert again.cached_tokens == 20
    assert again.hashes == list(carried)
    assert kv_table(source, [*tokens[:8], 0, 0], carried[:4]).cached_tokens == 8


# ---- cancellation and shutdown ---------------------------------------------------------


async def test_closing_the_stream_frees_blocks(autojump_clock: object) -> None:
    engine = agg()
    async with running(engine):
        async with aclosing(engine.generate(request("r", prompt(500), 100))) as chunks:
            seen = 0
            async for _ in chunks:
                seen += 1
                if seen == 3:
                    assert engine.statistics().kv_blocks_used == math.ceil(503 / 64)
                    break
        stats = engine.statistics()
        assert (stats.kv_blocks_used, stats.active_requests) == (0, 0)
        assert engine.counters.requests_cancelled == 1
        # The engine carries on serving.
        after = await collect(engine, request("next", prompt(10), 3))
    assert len(tokens_of(after)) == 3


async def test_cancel_mid_step_and_while_queued(autojump_clock: object) -> None:
    engine = agg(max_num_seqs=1)
    async with running(engine):
        with trio.move_on_after(0.5 * prefill_ms(4000) / 1000):  # inside the prefill step
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, engine, request("running", prompt(4000), 50))
                await trio.sleep(0.001)
                nursery.start_soon(collect, engine, request("queued", prompt(50, 90000), 5))
                await trio.sleep(0.001)
                stats = engine.statistics()
                assert (stats.active_requests, stats.waiting_requests) == (1, 1)
        stats = engine.statistics()
        assert (stats.active_requests, stats.waiting_requests, stats.kv_blocks_used) == (0, 0, 0)
        assert engine.counters.requests_cancelled == 2
        assert engine.counters.prefill_tokens_computed == 0  # the step never completed


async def test_stopping_the_engine_fails_pending_requests(autojump_clock: object) -> None:
    engine = agg()
    engine_scope = trio.CancelScope()

    async def run_engine(task_status: trio.TaskStatus[None]) -> None:
        with engine_scope:
            await engine.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine)
        async with aclosing(engine.generate(request("r", prompt(10), 100))) as chunks:
            await chunks.__anext__()
            engine_scope.cancel()
            with pytest.raises(EngineError) as err:
                await chunks.__anext__()
    assert err.value.code == "shutting_down"
    assert engine.counters.requests_failed == 1
    assert engine.statistics().kv_blocks_used == 0
    with pytest.raises(EngineError, match="shut down"):
        await collect(engine, request("late", prompt(10), 1))


@pytest.mark.parametrize(
    ("token_ids", "sampling"),
    [
        ([], {}),
        (prompt(129), {}),  # the cache holds 128 tokens
        (prompt(10), {"max_tokens": 0}),
        (prompt(10), {"max_tokens": 4, "min_tokens": 5}),
        ([5, 2**32], {}),  # not a uint32: no token array can hold it
        ([-1, 5], {}),
    ],
)
async def test_invalid_requests(token_ids: list[int], sampling: dict[str, int]) -> None:
    engine = agg(num_gpu_blocks=2)
    sampling = {"max_tokens": 4, **sampling}
    with pytest.raises(EngineError) as err:
        await collect(engine, request("bad", token_ids, **sampling))  # type: ignore[arg-type]
    assert err.value.code == "invalid_request"


# ---- disaggregation --------------------------------------------------------------------


def disagg(**overrides: object) -> tuple[MockerEngine, MockerEngine, InProcessKvTransfer]:
    cfg = MockerConfig(kv_transfer_bandwidth=1e6, **overrides)  # type: ignore[arg-type]
    transfer = InProcessKvTransfer(bandwidth=cfg.kv_transfer_bandwidth)
    prefill = MockerEngine(cfg, Role.PREFILL, "prefill-0")
    decode = MockerEngine(cfg, Role.DECODE, "decode-0", kv_transfer=transfer)
    transfer.register("prefill-0", prefill)
    return prefill, decode, transfer


def test_kv_cache_pending_run_past_a_shared_prefix_keeps_only_its_own_tokens() -> None:
    """A committed run is hashed later from the tokens it keeps; past a cached prefix
    those are its own, not the whole prompt's (which would pin every prompt served)."""
    cache = KvCache(num_blocks=64, block_size=4)
    prefix = list(range(100, 140))  # 10 blocks
    kv_cached_then_freed(cache, prefix)
    tokens = [*prefix, *range(7, 16)]  # two more full blocks and a partial one
    table = kv_table(cache, tokens)
    assert table.cached_tokens == 40
    cache.commit(table, tokens, len(tokens))
    [run] = cache._pending.values()
    assert list(run.tokens) == tokens[40:]
    cache.free(table)
    assert kv_table(cache, tokens[:48]).cached_tokens == 48  # and they hash right


class EagerKvCache:
    """The cache's contract written naively: every committed full block is hashed and
    registered at once, one block and one list scan at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free_list = list(range(num_blocks))
        self.lru: list[int] = []  # unreferenced registered blocks, least recently freed first

    def chain(self, tokens: list[int], num_blocks: int) -> list[int]:
        h, out = 0, []
        for i in range(num_blocks):
            h = hash((h, hash(tuple(tokens[i * self.bs : (i + 1) * self.bs]))))
            out.append(h)
        return out

    def take(self) -> int:
        if self.free_list:
            block = self.free_list.pop()
        else:
            block = self.lru.pop(0)
            evicted = self.hash_of[block]
            assert evicted is not None
            del self.by_hash[evicted]
            self.hash_of[block] = None
        self.refcount[block] = 1
        return block

    def allocate(self, tokens: list[int]) -> dict[str, int | list[int]] | None:
        hits = []
        for h in self.chain(tokens, len(tokens) // self.bs):
            if h not in self.by_hash:
                break
            hits.append(self.by_hash[h])
        needed = -(-len(tokens) // self.bs) - len(hits)
        revived = sum(self.refcount[b] == 0 for b in hits)
        if needed > len(self.free_list) + len(self.lru) - revived:
            return None
        for block in hits:
            if self.refcount[block] == 0:
                self.lru.remove(block)
            self.refcount[block] += 1
        blocks = hits + [self.take() for _ in range(needed)]
        return {"blocks": blocks, "tokens": len(tokens), "committed": len(hits)}

    def append_slot(self, table: dict[Any, Any]) -> bool:
        if table["tokens"] == len(table["blocks"]) * self.bs:
            if not self.free_list and not self.lru:
                return False
            table["blocks"].append(self.take())
        table["tokens"] += 1
        return True

    def commit(self, table: dict[Any, Any], tokens: list[int], num_computed: int) -> None:
        full = min(num_computed, table["tokens"]) // self.bs
        for i, h in enumerate(self.chain(tokens, full)):
            if i >= table["committed"] and h not in self.by_hash:
                self.by_hash[h] = table["blocks"][i]
                self.hash_of[table["blocks"][i]] = h
        table["committed"] = max(full, table["committed"])

    def free(self, table: dict[Any, Any]) -> None:
        for block in reversed(table["blocks"]):
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                (self.free_list if self.hash_of[block] is None else self.lru).append(block)
        table["blocks"] = []

    def statistics(self) -> KvCacheStats:
        cached = len(self.lru)
        return KvCacheStats(self.num_blocks - len(self.free_list) - cached, self.num_blocks, cached)


@pytest.mark.parametrize("num_blocks", [12, 40])
@pytest.mark.parametrize("seed", range(6))
def test_kv_cache_hashing_lazily_hits_and_evicts_as_eager_hashing_would(
    seed: int, num_blocks: int
) -> None:
    """Random traffic with shared prefixes, chunked prefill, decode steps, preemption
    and eviction: the lazily hashing cache agrees with the naive eager one on every
    lookup's hits and on block usage after every operation."""
    rng = random.Random(seed)
    bs = 4
    lazy, eager = KvCache(num_blocks, block_size=bs), EagerKvCache(num_blocks, bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    live: list[tuple[BlockTable, dict[Any, Any], list[int], int]] = []  # tables, tokens, computed
    for _ in range(1500):
        op = rng.random()
        if op < 0.35 or not live:
            tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(12)))]
            tokens = tokens or [1]
            table, ref = lazy.allocate(tokens), eager.allocate(tokens)
            assert (table is None) == (ref is None)
            if table is not None and ref is not None:
                assert table.cached_tokens == ref["committed"] * bs
                live.append((table, ref, tokens, table.cached_tokens))
        else:
            i = rng.randrange(len(live))
            table, ref, tokens, computed = live[i]
            if op < 0.6:  # a prefill chunk, or a decode step that fills a slot first
                if computed >= len(tokens):
                    assert lazy.append_slot(table) == eager.append_slot(ref)
                    if table.num_tokens > len(tokens):
                        tokens = [*tokens, rng.randrange(50)]  # a new list, as callers may
                computed = min(len(tokens), computed + rng.randrange(1, 3 * bs))
                lazy.commit(table, tokens, computed)
                eager.commit(ref, tokens, computed)
                live[i] = (table, ref, tokens, computed)
            else:  # finished, cancelled or preempted
                lazy.free(table)
                eager.free(ref)
                del live[i]
        assert lazy.statistics() == eager.statistics()


async def test_disaggregated_request_flows_through_kv_handle(autojump_clock: object) -> None:
    prefill, decode, _ = disagg()
    p, n = 1000, 16
    async with running(prefill, decode):
        (chunk,) = await collect(prefill, request("r", prompt(p), n))
        handle = chunk.kv_handle
        assert handle is not None
        assert (handle.worker_id, handle.address, handle.num_tokens) == (
            "prefill-0",
            "memory://prefill-0",
            p,
        )
        assert chunk.token_ids == []
        held = prefill.statistics()
        assert (held.kv_transfers_held, held.kv_blocks_used) == (1, math.ceil(p / 64))

        timeline = await timed(decode, request("r", prompt(p), n, kv_handle=handle))
    copy = p * decode.config.kv_bytes_per_token / 1e6
    cap = decode.config.kv_capacity_tokens
    assert timeline[0][0] == pytest.approx(copy + decode_ms(p / cap) / 1000)
    assert len(tokens_of([c for _, c in timeline])) == n
    assert timeline[-1][1].finish_reason is FinishReason.LENGTH
    assert decode.counters.prefill_tokens_computed == 0
    assert prefill.counters.prefill_tokens_computed == p
    released = prefill.statistics()
    assert (released.kv_transfers_held, released.kv_blocks_used) == (0, 0)
    assert prefill.counters.transfers_released == 1


async def test_engines_never_write_into_the_request_token_array(autojump_clock: object) -> None:
    # The pipeline hands the same array to the prefill and the decode leg (and keeps it
    # for a migration): decoding must append to a copy of its own.
    prefill, decode, _ = disagg()
    ids = token_array(prompt(300))
    before = ids.tobytes()
    async with running(prefill, decode):
        (chunk,) = await collect(prefill, request("r", ids, 8))
        out = await collect(decode, request("r", ids, 8, kv_handle=chunk.kv_handle))
    assert len(tokens_of(out)) == 8
    assert ids.tobytes() == before


async def test_decode_engine_registers_the_prompt_hashes_the_prefill_engine_carried(
    autojump_clock: object,
) -> None:
    cfg = MockerConfig(kv_transfer_bandwidth=1e6, publish_kv_events=False)  # lazy hashing
    transfer = InProcessKvTransfer(bandwidth=cfg.kv_transfer_bandwidth)
    prefill = MockerEngine(cfg, Role.PREFILL, "prefill-0")
    transfer.register("prefill-0", prefill)
    decodes = [
        MockerEngine(cfg, Role.DECODE, f"decode-{i}", kv_transfer=transfer) for i in range(4)
    ]
    p = 1000  # 15 full blocks of 64 and a partial one
    reference = KvCache(cfg.num_gpu_blocks, cfg.block_size)
    table = kv_table(reference, prompt(p))
    reference.commit(table, prompt(p), p)
    async with running(prefill, *decodes):
        handles = []
        for i in range(len(decodes) + 1):
            (chunk,) = await collect(prefill, request(f"p{i}", prompt(p), 4))
            assert chunk.kv_handle is not None
            handles.append(chunk.kv_handle)
        # The first prefill hashed nothing (a prompt's blocks are hashed when a lookup
        # first comes for them); the later ones found the prompt cached, hashing it.
        first, *handles = handles
        assert first.block_hashes == ()
        assert reference.prefix_hashes(table, p) == ()
        kv_table(reference, prompt(p))  # a lookup: the reference hashes its blocks too
        assert handles[0].block_size == 64
        assert handles[0].block_hashes == reference.prefix_hashes(table, p)
        assert len(handles[0].block_hashes) == p // 64
        legs = [
            handles[0],
            replace(handles[1], block_hashes=(), block_size=0),  # as an older peer sends it
            replace(handles[2], block_hashes=tuple(range(p // 32)), block_size=32),  # ignored
            replace(handles[3], block_hashes=tuple(range(p // 64))),  # wrong, yet used
        ]
        for decode, handle in zip(decodes, legs, strict=True):
            chunks = await collect(decode, request("r", prompt(p), 4, kv_handle=handle))
            assert len(tokens_of(chunks)) == 4
            assert decode.counters.prefill_tokens_computed == 0
        # A later request extending the prompt finds its full blocks cached, unless the
        # decode engine registered them under the wrong hashes it was handed.
        cached = []
        for decode in decodes:
            chunks = await collect(decode, request("again", prompt(p + 100), 2))
            cached.append(chunks[0].cached_tokens)
    assert cached == [960, 960, 960, 0]


async def test_each_held_transfer_expires_at_its_own_deadline(autojump_clock: object) -> None:
    prefill, _, _ = disagg(kv_transfer_timeout=5.0)
    async with running(prefill):
        start = trio.current_time()
        (a,) = await collect(prefill, request("a", prompt(100), 4))
        assert a.kv_handle is not None
        await trio.sleep(1.0)
        await prefill.release_transfer(a.kv_handle.transfer_id)  # pulled: never expires
        await trio.sleep(1.0)
        await collect(prefill, request("b", prompt(100), 4))
        await trio.sleep_until(start + 5.1)  # a's deadline is past; b has 2 s to go
        assert prefill.statistics().kv_transfers_held == 1
        assert prefill.counters.transfers_expired == 0
        await trio.sleep_until(start + 7.1)
        assert prefill.statistics().kv_transfers_held == 0
        assert prefill.counters.transfers_expired == 1
        # The expiry task waits for the next hold once none is left.
        await collect(prefill, request("c", prompt(100), 4))
        await trio.sleep(5.1)
        assert prefill.counters.transfers_expired == 2
        assert prefill.statistics().kv_blocks_used == 0


async def test_unpulled_transfer_expires(autojump_clock: object) -> None:
    prefill, decode, _ = disagg(kv_transfer_timeout=5.0)
    async with running(prefill, decode):
        (chunk,) = await collect(prefill, request("r", prompt(100), 4))
        assert chunk.kv_handle is not None
        await trio.sleep(4.9)
        assert prefill.statistics().kv_transfers_held == 1
        await trio.sleep(0.2)
        stats = prefill.statistics()
        assert (stats.kv_transfers_held, stats.kv_blocks_used) == (0, 0)
        assert prefill.counters.transfers_expired == 1
        with pytest.raises(EngineError) as err:
            await collect(decode, request("r", prompt(100), 4, kv_handle=chunk.kv_handle))
    assert err.value.code == "kv_transfer_failed"
    assert decode.counters.requests_failed == 1
    assert decode.statistics().kv_blocks_used == 0


async def test_pulling_unknown_transfer_or_worker_fails(autojump_clock: object) -> None:
    prefill, _, transfer = disagg()
    async with running(prefill):
        for handle in (
            KvHandle("prefill-0", "memory://prefill-0", "no-such-transfer", 10),
            KvHandle("ghost", "memory://ghost", "t", 10),
        ):
            with pytest.raises(EngineError) as err:
                await transfer.pull(handle)
            assert err.value.code == "kv_transfer_failed"


async def test_handles_go_only_where_they_can_be_used() -> None:
    prefill, _, _ = disagg()
    lonely = MockerEngine(MockerConfig(), Role.DECODE, "decode-1")  # no KV transfer
    handle = KvHandle("prefill-0", "memory://prefill-0", "t", 10)
    with pytest.raises(EngineError) as err:
        await collect(prefill, request("r", prompt(10), 4, kv_handle=handle))
    assert err.value.code == "invalid_request"
    with pytest.raises(EngineError) as err:
        await collect(lonely, request("r", prompt(10), 4, kv_handle=handle))
    assert err.value.code == "kv_transfer_failed"


async def test_prefill_cancelled_before_handing_over_holds_nothing(
    autojump_clock: object,
) -> None:
    prefill, _, _ = disagg()
    async with running(prefill):
        with trio.move_on_after(0.5 * prefill_ms(1000) / 1000):
            await collect(prefill, request("r", prompt(1000), 4))
        stats = prefill.statistics()
        assert (stats.kv_transfers_held, stats.kv_blocks_used) == (0, 0)
        assert prefill.counters.requests_cancelled == 1


# ---- output tokens -----------------------------------------------------------------------


async def test_tokens_are_deterministic_per_seed(autojump_clock: object) -> None:
    engine = agg()

    async def run(rid: str, seed: int | None) -> list[int]:
        return tokens_of(await collect(engine, request(rid, prompt(20), 64, seed=seed)))

    async with running(engine):
        a, a2, b = await run("x", 7), await run("y", 7), await run("z", 8)
        n1, n1_again, n2 = await run("id-1", None), await run("id-1", None), await run("id-2", None)
    assert a == a2
    assert a != b
    assert n1 == n1_again
    assert n1 != n2
    assert all(3 <= t < 128000 for t in a + b + n1 + n2)


async def test_tokens_stay_in_the_configured_range(autojump_clock: object) -> None:
    engine = agg(output_token_low=3, output_token_high=6)
    async with running(engine):
        out = tokens_of(await collect(engine, request("r", prompt(5), 200, seed=3)))
    assert set(out) == {3, 4, 5}


async def test_answers_end_with_eos_at_a_length_drawn_from_their_seed(
    autojump_clock: object,
) -> None:
    engine = agg(mean_output_tokens=20, output_length_sigma=0.5)
    outs = []
    async with running(engine):
        for seed in range(64):
            chunks = await collect(
                engine, request(f"r{seed}", prompt(5), 1000, eos=(EOS,), seed=seed)
            )
            out = tokens_of(chunks)
            assert out[-1] == EOS
            assert EOS not in out[:-1]
            assert chunks[-1].finish_reason is FinishReason.STOP
            outs.append(out)
        # The same seed under another id (another worker, a rerun): the same answer.
        again = tokens_of(
            await collect(engine, request("again", prompt(5), 1000, eos=(EOS,), seed=3))
        )
        capped = await collect(engine, request("c", prompt(5), 2, eos=(EOS,), seed=5))
        floor = tokens_of(
            await collect(engine, request("m", prompt(5), 1000, eos=(EOS,), seed=1, min_tokens=50))
        )
        ignored = await collect(
            engine, request("i", prompt(5), 100, eos=(EOS,), seed=1, ignore_eos=True)
        )
        no_eos = await collect(engine, request("n", prompt(5), 100, seed=1))
    lengths = [len(out) for out in outs]
    assert sum(lengths) / len(lengths) == pytest.approx(20, rel=0.15)
    assert len(set(lengths)) > 10
    assert again == outs[3]
    # max_tokens still caps a longer answer: "length", exactly max_tokens.
    assert lengths[5] > 2
    assert len(tokens_of(capped)) == 2
    assert capped[-1].finish_reason is FinishReason.LENGTH
    # min_tokens holds EOS back: EOS is the 51st token.
    assert lengths[1] <= 51
    assert len(floor) == 51
    assert floor[-1] == EOS
    # ignore_eos: exactly max_tokens, no EOS, as a benchmark needs.
    assert len(tokens_of(ignored)) == 100
    assert EOS not in tokens_of(ignored)
    assert ignored[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(no_eos)) == 100


async def test_a_greedy_answers_length_comes_from_its_prompt(autojump_clock: object) -> None:
    # Every greedy request shares one stream key; its length is its prompt's, as a
    # model's answer at temperature 0 is, not one length for all.
    engine = agg(mean_output_tokens=20, output_length_sigma=0.5)

    async def length(rid: str, start: int, seed: int) -> int:
        req = request(rid, prompt(8, start), 1000, eos=(EOS,), seed=seed, temperature=0.0)
        return len(tokens_of(await collect(engine, req)))

    async with running(engine):
        same = {await length(f"s{seed}", 1000, seed) for seed in range(4)}
        others = {await length(f"p{start}", start, 0) for start in range(2000, 2080, 8)}
    assert len(same) == 1  # the seed does not matter at temperature 0
    assert len(others) > 3  # the prompt does


async def test_mean_output_tokens_0_runs_every_answer_to_max_tokens(
    autojump_clock: object,
) -> None:
    engine = agg(mean_output_tokens=0)
    async with running(engine):
        chunks = [
            await collect(engine, request(f"r{s}", prompt(5), 300, eos=(EOS,), seed=s))
            for s in range(8)
        ]
    assert all(len(tokens_of(c)) == 300 for c in chunks)
    assert all(c[-1].finish_reason is FinishReason.LENGTH for c in chunks)


async def test_the_default_answer_ends_long_before_the_context_length(
    autojump_clock: object,
) -> None:
    # What a client that sets no max_tokens meets: the frontend asks for the context
    # length (131,072 tokens, ~13 min of decode at real speed); a model stops by itself.
    engine = agg()
    async with running(engine):
        start = trio.current_time()
        chunks = await collect(engine, request("r", prompt(20), 131_072, eos=(EOS,), seed=7))
        took = trio.current_time() - start
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert len(tokens_of(chunks)) == 141  # seed 7's draw (test_mocker_scheduler pins it)
    assert took < 2.0  # virtual seconds at real GPU speed (speedup 1)


async def test_stop_token_ids_stop_after_min_tokens(autojump_clock: object) -> None:
    engine = agg()
    async with running(engine):
        base = tokens_of(await collect(engine, request("a", prompt(5), 30, seed=11)))
        index = next(i for i in range(3, 30) if base.count(base[i]) == 1)
        stop = (base[index],)
        stopped = await collect(engine, request("b", prompt(5), 30, seed=11, stop_token_ids=stop))
        late = await collect(
            engine,
            request("c", prompt(5), 30, seed=11, stop_token_ids=stop, min_tokens=index + 1),
        )
    assert tokens_of(stopped) == base[: index + 1]
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert tokens_of(late) == base
    assert late[-1].finish_reason is FinishReason.LENGTH


def test_package_exports() -> None:
    import workers.engines.mocker as mocker

    assert sorted(mocker.__all__) == ["MockerConfig", "MockerCounters", "MockerEngine"]
    assert all(getattr(mocker, name).__doc__ for name in mocker.__all__)
