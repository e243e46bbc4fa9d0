"""A decode leg's prompt crosses the plane from the frontend once.

A prefill worker keeps the prompt's ids with the KV it holds (``KvHandle.holds_prompt``);
a decode worker that declares ``prompt_from_kv`` gets its decode legs without the ids
and pulls them with the KV (``kv_pull`` with ``prompt``, answered by ``kv_prompt``).
Checked here: the codec (what leaves the frame, what an older peer sees), the frame the
frontend's connection sends, the answers over real sockets (the same as with the prompt
sent, through retries and migrations of the decode leg), and the refusals (a pull that
fails, a prefill worker that holds no prompt). Real sockets bind 127.0.0.1 port 0 with
the mocker sped up, as in ``test_plane_tcp``.
"""

from __future__ import annotations

import random
from functools import partial

import msgpack
import pytest
import trio
import trio.testing

from frontend.router import DispatchConfig, Dispatcher, Router
from headwater.plane.base import WorkerError, WorkerInstance
from headwater.plane.client import TcpWorkerClient, connect_worker
from headwater.plane.connection import PlaneConfig, PlaneConnection
from headwater.plane.kv import check_prompt, pull_kv
from headwater.wire import (
    Chunk,
    ErrorCode,
    GenerateRequest,
    KvHandle,
    Role,
    SamplingParams,
)
from headwater.wire.capabilities import PROMPT_FROM_KV, Capabilities
from headwater.wire.codec import FrameDecoder, encode, encode_checked
from headwater.wire.frames import HelloOk, KvPrompt, KvPull, Unreadable
from headwater.wire.tokens import token_array
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker
from workers.runtime.kv_transfer import InProcessKvTransfer

MODEL = "deepseek-v4"
FAST = 100_000.0
EOS = 1


def prompt(n: int, start: int = 3) -> list[int]:
    return [start + i % 5000 for i in range(n)]


def greedy(rid: str, ids: list[int], max_tokens: int = 4096, **sampling: object) -> GenerateRequest:
    """A greedy request whose answer's length is drawn from its prompt (EOS on): a decode
    worker that got another prompt, or none, answers with another length."""
    return GenerateRequest(
        rid,
        MODEL,
        token_array(ids),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
    )


def held(n: int, *, holds_prompt: bool = True) -> KvHandle:
    return KvHandle("p1", "tcp://127.0.0.1:1", "t1", n, holds_prompt=holds_prompt)


def body_of(frame_bytes: bytes) -> dict[str, object]:
    body: dict[str, object] = msgpack.unpackb(frame_bytes[4:], raw=False)
    return body


# ---- the codec --------------------------------------------------------------------------


def test_a_decode_leg_without_its_prompt_leaves_the_ids_out_and_reads_back_so() -> None:
    leg = GenerateRequest("r", MODEL, token_array(), SamplingParams(8), held(40_000))
    assert leg.prompt_in_kv
    data = encode_checked(leg)
    body = body_of(data)
    assert "token_ids" not in body
    assert body["kv_handle"]["prompt"] is True  # type: ignore[index]
    assert len(data) < 400  # the 40k-token prompt would be ~160 KB
    (back,) = FrameDecoder().feed(data)
    assert isinstance(back, GenerateRequest)
    assert back == leg
    assert back.prompt_in_kv
    assert len(back.token_ids) == 0


def test_a_leg_that_carries_its_prompt_is_encoded_as_before() -> None:
    ids = token_array(prompt(100))
    with_ids = GenerateRequest("r", MODEL, ids, SamplingParams(8), held(100))
    assert not with_ids.prompt_in_kv
    assert len(body_of(encode(with_ids))["token_ids"]) == 400  # type: ignore[arg-type]
    # A handle that holds no prompt (vLLM's, an older prefill worker's) is byte for byte
    # what an older peer sends: no "prompt" key.
    old = GenerateRequest("r", MODEL, ids, SamplingParams(8), held(100, holds_prompt=False))
    assert "prompt" not in body_of(encode(old))["kv_handle"]  # type: ignore[operator]
    (back,) = FrameDecoder().feed(encode(old))
    assert isinstance(back, GenerateRequest)
    assert back.kv_handle == old.kv_handle


def test_a_request_without_ids_and_no_prompt_holder_fails_alone() -> None:
    leg = GenerateRequest("r", MODEL, token_array(), SamplingParams(8), held(100))
    body = body_of(encode(leg))
    body["kv_handle"]["prompt"] = False  # type: ignore[index]
    packed = msgpack.packb(body, use_bin_type=True)
    (frame,) = FrameDecoder().feed(len(packed).to_bytes(4, "big") + packed)
    assert isinstance(frame, Unreadable)
    assert frame.request_id == "r"
    assert "token_ids" in frame.reason


def test_kv_pull_asks_for_the_prompt_only_when_it_needs_it() -> None:
    assert body_of(encode(KvPull("t"))) == {"k": "kv_pull", "transfer_id": "t"}
    assert body_of(encode(KvPull("t", True)))["prompt"] is True
    for frame in (KvPull("t"), KvPull("t", True), KvPrompt("t", token_array(prompt(1000)))):
        assert FrameDecoder().feed(encode(frame)) == [frame]


def test_check_prompt_wants_exactly_the_handles_tokens() -> None:
    handle = held(3)
    assert list(check_prompt(handle, [5, 6, 7])) == [5, 6, 7]
    for wrong in (None, [5, 6], [5, 6, 7, 8]):
        with pytest.raises(WorkerError) as info:
            check_prompt(handle, wrong)
        assert info.value.code is ErrorCode.KV_TRANSFER_FAILED


# ---- what the frontend's connection sends ------------------------------------------------


def connection(caps: Capabilities | None) -> PlaneConnection:
    a, _ = trio.testing.memory_stream_pair()
    peer = HelloOk(2, "decode", "d1", MODEL, caps)
    return PlaneConnection(a, peer, FrameDecoder(), PlaneConfig())


async def test_the_connection_leaves_the_prompt_out_only_for_a_worker_that_takes_it() -> None:
    ids = token_array(prompt(1000))
    leg = GenerateRequest("r", MODEL, ids, SamplingParams(8), held(1000))
    taker = connection(Capabilities("mocker", frozenset({PROMPT_FROM_KV})))
    out = taker._outgoing(leg)
    assert out.prompt_in_kv
    assert "token_ids" not in body_of(encode_checked(out))
    assert leg.token_ids is ids
    assert len(ids) == 1000
    # A worker that does not declare it (vLLM, an older one) gets the ids.
    for caps in (None, Capabilities("vllm", frozenset())):
        assert connection(caps)._outgoing(leg) is leg
    # So does a leg whose prompt is not the one the handle's holder prefilled, and one
    # whose holder keeps no prompt.
    longer = GenerateRequest("r", MODEL, token_array(prompt(1001)), SamplingParams(8), held(1000))
    assert taker._outgoing(longer) is longer
    no_holder = GenerateRequest("r", MODEL, ids, SamplingParams(8), held(1000, holds_prompt=False))
    assert taker._outgoing(no_holder) is no_holder


# ---- real sockets --------------------------------------------------------------------------


async def start_worker(nursery: trio.Nursery, role: Role, **engine: object) -> RunningWorker:
    config = WorkerConfig(
        role=role,
        engine_config=MockerConfig(speedup_ratio=FAST, **engine),  # type: ignore[arg-type]
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


def instance_of(worker: RunningWorker) -> WorkerInstance:
    return WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)


async def collect(client: TcpWorkerClient, req: GenerateRequest) -> list[Chunk]:
    async with client.stream(req) as chunks:
        return [c async for c in chunks]


def spy_requests(worker: RunningWorker) -> list[GenerateRequest]:
    """The requests *worker*'s runtime is handed, as its plane server decoded them."""
    seen: list[GenerateRequest] = []
    submit = worker.runtime.submit

    def spy(request: GenerateRequest, replies: object) -> None:
        seen.append(request)
        submit(request, replies)  # type: ignore[arg-type]

    worker.runtime.submit = spy  # type: ignore[method-assign]
    return seen


async def test_the_decode_worker_pulls_the_prompt_and_answers_as_with_it(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_worker(nursery, Role.PREFILL, kv_bytes_per_token=16)
    decode = await start_worker(nursery, Role.DECODE)
    agg = await start_worker(nursery, Role.AGG)
    to_prefill, to_decode, to_agg = [
        await connect_worker(instance_of(w), nursery) for w in (prefill, decode, agg)
    ]
    seen = spy_requests(decode)
    ids = prompt(5000)
    req = greedy("r1", ids, prompt_logprobs=1)
    (handoff,) = await collect(to_prefill, req)
    handle = handoff.kv_handle
    assert handle is not None
    assert handle.holds_prompt
    assert handle.num_tokens == 5000
    chunks = await collect(
        to_decode, GenerateRequest("r1", MODEL, req.token_ids, req.sampling, handle, (EOS,))
    )
    (leg,) = seen
    assert leg.prompt_in_kv
    assert len(leg.token_ids) == 0
    expected = await collect(to_agg, req)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == [t for c in expected for t in c.token_ids]
    assert 0 < len(tokens) < 4096  # EOS at the length drawn from this prompt
    # The prompt's logprobs need the prompt itself: one per token from the second on.
    assert chunks[0].prompt_logprobs == expected[0].prompt_logprobs
    assert chunks[0].prompt_logprobs is not None
    assert len(chunks[0].prompt_logprobs) == 4999
    p, d = await to_prefill.fetch_stats(), await to_decode.fetch_stats()
    assert p["plane_kv_bytes_served_total"] == d["kv_bytes_total"] == 5000 * 16
    assert d["kv_pull_failures_total"] == 0


async def test_a_pull_of_a_transfer_the_prefill_no_longer_holds_fails_the_leg(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_worker(nursery, Role.PREFILL)
    decode = await start_worker(nursery, Role.DECODE)
    to_prefill = await connect_worker(instance_of(prefill), nursery)
    to_decode = await connect_worker(instance_of(decode), nursery)
    req = greedy("r1", prompt(300))
    (handoff,) = await collect(to_prefill, req)
    handle = handoff.kv_handle
    assert handle is not None
    leg = GenerateRequest("r1", MODEL, req.token_ids, req.sampling, handle, (EOS,))
    assert len(await collect(to_decode, leg)) > 0
    with pytest.raises(WorkerError) as info:  # single use: pulled already
        await collect(to_decode, GenerateRequest("r2", MODEL, req.token_ids, req.sampling, handle))
    assert info.value.code is ErrorCode.KV_TRANSFER_FAILED
    stats = await to_decode.fetch_stats()
    assert stats["kv_pull_failures_total"] == 1
    assert stats["engine_requests_started"] == 2
    assert stats["engine_requests_failed"] == 1


async def test_a_prefill_worker_asked_for_a_prompt_it_does_not_hold_refuses_the_pull(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_worker(nursery, Role.PREFILL)
    to_prefill = await connect_worker(instance_of(prefill), nursery)
    (handoff,) = await collect(to_prefill, greedy("r1", prompt(300)))
    assert handoff.kv_handle is not None
    engine = prefill.runtime.engine
    assert isinstance(engine, MockerEngine)
    engine._transfers._held[handoff.kv_handle.transfer_id].tokens = ()  # as an older one
    conn = to_prefill._conn
    assert conn is not None
    with pytest.raises(WorkerError) as info:
        await pull_kv(conn, handoff.kv_handle.transfer_id, prompt=True)
    assert info.value.code is ErrorCode.KV_TRANSFER_FAILED
    assert "no prompt held" in info.value.message
    assert engine.statistics().kv_transfers_held == 0  # released all the same


async def dispatcher(*workers: RunningWorker, nursery: trio.Nursery) -> Dispatcher:
    router = Router("round-robin", rng=random.Random(1))
    for worker in workers:
        router.add(await connect_worker(instance_of(worker), nursery))
    return Dispatcher(router, MODEL, config=DispatchConfig(queue_timeout=0))


async def answer(dispatch: Dispatcher, req: GenerateRequest) -> list[int]:
    return [t async for c in dispatch.stream(req) for t in c.token_ids]


async def test_a_decode_leg_retried_on_another_worker_pulls_the_prompt_there(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_worker(nursery, Role.PREFILL)
    first, second = [await start_worker(nursery, Role.DECODE) for _ in range(2)]
    agg = await start_worker(nursery, Role.AGG)
    expected = [
        t
        for c in await collect(
            await connect_worker(instance_of(agg), nursery), greedy("r", prompt(3000))
        )
        for t in c.token_ids
    ]
    first.runtime.draining = True  # refuses at once, retryably: the leg moves on
    seen = spy_requests(second)
    dispatch = await dispatcher(prefill, first, second, nursery=nursery)
    assert await answer(dispatch, greedy("r", prompt(3000))) == expected
    (leg,) = seen
    assert leg.request_id == "r.r1"
    assert leg.prompt_in_kv


async def test_a_migrated_request_sends_its_whole_prompt_again(nursery: trio.Nursery) -> None:
    """A decode leg whose pull fails (its KV is gone) migrates: a new prefill leg with
    the whole prompt, then a decode leg that pulls it from there."""
    prefill = await start_worker(nursery, Role.PREFILL)
    decode = await start_worker(nursery, Role.DECODE)
    agg = await start_worker(nursery, Role.AGG)
    req = greedy("r", prompt(3000))
    expected = [
        t
        for c in await collect(await connect_worker(instance_of(agg), nursery), req)
        for t in c.token_ids
    ]
    prefill_seen, decode_seen = spy_requests(prefill), spy_requests(decode)
    engine = prefill.runtime.engine
    assert isinstance(engine, MockerEngine)
    release = engine.release_transfer
    lost = 0

    async def lose_the_first(transfer_id: str) -> int:
        nonlocal lost
        if not lost:  # the first pull finds its KV expired
            lost += 1
            await release(transfer_id)
        return await release(transfer_id)

    engine.release_transfer = lose_the_first  # type: ignore[method-assign]
    dispatch = await dispatcher(prefill, decode, nursery=nursery)
    assert await answer(dispatch, req) == expected
    assert [r.request_id for r in prefill_seen] == ["r", "r.m1"]
    assert all(len(r.token_ids) == 3000 for r in prefill_seen)
    assert [(r.request_id, r.prompt_in_kv) for r in decode_seen] == [("r", True), ("r.m1", True)]


async def test_in_process_pulls_hand_over_a_copy_of_the_prompt(nursery: trio.Nursery) -> None:
    transfer = InProcessKvTransfer()
    prefill = MockerEngine(MockerConfig(speedup_ratio=FAST), Role.PREFILL, "p", transfer)
    transfer.register("p", prefill)
    await nursery.start(prefill.run)
    ids = token_array(prompt(500))
    with trio.fail_after(10):
        chunks = [c async for c in prefill.generate(greedy("r", list(ids)))]
    handle = chunks[-1].kv_handle
    assert handle is not None
    assert handle.holds_prompt
    nbytes, pulled = await transfer.pull_with_prompt(handle)
    assert nbytes == 500 * prefill.config.kv_bytes_per_token
    assert pulled == ids
    with pytest.raises(WorkerError):  # single use
        await transfer.pull_with_prompt(handle)
