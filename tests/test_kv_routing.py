"""KV-aware routing: the events a mocker's cache publishes, the index they feed, the
cost, approximate mode's expiry, and the index against the mocker's real cache."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from frontend import choices
from frontend.router import Router, dispatch
from frontend.router.kv_index import KvIndex, chain_hashes, prompt_hashes
from frontend.router.kv_routing import ApproxIndex, Candidate, KvConfig, choose
from frontend.router.router import Prompt
from frontend.server import Frontend
from headwater.plane.base import WorkerInstance
from headwater.wire import Role, WorkerLoad
from headwater.wire.codec import FrameDecoder, encode
from headwater.wire.frames import KvEvents
from headwater.wire.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventLog,
)
from headwater.wire.tokens import token_array
from workers.engines.mocker.kv_cache import KvCache

from frontend_fixture import serve_frontend

BS = 4


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def stored(ids: tuple[int, ...], parent: int | None, pos: int, toks: list[int]) -> BlockStored:
    return BlockStored(ids, parent, pos, token_array(toks), BS)


def batch(start: int, *events: object, dump: bool = False) -> KvEventBatch:
    """Events numbered from *start*; a dump's reading goes on from *start* (as a
    worker's log numbers them: a dump is not numbered)."""
    end = start if dump else start + len(events)
    return KvEventBatch(start, end, tuple(events), dump=dump)  # type: ignore[arg-type]


# -- the hash -----------------------------------------------------------------------


def test_the_hash_chains_whole_blocks_only() -> None:
    t = tokens(10)
    hashes = chain_hashes(t, BS)
    assert len(hashes) == 2  # the partial third block is never hashed
    assert chain_hashes(t[4:8], BS, hashes[0]) == hashes[1:]
    assert chain_hashes(tokens(8, 101), BS)[0] != hashes[0]
    # A block's hash names its prefix: the same tokens after another parent differ.
    assert chain_hashes(t[4:8], BS)[0] != hashes[1]


# -- the index ------------------------------------------------------------------------


def test_stored_removed_cleared() -> None:
    index = KvIndex(BS)
    t = tokens(12)
    h = prompt_hashes(t, BS)
    assert index.apply("w", batch(0, stored((7, 8), None, 0, t[:8]), dump=True))
    assert index.overlaps(h) == {"w": 2}
    assert index.apply("w", batch(0, stored((9,), 8, 2, t[8:12])))
    assert index.overlaps(h) == {"w": 3}
    assert index.apply("w", batch(1, BlockRemoved((8,))))
    assert index.overlaps(h) == {"w": 1}  # the walk stops at the missing block
    assert index.apply("w", batch(2, AllCleared()))
    assert index.overlaps(h) == {}
    assert index.blocks_of("w") == 0


def test_a_gap_waits_for_a_dump_which_replaces_all() -> None:
    index = KvIndex(BS)
    t = tokens(8)
    h = prompt_hashes(t, BS)
    assert index.next_seq("w") == -1  # a new worker: dump first
    index.apply("w", batch(0, stored((1,), None, 0, t[:4]), dump=True))
    assert index.next_seq("w") == 0
    assert not index.apply("w", batch(5, stored((2,), 1, 1, t[4:8])))  # 0..4 missed
    assert index.next_seq("w") == -1
    assert index.overlaps(h) == {"w": 1}  # what was known stands meanwhile
    index.apply("w", KvEventBatch(9, 9, (AllCleared(), stored((2, 3), None, 0, t)), dump=True))
    assert index.overlaps(h) == {"w": 2}
    assert index.next_seq("w") == 9


def test_a_worker_that_leaves_takes_its_blocks() -> None:
    index = KvIndex(BS)
    t = tokens(8)
    for w in ("a", "b"):
        index.apply(w, batch(0, stored((1, 2), None, 0, t), dump=True))
    index.apply("b", batch(0, stored((3,), 2, 2, tokens(4, 900))))
    index.remove_worker("a")
    assert index.overlaps(prompt_hashes(t, BS)) == {"b": 2}
    assert index.statistics().blocks == 3


def test_orphans_and_other_block_sizes_are_dropped() -> None:
    index = KvIndex(BS)
    index.apply(
        "w",
        batch(
            0, stored((5,), 99, 3, tokens(4)), BlockStored((6,), None, 0, tokens(8), 8), dump=True
        ),
    )
    assert index.statistics().blocks == 0
    assert index.statistics().orphans == 1
    assert index.statistics().mismatched == 1


def test_events_survive_the_wire() -> None:
    b = batch(3, stored((1, -2), None, 0, tokens(8)), BlockRemoved((5,)), AllCleared())
    (frame,) = list(FrameDecoder().feed(encode(KvEvents(7, b))))
    assert isinstance(frame, KvEvents)
    assert frame.seq == 7
    assert frame.batch == b


def test_the_log_is_bounded_and_reports_gaps() -> None:
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.publish(BlockRemoved((i,)))
    assert log.read(0).gap  # 0 and 1 were dropped
    got = log.read(2, limit=2)
    assert (got.start, got.end, got.events) == (2, 4, (BlockRemoved((2,)), BlockRemoved((3,))))
    assert log.read(5).events == ()
    dump = log.read(-1)
    assert dump.dump
    assert dump.end == 5
    assert dump.events == (AllCleared(),)


# -- the choice -------------------------------------------------------------------------


def test_cost_prefers_the_cache_until_load_outweighs_it() -> None:
    cfg = KvConfig()
    rng = random.Random(0)
    a = Candidate("a", overlap=8, active_blocks=0)
    b = Candidate("b", overlap=0, active_blocks=0)
    assert choose([a, b], 10, cfg, rng) is a  # 2 blocks to prefill against 10
    loaded = Candidate("a", overlap=8, active_blocks=9)  # 2 + 9 > 10 + 0
    assert choose([loaded, b], 10, cfg, rng) is b
    heavy = KvConfig(prefill_load_scale=2.0)  # 4 + 9 < 20
    assert choose([loaded, b], 10, heavy, rng) is loaded


def test_ties_break_at_random_and_temperature_samples() -> None:
    rng = random.Random(0)
    same = [Candidate(w, 0, 0) for w in "abc"]
    assert {choose(same, 4, KvConfig(), rng).worker_id for _ in range(60)} == {"a", "b", "c"}
    warm = KvConfig(temperature=1.0)
    cands = [Candidate("a", 10, 0), Candidate("b", 0, 0)]
    picks = [choose(cands, 10, warm, rng).worker_id for _ in range(400)]
    assert 0 < picks.count("b") < picks.count("a")  # sampled, the cheaper more often


async def test_approximate_mode_forgets_after_its_ttl(autojump_clock: object) -> None:
    approx = ApproxIndex(ttl=120.0)
    h = prompt_hashes(tokens(12), BS)
    approx.record("w", h)
    await trio.sleep(119)
    assert approx.overlaps(h) == {"w": 3}
    approx.record("v", h[:1])
    await trio.sleep(2)
    assert approx.overlaps(h) == {"v": 1}  # w's entry expired, v's is fresh
    await trio.sleep(120)
    approx.record("x", ())
    assert approx.overlaps(h) == {}
    assert approx.blocks_of("v") == 0


class _Stub:
    def __init__(self, worker_id: str, role: Role) -> None:
        self.instance = WorkerInstance(worker_id, role, "m", f"memory://{worker_id}")
        self.load: WorkerLoad | None = None


async def test_router_kv_follows_the_prefix_and_decode_by_load() -> None:
    router = Router(
        "kv", rng=random.Random(3), kv=KvConfig(block_size=BS, events=choices.KvEvents.OFF)
    )
    for wid, role in (("a0", Role.AGG), ("a1", Role.AGG), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        router.add(_Stub(wid, role))  # type: ignore[arg-type]
    t = tokens(64)
    p = Prompt(len(t), prompt_hashes(t, BS))
    first = router.pick(Role.AGG, "m", prompt=p).instance.worker_id
    for _ in range(5):  # approximate mode remembers where the prefix went
        assert router.pick(Role.AGG, "m", prompt=p).instance.worker_id == first
    stats = router.kv_statistics()
    assert stats.routed == 6
    assert stats.overlap_blocks == 5 * 16
    busy = next(c for c in router.clients() if c.instance.worker_id == "d0")
    with router.track(busy, blocks=10):
        assert {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(10)} == {"d1"}
    view = {v.worker_id: v for v in router.views()}
    assert view[first].cached_blocks == 16
    assert view[first].cache_view == "approximate"


# -- the index against the mocker's real cache -------------------------------------------


def test_index_agrees_with_each_mockers_cache_after_random_traffic() -> None:
    """Random requests over shared prefixes on small caches (so blocks are evicted),
    events carried to the index in random-sized polls; after each step every worker's
    overlap in the index equals what its cache would find."""
    rng = random.Random(31)
    workers = {
        f"w{i}": KvCache(num_blocks=24, block_size=BS, events=KvEventLog(64)) for i in range(3)
    }
    index = KvIndex(BS)
    prefixes = [tokens(rng.randrange(4, 40), 1000 * k) for k in range(6)]
    probes: list[list[int]] = []
    live: dict[str, list[object]] = {w: [] for w in workers}
    dumps = 0
    for w in workers:  # the router subscribes as each worker registers, before traffic
        index.apply(w, workers[w].events.read(index.next_seq(w)))  # type: ignore[union-attr]
        dumps += 1
    for _ in range(300):
        wid = rng.choice(list(workers))
        cache = workers[wid]
        prompt = rng.choice(prefixes) + tokens(rng.randrange(0, 20), rng.randrange(10**6))
        table = cache.allocate(prompt)
        if table is not None:
            cache.commit(table, prompt, rng.randrange(len(prompt) + 1))
            live[wid].append(table)
            probes.append(prompt)
        while live[wid] and (table is None or rng.random() < 0.5):
            cache.free(live[wid].pop(rng.randrange(len(live[wid]))))  # type: ignore[arg-type]
            table = None if not live[wid] else table
            break
        for w, c in workers.items():  # each worker's feed, read in random-sized polls
            assert c.events is not None
            while True:
                since = index.next_seq(w)
                dumps += since < 0
                got = c.events.read(since, rng.randrange(1, 8))
                index.apply(w, got)
                if not got.gap and index.next_seq(w) == c.events.next_seq:
                    break
        for probe in rng.sample(probes, min(5, len(probes))):
            found = index.overlaps(prompt_hashes(probe, BS))
            for w, c in workers.items():
                assert found.get(w, 0) == c.cached_prefix(probe), (w, probe[:3])
    assert dumps >= 3  # every worker dumped once at least (a small ring may force more)


# -- end to end: the router follows real workers over both transports ---------------------


async def test_router_follows_workers_events_over_tcp_and_memory(nursery: trio.Nursery) -> None:
    from functools import partial

    from headwater.plane.client import connect_worker
    from headwater.plane.memory import MemoryWorkerClient
    from headwater.wire import GenerateRequest, SamplingParams
    from workers.engines.mocker import MockerConfig, MockerEngine
    from workers.lifecycle import WorkerConfig, serve_worker

    from helpers import start_runtime

    fast = MockerConfig(speedup_ratio=100_000.0)
    worker = await nursery.start(
        partial(serve_worker, WorkerConfig(role=Role.AGG, engine_config=fast))
    )
    tcp = await connect_worker(
        WorkerInstance(worker.worker_id, Role.AGG, worker.model, worker.address), nursery
    )
    runtime = await start_runtime(nursery, MockerEngine(fast, Role.AGG, "mem"), "mem")
    mem = MemoryWorkerClient(WorkerInstance("mem", Role.AGG, worker.model, "memory://mem"), runtime)
    router = Router("kv", kv=KvConfig(poll_interval=0.01))
    router.add(tcp)
    router.add(mem)
    await nursery.start(router.run)
    prompts = {tcp: tokens(200, 5000), mem: tokens(300, 9000)}
    for client, toks in prompts.items():
        req = GenerateRequest(
            f"r-{client.instance.worker_id}",
            worker.model,
            toks,
            SamplingParams(max_tokens=2, ignore_eos=True),
        )
        async with client.stream(req) as chunks:
            async for _ in chunks:
                pass
    want = {tcp: 3, mem: 4}  # full blocks of 64 among the prompt's tokens
    with trio.fail_after(10):
        while any(
            router.kv_index.overlaps(prompt_hashes(t, 64)).get(c.instance.worker_id) != want[c]
            for c, t in prompts.items()
        ):
            await trio.sleep(0.01)
    p = Prompt(300, prompt_hashes(prompts[mem], 64))
    assert router.pick(Role.AGG, worker.model, prompt=p) is mem
    stats = router.kv_statistics()
    assert stats.dumps >= 2
    assert stats.events >= 2
    router.remove(mem.instance.worker_id)
    with trio.fail_after(5):
        while router.kv_index.blocks_of("mem"):
            await trio.sleep(0.01)


def test_a_cache_publishes_from_its_first_reader_on() -> None:
    """Publishing costs the mocker eager hashing, so it waits for a reader: unread, the
    log stays empty and runs stay pending; what was registered before the first read is
    neither announced nor, when evicted, reported removed; what comes after is."""
    log = KvEventLog(64)
    cache = KvCache(num_blocks=8, block_size=BS, events=log)
    before = tokens(3 * BS, 0)
    table = cache.allocate(before)
    assert table is not None
    cache.commit(table, before, len(before))
    cache.free(table)
    assert log.next_seq == 0  # nothing published
    assert cache._pending  # nothing hashed: the run waits
    index = KvIndex(BS)
    index.apply("w", log.read(index.next_seq("w")))  # the first read: a dump
    assert not cache._pending  # hashed at the switch, unannounced
    assert index.overlaps(prompt_hashes(before, BS)) == {}
    assert cache.cached_prefix(before) == 3  # still cached all the same
    after = tokens(3 * BS, 500)
    table = cache.allocate(after)
    assert table is not None
    cache.commit(table, after, len(after))
    cache.free(table)
    index.apply("w", log.read(index.next_seq("w")))
    assert index.overlaps(prompt_hashes(after, BS)) == {"w": 3}
    evicting = tokens(8 * BS, 9000)  # the whole cache: both prompts' blocks go
    table = cache.allocate(evicting)
    assert table is not None
    batch = log.read(index.next_seq("w"))
    removed = [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_ids]
    assert len(removed) == 3  # the announced prompt's blocks only
    index.apply("w", batch)
    assert index.overlaps(prompt_hashes(after, BS)) == {}


async def test_kv_routing_counters_are_on_the_metrics_page() -> None:
    """``--router kv``'s counters on /metrics: a prompt sent twice is routed twice, the
    second time with its blocks found cached (the first answer's events were read)."""

    def counters(text: str) -> dict[str, float]:
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("headwater_frontend_kv_")
        }

    words = " ".join(f"river{i}" for i in range(400))  # several 64-token blocks
    body = {
        "model": "deepseek-v4",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": words}],
    }
    async with (
        serve_frontend(router="kv") as (frontend, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        before = counters((await client.get("/metrics")).text)
        assert before["headwater_frontend_kv_routed_requests_total"] == 0
        router = frontend.router
        with trio.fail_after(10):  # the router subscribed to each worker: a dump each
            while router.kv_statistics().dumps < len(router.clients()):
                await trio.sleep(0.02)
        dumped = router.kv_statistics().events  # the dumps' "all cleared" events
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        with trio.fail_after(10):  # the stored blocks reach the index at the next poll
            while router.kv_statistics().events == dumped:
                await trio.sleep(0.02)
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        after = counters((await client.get("/metrics")).text)
        page = (await client.get("/dashboard/data")).json()
    assert page["routing"]["policy"] == "kv"
    assert page["routing"]["routed"] == 2
    assert page["routing"]["overlap_blocks"] == after["headwater_frontend_kv_overlap_blocks_total"]
    assert any(w["cached_blocks"] > 0 for w in page["workers"])
    assert after["headwater_frontend_kv_routed_requests_total"] == 2
    overlap = after["headwater_frontend_kv_overlap_blocks_total"]
    assert overlap >= 400 // 64  # the second request found the prompt's blocks
    assert after["headwater_frontend_kv_prefill_tokens_saved_total"] == overlap * 64
    # Two requests of the same prompt: the first found nothing, the second all its full
    # blocks, so the hit rate (overlap over prompt blocks, ceil'd) is just under a half.
    prompt_blocks = after["headwater_frontend_kv_prompt_blocks_total"]
    assert page["routing"]["prompt_blocks"] == prompt_blocks
    assert overlap < prompt_blocks <= 2 * overlap + 2
    assert after["headwater_frontend_kv_events_total"] > 0
    assert after["headwater_frontend_kv_dumps_total"] >= 1  # each worker, once at start
    assert after["headwater_frontend_kv_event_gaps_total"] == 0


def _served(frontend: Frontend) -> dict[str, int]:
    """Requests served, by role, from the router's view of its workers."""
    served: dict[str, int] = {}
    for view in frontend.router.views():
        served[view.role.value] = served.get(view.role.value, 0) + view.served
    return served


async def test_conditional_disaggregation_prefills_a_short_uncached_prompt_locally() -> None:
    """A prompt whose uncached part is at most ``local_prefill_max_tokens`` runs whole
    on a decode worker: no prefill leg. Under ``--router kv`` what the decode workers
    hold counts as cached, so a long prompt sent again is prefilled locally too."""
    short = {
        "model": "deepseek-v4",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    long = {
        **short,
        "messages": [{"role": "user", "content": " ".join(f"delta{i}" for i in range(300))}],
    }
    async with (
        serve_frontend(local_prefill_max_tokens=0) as (frontend, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=short)
        assert r.status_code == 200
        assert _served(frontend) == {"prefill": 1, "decode": 1}  # always disaggregated
    async with (
        serve_frontend(local_prefill_max_tokens=100) as (frontend, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=short)
        assert r.json()["usage"]["completion_tokens"] == 3
        assert _served(frontend) == {"prefill": 0, "decode": 1}  # local: short
        assert (await client.post("/v1/chat/completions", json=long)).status_code == 200
        assert _served(frontend) == {"prefill": 1, "decode": 2}  # over 100 uncached
    async with (
        serve_frontend(router="kv", local_prefill_max_tokens=100) as (frontend, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        router = frontend.router
        with trio.fail_after(10):
            while router.kv_statistics().dumps < len(router.clients()):
                await trio.sleep(0.02)
        assert (await client.post("/v1/chat/completions", json=long)).status_code == 200
        assert _served(frontend) == {"prefill": 1, "decode": 1}

        def decode_blocks() -> int:
            return sum(v.cached_blocks for v in router.views() if v.role.value == "decode")

        with trio.fail_after(10):  # the decode worker's stored blocks reach the index
            while decode_blocks() < 300 // 64:
                await trio.sleep(0.02)
        again = await client.post("/v1/chat/completions", json=long)
        assert again.status_code == 200
        assert _served(frontend) == {"prefill": 1, "decode": 2}  # cached there: local
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_text_prompts_block_hashes_come_from_the_tokenizers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``--router kv`` a text prompt is hashed beside its encoding, in the pool's
    thread: dispatch does not hash it again. A prompt given as ids (the token-in API)
    is hashed by dispatch."""
    hashed_in_dispatch: list[int] = []
    real = dispatch.prompt_hashes  # type: ignore[attr-defined]  # patched where it is used

    def counted(token_ids: Any, block_size: int) -> tuple[int, ...]:
        hashed_in_dispatch.append(len(token_ids))
        return real(token_ids, block_size)

    monkeypatch.setattr(dispatch, "prompt_hashes", counted)
    long = {
        "model": "deepseek-v4",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": " ".join(f"gamma{i}" for i in range(2000))}],
    }
    async with (
        serve_frontend(router="kv") as (frontend, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=long)).status_code == 200
        assert hashed_in_dispatch == []
        stats = frontend.router.kv_statistics()
        assert stats.routed == 2  # routed by cache all the same
        ids = {
            "model": "deepseek-v4",
            "token_ids": list(range(10, 300)),
            "sampling_params": {"max_tokens": 2},
        }
        r = await client.post("/inference/v1/generate", json=ids)
        assert r.status_code == 200, r.text
    assert hashed_in_dispatch == [290]
