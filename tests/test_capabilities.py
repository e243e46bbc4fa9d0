"""Engines' declarations: on the wire, in the handshake, in etcd, in the router, and the
refusals they make before dispatch and in the worker.

Policy: loopback only (workers on 127.0.0.1:0, etcd from etcd_fixture), in-process
frontends from frontend_fixture; every wait is bounded.
"""

from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import trio

from frontend.router import Router
from headwater.etcd.records import InstanceRecord
from headwater.plane.base import WorkerError, WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.memory import MemoryWorkerClient
from headwater.wire import (
    ErrorCode,
    GenerateRequest,
    Role,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
)
from headwater.wire.capabilities import (
    BASELINE,
    FEATURES,
    TOP_K,
    Capabilities,
    from_plain,
    needed,
    refusal,
    to_plain,
)
from headwater.wire.codec import FrameDecoder, encode
from headwater.wire.errors import ProtocolError
from headwater.wire.frames import PROTOCOL_VERSION, HelloOk, Unreadable
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.engines.mocker.engine import CAPABILITIES as MOCKER
from workers.lifecycle import WorkerConfig, serve_worker

from frontend_fixture import assert_error, serve_frontend
from helpers import start_runtime

MODEL = "deepseek-v4"
VLLM_LIKE = Capabilities("vllm", frozenset(FEATURES))
EVERY_FIELD = SamplingParams(
    max_tokens=5,
    seed=3,
    top_k=4,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    logit_bias=((7, -100.0), (9, 2.5)),
    structured=StructuredOutput(StructuredKind.CHOICE, '["a","b"]'),
)


def roundtrip(frame: Any) -> Any:
    (back,) = FrameDecoder().feed(encode(frame))
    return back


def request(sampling: SamplingParams, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(rid, MODEL, [5, 6, 7], sampling)


# ---- the declaration and what a request asks --------------------------------------------


def test_a_request_asks_for_what_leaves_its_neutral_values() -> None:
    assert list(needed(SamplingParams(max_tokens=1))) == []
    neutral = SamplingParams(max_tokens=1, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert list(needed(neutral)) == []
    assert list(needed(EVERY_FIELD)) == [
        "seed",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "structured_outputs",
    ]
    assert refusal(VLLM_LIKE, EVERY_FIELD) is None
    assert refusal(MOCKER, EVERY_FIELD) == "'top_k' is not supported by the mocker engine"
    assert refusal(BASELINE, SamplingParams(max_tokens=1, seed=1)) is None
    assert "this server's engine" in (refusal(BASELINE, EVERY_FIELD) or "")


def test_a_declaration_as_plain_data_is_checked() -> None:
    assert from_plain(to_plain(VLLM_LIKE)) == VLLM_LIKE
    assert from_plain({"engine": "new", "features": ["seed", "telepathy"]}).honours("telepathy")
    bad: object
    for bad in (
        [],
        {"engine": 3},
        {"features": "seed"},
        {"features": [""]},
        {"features": ["x"] * 65},
        {"engine": "e" * 65},
    ):
        with pytest.raises(ValueError, match="capabilities"):
            from_plain(bad)


# ---- on the wire ----------------------------------------------------------------------------


def test_the_new_sampling_fields_cross_the_wire_exactly() -> None:
    back = roundtrip(request(EVERY_FIELD))
    assert back.sampling == EVERY_FIELD


def test_a_request_asking_for_nothing_new_is_byte_identical_to_an_older_peers() -> None:
    plain = SamplingParams(max_tokens=5, temperature=0.7, seed=3)
    unpacked = msgspec.msgpack.decode(encode(request(plain))[4:])
    assert set(unpacked["sampling"]) == {
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "temperature",
        "top_p",
        "seed",
        "stop_token_ids",
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top_k", -1),
        ("min_p", math.nan),
        ("repetition_penalty", math.inf),
        ("logit_bias", [[1]]),
        ("logit_bias", [[-1, 0.0]]),
        ("logit_bias", [["1", 0.0]]),
        ("structured", ["telepathy", ""]),
        ("structured", ["json"]),
        ("top_k", "5"),
    ],
)
def test_malformed_sampling_fields_make_the_request_unreadable(key: str, value: Any) -> None:
    body = msgspec.msgpack.decode(encode(request(SamplingParams(max_tokens=1)))[4:])
    body["sampling"][key] = value
    data = msgspec.msgpack.encode(body)
    # Whole but unreadable: the worker refuses that request alone (its id read).
    (frame,) = FrameDecoder().feed(len(data).to_bytes(4, "big") + data)
    assert isinstance(frame, Unreadable)
    assert frame.request_id == "r"


def test_hello_ok_carries_the_declaration_and_an_older_one_none() -> None:
    declared = HelloOk(PROTOCOL_VERSION, "agg", "w", MODEL, MOCKER)
    assert roundtrip(declared) == declared
    older = HelloOk(PROTOCOL_VERSION, "agg", "w", MODEL)
    assert roundtrip(older).capabilities is None
    body = msgspec.msgpack.decode(encode(declared)[4:])
    body["caps"] = {"engine": "x", "features": [1]}
    data = msgspec.msgpack.encode(body)
    with pytest.raises(ProtocolError, match="capabilities"):
        FrameDecoder().feed(len(data).to_bytes(4, "big") + data)


# ---- in etcd ----------------------------------------------------------------------------------


def test_a_record_carries_the_declaration_under_its_signature() -> None:
    worker = WorkerInstance("w1", Role.AGG, MODEL, "tcp://127.0.0.1:9", capabilities=MOCKER)
    record = InstanceRecord.from_instance(worker, pid=1)
    secret = b"records-test-secret-4f1b2c9d"
    back = InstanceRecord.from_json(record.to_json(secret), secret)
    assert back.capabilities == MOCKER
    assert back.instance().capabilities == MOCKER
    # A writer without the secret cannot grant a worker features it does not declare.
    forged = json.loads(record.to_json(secret))
    forged["capabilities"]["features"].append("top_k")
    with pytest.raises(ValueError, match="signature"):
        InstanceRecord.from_json(json.dumps(forged).encode(), secret)
    older = InstanceRecord.from_instance(WorkerInstance("w2", Role.AGG, MODEL, "tcp://h:1"))
    assert b"capabilities" not in older.to_json()
    assert InstanceRecord.from_json(older.to_json()).capabilities is None


@pytest.mark.slow
async def test_etcd_registration_publishes_the_engines_declaration(
    etcd_url: str, etcd_prefix: str
) -> None:
    from frontend.discovery.etcd import EtcdDiscovery
    from workers.runtime.registration import EtcdRegistration

    seen: dict[str, WorkerInstance] = {}

    class Sink:
        def worker_added(self, instance: WorkerInstance) -> None:
            seen[instance.worker_id] = instance

        def worker_removed(self, worker_id: str) -> None: ...

        def worker_draining(self, worker_id: str) -> None: ...

    worker = WorkerInstance("w1", Role.AGG, MODEL, "tcp://127.0.0.1:7301", capabilities=MOCKER)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                EtcdDiscovery(etcd_url, model=MODEL, prefix=etcd_prefix).run, Sink()
            )
            async with EtcdRegistration(etcd_url, worker, ttl=2, prefix=etcd_prefix):
                while "w1" not in seen:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    assert seen["w1"].capabilities == MOCKER


# ---- the router, the runtime, the handshake ----------------------------------------------


async def test_the_router_names_a_worker_that_lacks_a_feature(nursery: trio.Nursery) -> None:
    router = Router()
    assert router.lacking(MODEL, TOP_K) is None  # nobody known: nobody to ask
    for worker_id, caps in (("a", VLLM_LIKE), ("b", MOCKER)):
        engine = MockerEngine(MockerConfig(speedup_ratio=1000), Role.AGG, worker_id)
        runtime = await start_runtime(nursery, engine, worker_id)
        instance = WorkerInstance(
            worker_id, Role.AGG, MODEL, f"memory://{worker_id}", capabilities=caps
        )
        router.add(MemoryWorkerClient(instance, runtime))
    assert router.lacking(MODEL, "seed") is None
    assert router.lacking(MODEL, TOP_K) == MOCKER  # any of them may get the request
    assert router.lacking("another-model", TOP_K) is None


async def test_the_worker_refuses_what_its_engine_does_not_declare(nursery: trio.Nursery) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=1000), Role.AGG, "w")
    runtime = await start_runtime(nursery, engine, "w")
    # The instance claims more than the engine declares (a stale record, a bad relay):
    # the runtime, which asks the engine itself, still refuses.
    client = MemoryWorkerClient(
        WorkerInstance("w", Role.AGG, MODEL, "memory://w", capabilities=VLLM_LIKE), runtime
    )
    with pytest.raises(WorkerError) as refused:
        async with client.stream(request(SamplingParams(max_tokens=3, top_k=5))):
            pass
    assert refused.value.code is ErrorCode.INVALID_REQUEST
    assert refused.value.message == "'top_k' is not supported by the mocker engine"
    assert engine.counters.requests_started == 0  # the engine never saw it
    async with client.stream(request(SamplingParams(max_tokens=3, seed=1))) as replies:
        assert len([t async for c in replies for t in c.token_ids]) == 3


async def test_a_tcp_client_learns_the_declaration_in_the_handshake(
    nursery: trio.Nursery,
) -> None:
    config = WorkerConfig(role=Role.AGG, engine_config=MockerConfig(speedup_ratio=10_000))
    worker = await nursery.start(partial(serve_worker, config))
    # A static --workers entry says nothing of the worker's engine: the worker does.
    instance = WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address)
    assert instance.capabilities is None
    client = await connect_worker(instance, nursery)
    assert client.capabilities == MOCKER
    async with (
        serve_frontend(workers=f"{worker.address}?role=agg&id={worker.worker_id}") as (
            _,
            url,
        ),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        with trio.fail_after(20):
            while (await http.get("/health")).status_code != 200:
                await trio.sleep(0.02)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "min_p": 0.2,
        }
        err = assert_error(await http.post("/v1/chat/completions", json=body), 400, "min_p")
        assert "mocker" in err["message"]
        body.pop("min_p")
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    await client.aclose()


# ---- the mocker's simulation -------------------------------------------------------------


async def test_the_mockers_greedy_answer_does_not_depend_on_the_seed(
    nursery: trio.Nursery,
) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=10_000), Role.AGG, "w")
    await nursery.start(engine.run)

    async def ids(rid: str, **sampling: Any) -> list[int]:
        req = request(SamplingParams(max_tokens=8, ignore_eos=True, **sampling), rid)
        return [t async for chunk in engine.generate(req) for t in chunk.token_ids]

    greedy = await ids("g1", temperature=0.0, seed=1)
    assert await ids("g2", temperature=0.0, seed=2) == greedy
    assert await ids("g3", temperature=0.0) == greedy
    assert await ids("s1", temperature=1.0, seed=1) != greedy
    assert await ids("s2", temperature=1.0, seed=1) == await ids("s3", temperature=1.0, seed=1)
