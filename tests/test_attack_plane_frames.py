"""Attack: one request's frame takes down a plane connection and every request on it.

A frontend multiplexes all its requests to a worker over one connection, and a worker
closes a connection on any frame it cannot read. So a client that could make the
frontend send such a frame (~140,000 ``stop_token_ids``: over the worker's item budget;
a negative one: a field out of range) cut every other client's requests on that worker.
Both halves are fixed and tested here:

* the sender checks each request against the worker's own decoder before it goes out,
  and fails that request alone (a 400 over HTTP), the connection untouched;
* a worker that still receives a request frame it cannot read, whose id it can, fails
  that request alone (an ``error`` frame) and keeps the connection and its other
  requests, multiplexed beside it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import msgpack
import pytest
import trio

from headwater.plane.base import WorkerError, WorkerInstance
from headwater.plane.client import TcpWorkerClient, connect_worker
from headwater.wire import (
    Ack,
    End,
    Error,
    ErrorCode,
    GenerateRequest,
    Role,
    SamplingParams,
)
from headwater.wire.addresses import parse_tcp_address
from headwater.wire.codec import MAX_ITEMS, FrameDecoder, encode, pack_token_ids
from headwater.wire.frames import Fault, Frame, HelloOk
from headwater.wire.handshake import ClientHandshake
from headwater.wire.session import Session
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

from frontend_fixture import assert_error, start_frontend

MODEL = "deepseek-v4"
SECRET = b"frames-test-secret-93be0d7c1fa4"
DEADLINE = 10.0  # s: every wait here is bounded by it


async def start_worker(
    nursery: trio.Nursery, secret: bytes | None = SECRET, speedup: float = 100_000.0
) -> RunningWorker:
    config = WorkerConfig(
        role=Role.AGG, engine_config=MockerConfig(speedup_ratio=speedup), secret=secret
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


def request(rid: str, max_tokens: int = 4, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        rid,
        MODEL,
        list(range(3, 40)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),  # type: ignore[arg-type]
    )


async def client_for(worker: RunningWorker, nursery: trio.Nursery) -> TcpWorkerClient:
    instance = WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)
    return await connect_worker(instance, nursery, secret=SECRET)


# ---- the sender ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({"stop_token_ids": tuple(range(140_000))}, id="over-the-item-budget"),
        pytest.param({"stop_token_ids": (5, -1)}, id="a-negative-stop-token-id"),
        pytest.param({"seed": 2**70}, id="a-seed-beyond-64-bits"),
    ],
)
async def test_a_request_the_worker_could_not_read_fails_alone(
    nursery: trio.Nursery, sampling: dict[str, Any]
) -> None:
    worker = await start_worker(nursery, speedup=50.0)  # the long stream is still running
    client = await client_for(worker, nursery)
    async with client.stream(request("long", max_tokens=60)) as long_stream:
        first = await long_stream.__anext__()
        with pytest.raises(WorkerError) as refused:
            async with client.stream(request("poison", **sampling)):
                pass
        assert refused.value.code is ErrorCode.INVALID_REQUEST
        assert "cannot go to a worker" in refused.value.message
        rest = [t async for c in long_stream for t in c.token_ids]
    assert len(first.token_ids) + len(rest) == 60
    assert client.statistics().disconnects_total == 0
    stats = worker.server.statistics()
    assert stats.protocol_errors_total == 0
    assert stats.connections == 1


async def test_over_http_the_request_is_a_400_and_the_others_on_the_connection_finish(
    nursery: trio.Nursery,
) -> None:
    worker = await start_worker(nursery, secret=None, speedup=50.0)
    spec = f"{worker.address}?role=agg&id={worker.worker_id}&model={MODEL}"
    _, url, _ = await start_frontend(nursery, workers=spec)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as http:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={**body, "max_tokens": 60, "ignore_eos": True, "stream": True},
        ) as streaming:
            lines = streaming.aiter_lines()
            assert (await lines.__anext__()).startswith("data: ")
            poison = await http.post(
                "/v1/chat/completions",
                json={**body, "max_tokens": 4, "stop_token_ids": list(range(140_000))},
            )
            assert_error(poison, 400)
            rest = [line async for line in lines]
        assert rest[-2:] == ["data: [DONE]", ""]
        assert not any('"error"' in line for line in rest)
    assert worker.server.statistics().protocol_errors_total == 0


# ---- the receiver -----------------------------------------------------------------------


class RawClient:
    """A client speaking the plane by hand (the handshake, the session's tags), so it can
    send what the real client no longer would."""

    def __init__(self, stream: trio.SocketStream, session: Session | None) -> None:
        self.stream = stream
        self.session = session
        self.decoder = FrameDecoder(mac=session.receive if session else None)

    @classmethod
    async def connect(cls, address: str, secret: bytes | None) -> RawClient:
        stream = await trio.open_tcp_stream(*parse_tcp_address(address))
        handshake = ClientHandshake(role="frontend", peer_id="raw", model="", secret=secret)
        decoder = FrameDecoder()
        await stream.send_all(encode(handshake.start()))
        while handshake.peer is None:
            for frame in decoder.feed(await stream.receive_some(65536), limit=1):
                if (answer := handshake.receive(frame)) is not None:
                    await stream.send_all(encode(answer))
        assert isinstance(handshake.peer, HelloOk)
        return cls(stream, handshake.session)

    async def send_body(self, body: dict[str, object]) -> None:
        """Frame *body* as the codec would, whatever it holds (tagged in a session)."""
        raw = msgpack.packb(body, use_bin_type=True)
        tag = self.session.send.sign(raw) if self.session else b""
        await self.stream.send_all(len(raw + tag).to_bytes(4, "big") + raw + tag)

    async def send(self, frame: Frame) -> None:
        await self.stream.send_all(encode(frame, mac=self.session.send if self.session else None))

    async def replies_until(self, done: set[str]) -> list[Frame]:
        """Frames until every id in *done* has its End or Error, or the worker closes."""
        frames: list[Frame] = []
        with trio.fail_after(DEADLINE):
            while done:
                data = await self.stream.receive_some(65536)
                if not data:
                    break
                for frame in self.decoder.feed(data):
                    frames.append(frame)
                    if isinstance(frame, End | Error):
                        done.discard(frame.request_id)
                    if isinstance(frame, Fault):
                        return frames
        return frames


def request_body(rid: str, **sampling: object) -> dict[str, object]:
    return {
        "request_id": rid,
        "model": MODEL,
        "token_ids": pack_token_ids(range(3, 40)),
        "sampling": {"max_tokens": 4, "ignore_eos": True, **sampling},
        "kv_handle": None,
        "eos_token_ids": [],
        "k": "request",
    }


MALFORMED = {
    "over-the-item-budget": request_body("bad", stop_token_ids=list(range(MAX_ITEMS + 10))),
    "a-negative-stop-token-id": request_body("bad", stop_token_ids=[7, -1]),
    "token-ids-as-a-list": {**request_body("bad"), "token_ids": [1, 2, 3]},
    "no-sampling": {k: v for k, v in request_body("bad").items() if k != "sampling"},
    "a-ragged-token-array": {**request_body("bad"), "token_ids": b"\x01\x02\x03"},
}


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "loopback-no-secret"])
@pytest.mark.parametrize("body", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_a_malformed_request_frame_fails_alone_beside_good_ones(
    nursery: trio.Nursery, body: dict[str, object], secret: bytes | None
) -> None:
    worker = await start_worker(nursery, secret=secret)
    raw = await RawClient.connect(worker.address, secret)
    await raw.send(request("good-1"))
    await raw.send_body(body)
    await raw.send(request("good-2"))
    frames = await raw.replies_until({"good-1", "bad", "good-2"})
    assert not [f for f in frames if isinstance(f, Fault)], "the worker closed the connection"
    (refusal,) = [f for f in frames if isinstance(f, Error)]
    assert refusal.request_id == "bad"
    assert refusal.code is ErrorCode.INVALID_REQUEST
    assert "could not read this request" in refusal.message
    assert {f.request_id for f in frames if isinstance(f, End)} == {"good-1", "good-2"}
    assert "bad" not in {f.request_id for f in frames if isinstance(f, Ack)}
    # The connection is still open and serves the next request.
    await raw.send(request("good-3"))
    frames = await raw.replies_until({"good-3"})
    assert any(isinstance(f, End) and f.request_id == "good-3" for f in frames)
    stats = worker.server.statistics()
    assert stats.requests_refused_total == 1
    assert stats.protocol_errors_total == 0
    assert worker.runtime.statistics().served_total == 3
    await raw.stream.aclose()


async def test_a_frame_whose_request_id_cannot_be_read_still_closes_the_connection(
    nursery: trio.Nursery,
) -> None:
    """Nothing to fail alone: the connection is closed, as for any broken frame."""
    worker = await start_worker(nursery)
    raw = await RawClient.connect(worker.address, SECRET)
    await raw.send_body({**request_body("x"), "request_id": 42})
    frames = await raw.replies_until({"never"})
    assert [f.code for f in frames if isinstance(f, Fault)] == ["protocol_error"]
    assert worker.server.statistics().protocol_errors_total == 1
    await raw.stream.aclose()
