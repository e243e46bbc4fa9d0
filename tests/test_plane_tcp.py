"""The TCP request plane: client, worker server and KV transfer, in one process.

Test policy: real sockets bind 127.0.0.1 port 0 only, and such tests run on real
time with the mocker sped up (or slowed to real speed where a request must still be
running when the test acts on it), synchronising on events and on the worker's own
drain, never on sleeps. Timing behaviour (ACK timeout, heartbeat loss, reconnect
backoff, goaway) runs over trio memory streams against a scripted worker on the
autojump clock, with exact asserts on ``trio.current_time()``.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial

import msgpack
import pytest
import trio
import trio.testing

from headwater.instrumentation.attribution import StallAttribution, StallLog
from headwater.plane.base import CannotConnect, Disconnected, WorkerError, WorkerInstance
from headwater.plane.client import ClientState, TcpWorkerClient, connect_worker
from headwater.plane.connection import (
    AckTimeout,
    ConnectTimeout,
    HandshakeFailed,
    PlaneConfig,
    open_connection,
    tcp_connector,
)
from headwater.plane.memory import MemoryWorkerClient
from headwater.plane.server import InsecureBind, PlaneServer, ServerConfig
from headwater.wire import (
    Ack,
    Cancel,
    Chunk,
    End,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Reply,
    Role,
    SamplingParams,
    WorkerLoad,
)
from headwater.wire.addresses import parse_tcp_address
from headwater.wire.codec import FrameDecoder, encode
from headwater.wire.frames import (
    PROTOCOL_VERSION,
    Auth,
    Fault,
    Frame,
    GoAway,
    Hello,
    HelloOk,
    KvPull,
    KvRelease,
    Ping,
    Pong,
)
from headwater.wire.handshake import ClientHandshake, ServerHandshake
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

from helpers import start_runtime

MODEL = "deepseek-v4"
FAST = 100_000.0  # mocker speedup: engine time is negligible
REAL = 1.0  # mocker at GPU speed: a long request is still running when the test acts


def request(
    rid: str, max_tokens: int = 8, prompt: int = 100, seed: int | None = 7
) -> GenerateRequest:
    return GenerateRequest(
        rid,
        MODEL,
        list(range(3, 3 + prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed),
    )


def instance_of(worker: RunningWorker) -> WorkerInstance:
    return WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)


async def start_worker(
    nursery: trio.Nursery,
    *,
    speedup: float = FAST,
    role: Role = Role.AGG,
    kv_bytes_per_token: int = 16,
    **kw: object,
) -> RunningWorker:
    engine_config = MockerConfig(speedup_ratio=speedup, kv_bytes_per_token=kv_bytes_per_token)
    config = WorkerConfig(role=role, engine_config=engine_config, **kw)  # type: ignore[arg-type]
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


async def collect(
    client: TcpWorkerClient | MemoryWorkerClient, req: GenerateRequest
) -> list[Chunk]:
    async with client.stream(req) as chunks:
        return [c async for c in chunks]


def tokens_of(chunks: list[Chunk]) -> list[int]:
    """The tokens of a stream: how many chunks carry them depends on how many arrived
    together (waiting chunks are merged)."""
    return [t for c in chunks for t in c.token_ids]


async def collect_tokens(
    client: TcpWorkerClient | MemoryWorkerClient, req: GenerateRequest
) -> list[int]:
    return tokens_of(await collect(client, req))


# ---- real sockets --------------------------------------------------------------------------


async def test_tcp_plane_matches_the_memory_twin(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery)
    client = await connect_worker(instance_of(worker), nursery)
    engine = MockerEngine(MockerConfig(speedup_ratio=FAST), Role.AGG, "twin")
    runtime = await start_runtime(nursery, engine, "twin")
    twin = MemoryWorkerClient(instance_of(worker), runtime)
    req = request("same", max_tokens=12)
    over_tcp, in_memory = await collect(client, req), await collect(twin, req)
    assert tokens_of(over_tcp) == tokens_of(in_memory)
    assert len(tokens_of(over_tcp)) == 12
    assert over_tcp[-1].finish_reason is in_memory[-1].finish_reason is FinishReason.LENGTH


async def test_many_concurrent_streams_share_one_connection(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery)
    client = await connect_worker(instance_of(worker), nursery)
    n, peak = 64, 0
    tokens: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        nonlocal peak
        async with client.stream(request(f"r{i}", max_tokens=20, seed=i)) as chunks:
            peak = max(peak, client.statistics().inflight)
            tokens[i] = [t async for c in chunks for t in c.token_ids]

    async with trio.open_nursery() as inner:
        for i in range(n):
            inner.start_soon(one, i)
    assert peak == n  # every stream was open at once
    assert sorted(tokens) == list(range(n))
    assert all(len(t) == 20 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) == n  # no stream got another's tokens
    stats = await client.fetch_stats()
    assert stats["plane_connections_total"] == 1
    assert stats["served_total"] == n
    assert stats["inflight"] == 0


async def test_leaving_a_stream_cancels_it_on_the_worker(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery, speedup=REAL)
    client = await connect_worker(instance_of(worker), nursery)
    async with client.stream(request("long", max_tokens=100_000)) as chunks:
        first = await chunks.__anext__()
        assert first.token_ids
        assert worker.runtime.statistics().engine.kv_blocks_used > 0
    # 100k tokens take minutes at real speed: finishing at all proves the cancel.
    with trio.fail_after(5):
        assert await worker.runtime.drain(5)
    stats = worker.runtime.statistics()
    assert stats.cancelled_total == 1
    assert stats.served_total == 0
    assert stats.engine.kv_blocks_used == 0
    assert worker.runtime.engine.counters.requests_cancelled == 1  # type: ignore[attr-defined]


async def test_worker_error_before_ack_is_a_worker_error(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery)
    client = await connect_worker(instance_of(worker), nursery)
    with pytest.raises(WorkerError) as info:
        await collect(client, request("bad", max_tokens=0))
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert len(await collect_tokens(client, request("good"))) == 8  # the connection lives on


async def test_handshake_with_the_right_secret(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery, secret=b"correct horse")
    client = await connect_worker(instance_of(worker), nursery, secret=b"correct horse")
    assert len(await collect_tokens(client, request("a"))) == 8


@pytest.mark.parametrize("client_secret", [b"wrong", None])
async def test_wrong_or_missing_secret_is_refused(
    nursery: trio.Nursery, client_secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HEADWATER_PLANE_SECRET", raising=False)
    worker = await start_worker(nursery, secret=b"correct horse")
    with pytest.raises(CannotConnect) as info:
        await connect_worker(instance_of(worker), nursery, secret=client_secret)
    assert isinstance(info.value.__cause__, HandshakeFailed)
    assert info.value.__cause__.code == "unauthorized"


async def test_server_refuses_a_wrong_proof(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery, secret=b"correct horse")
    raw = await trio.open_tcp_stream(*parse_tcp_address(worker.address))
    await raw.send_all(encode(Hello(PROTOCOL_VERSION, "frontend", "x", "", b"n" * 32)))
    await raw.send_all(encode(Auth(b"\x00" * 32)))  # without waiting for the challenge
    frames = await read_until_eof(raw)
    assert frames[-1] == Fault("unauthorized", "wrong plane secret")
    assert worker.server.statistics().auth_failures_total == 1


async def test_no_secret_off_loopback_is_refused_at_start() -> None:
    with pytest.raises(InsecureBind, match="plane secret"):
        await serve_worker(WorkerConfig(listen="0.0.0.0:0"))


async def read_until_eof(stream: trio.abc.Stream) -> list[Frame]:
    """Every frame until the worker closes the connection; then ours is closed too."""
    decoder, frames = FrameDecoder(), []
    async with stream:
        with trio.fail_after(5):
            while data := await stream.receive_some(65536):
                frames.extend(decoder.feed(data))
    return frames


async def raw_connection(worker: RunningWorker) -> tuple[trio.SocketStream, list[Frame]]:
    """A plain socket past the handshake, and the frames that came with hello_ok."""
    raw = await trio.open_tcp_stream(*parse_tcp_address(worker.address))
    handshake = ClientHandshake(role="frontend", peer_id="raw", model="", secret=None)
    await raw.send_all(encode(handshake.start()))
    decoder, frames = FrameDecoder(), []
    while handshake.peer is None:
        frames.extend(decoder.feed(await raw.receive_some(65536)))
        if frames:
            assert handshake.receive(frames.pop(0)) is None
    return raw, frames


def _frame(body: object) -> bytes:
    raw: bytes = msgpack.packb(body)
    return struct.pack(">I", len(raw)) + raw


@pytest.mark.parametrize(
    ("junk", "code"),
    [
        (b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "protocol_error"),
        (struct.pack(">I", 64 * 1024 * 1024 + 1), "frame_too_large"),
        (_frame({"k": "no_such_kind"}), "protocol_error"),
        (
            _frame({"k": "hello_ok", "version": 1, "role": "x", "worker_id": "y", "model": ""}),
            "protocol_error",
        ),
    ],
    ids=["garbage", "oversize", "unknown-kind", "wrong-direction"],
)
async def test_bad_frames_close_only_that_connection(
    nursery: trio.Nursery, junk: bytes, code: str
) -> None:
    worker = await start_worker(nursery, speedup=REAL)
    client = await connect_worker(instance_of(worker), nursery)
    async with client.stream(request("survivor", max_tokens=100_000)) as chunks:
        await chunks.__anext__()
        raw, _ = await raw_connection(worker)
        await raw.send_all(junk)
        frames = await read_until_eof(raw)
        assert isinstance(frames[-1], Fault)
        assert frames[-1].code == code
        # The other connection, and its request, carry on.
        await chunks.__anext__()
    assert len(await collect_tokens(client, request("after"))) == 8
    stats = worker.server.statistics()
    assert stats.protocol_errors_total == 1
    assert stats.connections == 1  # the bad one is gone, the good one stays


async def test_garbage_before_the_handshake(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery)
    raw = await trio.open_tcp_stream(*parse_tcp_address(worker.address))
    await raw.send_all(b"GET / HTTP/1.1\r\n\r\n")
    frames = await read_until_eof(raw)
    assert len(frames) == 1
    assert isinstance(frames[0], Fault)


async def test_peer_vanishing_mid_frame_cancels_its_requests(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery, speedup=REAL)
    raw, _ = await raw_connection(worker)
    await raw.send_all(encode(request("orphan", max_tokens=100_000)))
    decoder: FrameDecoder = FrameDecoder()
    seen: list[Frame] = []
    while not any(isinstance(f, Chunk) for f in seen):
        seen.extend(decoder.feed(await raw.receive_some(65536)))
    assert seen[0] == Ack("orphan")
    await raw.send_all(encode(Ping(1))[:3])  # half a frame, then gone
    await raw.aclose()
    with trio.fail_after(5):
        assert await worker.runtime.drain(5)
    assert worker.runtime.statistics().cancelled_total == 1
    assert worker.runtime.statistics().engine.kv_blocks_used == 0


async def test_disaggregated_kv_pull_between_workers(nursery: trio.Nursery) -> None:
    prefill = await start_worker(nursery, role=Role.PREFILL, kv_bytes_per_token=1000)
    decode = await start_worker(nursery, role=Role.DECODE)
    to_prefill = await connect_worker(instance_of(prefill), nursery)
    to_decode = await connect_worker(instance_of(decode), nursery)
    req = request("disagg", max_tokens=5, prompt=3000)
    (handoff,) = await collect(to_prefill, req)
    handle = handoff.kv_handle
    assert handle is not None
    assert handle.address == prefill.address
    assert (await to_prefill.fetch_stats())["engine_kv_transfers_held"] == 1
    decode_leg = GenerateRequest(req.request_id, MODEL, req.token_ids, req.sampling, handle)
    assert len(await collect_tokens(to_decode, decode_leg)) == 5
    p, d = await to_prefill.fetch_stats(), await to_decode.fetch_stats()
    assert p["plane_kv_pulls_served_total"] == 1
    assert p["plane_kv_bytes_served_total"] == 3000 * 1000  # three 1 MiB pieces
    assert p["engine_kv_transfers_held"] == 0
    assert d["kv_pulls_total"] == 1
    assert d["kv_bytes_total"] == 3000 * 1000
    # The handle is single-use: a second decode leg fails cleanly.
    again = GenerateRequest("again", MODEL, req.token_ids, req.sampling, handle)
    with pytest.raises(WorkerError) as info:
        await collect(to_decode, again)
    assert info.value.code is ErrorCode.KV_TRANSFER_FAILED
    assert (await to_decode.fetch_stats())["kv_connections"] == 1  # reused, not redialled


async def test_kv_nobody_will_pull_is_released_over_either_transport(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_worker(nursery, role=Role.PREFILL)
    engine = MockerEngine(MockerConfig(speedup_ratio=FAST), Role.PREFILL, "twin")
    runtime = await start_runtime(nursery, engine, "twin")
    clients: list[TcpWorkerClient | MemoryWorkerClient] = [
        await connect_worker(instance_of(prefill), nursery),
        MemoryWorkerClient(instance_of(prefill), runtime),
    ]
    for client, worker_runtime in zip(clients, (prefill.runtime, runtime), strict=True):
        held = [
            (await collect(client, request(f"r{i}", prompt=300)))[0].kv_handle for i in range(2)
        ]
        assert worker_runtime.statistics().engine.kv_transfers_held == 2
        assert held[0] is not None
        client.release_kv(held[0])
        with trio.fail_after(5):
            while worker_runtime.statistics().engine.kv_transfers_held != 1:
                await trio.sleep(0.01)
        assert worker_runtime.statistics().kv_released_total == 1
        client.release_kv(held[0])  # again, or an unknown id: nothing happens
        client.release_kv(KvHandle("x", "tcp://127.0.0.1:1", "no-such-transfer", 1))
        await trio.sleep(0.1)
        assert worker_runtime.statistics().kv_released_total == 1
        assert worker_runtime.statistics().engine.kv_transfers_held == 1  # the other one


async def test_a_kv_handle_the_caller_left_before_is_released_by_the_worker(
    nursery: trio.Nursery,
) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=REAL), Role.PREFILL, "p")
    runtime = await start_runtime(nursery, engine, "p")
    send, receive = trio.open_memory_channel[Reply](8)
    runtime.submit(request("gone", prompt=3000), send)
    assert await receive.receive() == Ack("gone")
    receive.close()  # the caller is gone before the prefill (~0.2 s) hands its KV over
    with trio.fail_after(10):
        while runtime.statistics().inflight:
            await trio.sleep(0.01)
    await trio.testing.wait_all_tasks_blocked()
    assert runtime.statistics().kv_released_total == 1
    assert engine.statistics().kv_transfers_held == 0


async def test_kv_pull_from_a_vanished_prefill_worker_fails(nursery: trio.Nursery) -> None:
    decode = await start_worker(nursery, role=Role.DECODE)
    to_decode = await connect_worker(instance_of(decode), nursery)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there any more
    handle = KvHandle("gone", f"tcp://127.0.0.1:{port}", "t1", 10)
    req = request("orphan-leg", max_tokens=2, prompt=10)
    with pytest.raises(WorkerError) as info:
        await collect(to_decode, GenerateRequest("x", MODEL, req.token_ids, req.sampling, handle))
    assert info.value.code is ErrorCode.KV_TRANSFER_FAILED


async def test_drain_sends_goaway_and_lets_streams_finish(nursery: trio.Nursery) -> None:
    stop = trio.Event()
    config = WorkerConfig(engine_config=MockerConfig(speedup_ratio=200.0), drain_timeout=10)
    done = trio.Event()

    async def run_worker(*, task_status: trio.TaskStatus[RunningWorker]) -> None:
        await serve_worker(config, shutdown_trigger=stop.wait, task_status=task_status)
        done.set()

    worker = await nursery.start(run_worker)
    client = await connect_worker(instance_of(worker), nursery)
    async with client.stream(request("inflight", max_tokens=300)) as chunks:
        got = [await chunks.__anext__()]
        stop.set()
        got += [c async for c in chunks]
        assert client.state is ClientState.DRAINING
        with pytest.raises(CannotConnect, match="goaway"):
            await collect(client, request("late"))
    assert len(tokens_of(got)) == 300
    assert got[-1].finish_reason is FinishReason.LENGTH
    with trio.fail_after(5):
        await done.wait()
    assert worker.runtime.statistics().served_total == 1


# ---- memory streams on virtual time ----------------------------------------------------------

IDENTITY = HelloOk(PROTOCOL_VERSION, "agg", "w1", MODEL)
INSTANCE = WorkerInstance("w1", Role.AGG, MODEL, "tcp://fake:1")


class ScriptedWorker:
    """The far end of a memory stream, playing a worker by the test's rules."""

    def __init__(
        self,
        *,
        ack: bool = True,
        answer_pings: bool = True,
        chunks: int = 2,
        goaway_after_ack: bool = False,
    ) -> None:
        self.ack = ack
        self.answer_pings = answer_pings
        self.chunks = chunks
        self.goaway_after_ack = goaway_after_ack
        self.received: list[Frame] = []
        self.connects: list[float] = []
        self.streams: list[trio.abc.Stream] = []
        self._scopes: list[trio.CancelScope] = []

    def drop(self) -> None:
        """Close the latest connection from the worker's side."""
        self._scopes[-1].cancel()

    async def serve(self, stream: trio.abc.Stream) -> None:
        handshake, decoder = ServerHandshake(IDENTITY, secret=None), FrameDecoder()
        scope = trio.CancelScope()
        self._scopes.append(scope)
        async with stream:
            with scope:
                await self._serve(stream, handshake, decoder)

    async def _serve(
        self, stream: trio.abc.Stream, handshake: ServerHandshake, decoder: FrameDecoder
    ) -> None:
        while data := await stream.receive_some(65536):
            for frame in decoder.feed(data):
                self.received.append(frame)
                if handshake.peer is None:
                    await stream.send_all(encode(handshake.receive(frame)))
                else:
                    await self.answer(stream, frame)

    async def answer(self, stream: trio.abc.Stream, frame: Frame) -> None:
        if isinstance(frame, Ping) and self.answer_pings:
            await stream.send_all(encode(Pong(frame.seq)))
        elif isinstance(frame, GenerateRequest) and self.ack:
            rid = frame.request_id
            out: list[Frame] = [Ack(rid), *(Chunk(rid, [i]) for i in range(self.chunks))]
            if self.goaway_after_ack:
                out.append(GoAway("draining"))
            await stream.send_all(b"".join(encode(f) for f in out))

    async def finish(self, stream: trio.abc.Stream, rid: str) -> None:
        await stream.send_all(encode(Chunk(rid, [99], FinishReason.LENGTH)) + encode(End(rid)))

    def connector(self, nursery: trio.Nursery) -> Callable[[], Awaitable[trio.abc.Stream]]:
        async def connect() -> trio.abc.Stream:
            self.connects.append(trio.current_time())
            client_end, server_end = trio.testing.memory_stream_pair()
            self.streams.append(server_end)
            nursery.start_soon(self.serve, server_end)
            return client_end

        return connect


async def fake_client(
    nursery: trio.Nursery, worker: ScriptedWorker, **config: float
) -> TcpWorkerClient:
    client = TcpWorkerClient(
        INSTANCE,
        config=PlaneConfig(backoff_jitter=0.0, **config),  # type: ignore[arg-type]
        connector=worker.connector(nursery),
    )
    await nursery.start(client.run)
    await client.wait_connected()
    return client


async def test_ack_timeout_is_cannot_connect_at_exactly_ack_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(ack=False)
    client = await fake_client(nursery, worker, ack_timeout=5.0, heartbeat_interval=1.0)
    start = trio.current_time()
    with pytest.raises(AckTimeout):
        async with client.stream(request("silent")):
            pytest.fail("entered without an ACK")
    assert trio.current_time() - start == 5.0
    await trio.testing.wait_all_tasks_blocked()
    assert Cancel("silent") in worker.received  # the worker is told to drop it
    assert client.state is ClientState.CONNECTED  # pings answered: connection is fine


async def test_connect_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def never() -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError

    client = TcpWorkerClient(
        INSTANCE, config=PlaneConfig(connect_timeout=2.5, backoff_jitter=0), connector=never
    )
    await nursery.start(client.run)
    start = trio.current_time()
    with pytest.raises(CannotConnect) as info:
        await client.wait_connected()
    assert trio.current_time() - start == 2.5
    assert isinstance(info.value.__cause__, ConnectTimeout)


async def test_heartbeat_loss_fails_inflight_streams(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(answer_pings=False, chunks=1)
    client = await fake_client(nursery, worker, heartbeat_interval=1.0, heartbeat_timeout=2.0)
    start = trio.current_time()
    async with client.stream(request("doomed")) as chunks:
        assert (await chunks.__anext__()).token_ids == [0]
        with pytest.raises(Disconnected, match="heartbeat"):
            await chunks.__anext__()
    assert trio.current_time() - start == 1.0 + 2.0  # first ping, then its deadline
    assert client.statistics().disconnects_total == 1


async def test_reachable_until_the_heartbeats_stop(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """What membership asks of a worker discovery no longer lists: is the connection
    alive, and when is it lost. A silent worker is lost at its heartbeat deadline."""
    worker = ScriptedWorker(answer_pings=False)
    client = await fake_client(nursery, worker, heartbeat_interval=1.0, heartbeat_timeout=2.0)
    assert client.reachable
    start = trio.current_time()
    await client.wait_lost()
    assert trio.current_time() - start == 1.0 + 2.0
    assert not client.reachable


async def test_answered_heartbeats_keep_an_idle_connection(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker()
    client = await fake_client(nursery, worker, heartbeat_interval=1.0, heartbeat_timeout=2.0)
    await trio.sleep(60.5)
    assert client.state is ClientState.CONNECTED
    assert len(worker.connects) == 1
    assert sum(isinstance(f, Ping) for f in worker.received) == 60
    assert client.statistics().rtt_s == 0.0


async def test_reconnect_backoff_timing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker()
    attempts: list[float] = []
    good = worker.connector(nursery)

    async def flaky() -> trio.abc.Stream:
        attempts.append(trio.current_time())
        if len(attempts) <= 5:
            raise OSError("connection refused")
        return await good()

    client = TcpWorkerClient(
        INSTANCE,
        config=PlaneConfig(backoff_initial=0.1, backoff_max=1.0, backoff_jitter=0.0),
        connector=flaky,
    )
    start = trio.current_time()
    await nursery.start(client.run)
    await trio.testing.wait_all_tasks_blocked()
    # While backing off, stream() fails at once instead of waiting.
    with pytest.raises(CannotConnect, match="connection refused"):
        async with client.stream(request("early")):
            pass
    assert trio.current_time() == start
    await trio.sleep(2.5 + 1e-6)  # virtual: just past the sixth attempt
    assert [round(t - start, 6) for t in attempts] == [0, 0.1, 0.3, 0.7, 1.5, 2.5]
    assert client.state is ClientState.CONNECTED
    assert len(await collect_n(client, request("late"), 2)) == 2

    # A broken connection is re-dialled at once (the backoff starts over).
    broke_at = trio.current_time()
    worker.drop()
    await trio.testing.wait_all_tasks_blocked()
    assert attempts[6:] == [broke_at]
    assert client.state is ClientState.CONNECTED


async def collect_n(client: TcpWorkerClient, req: GenerateRequest, n: int) -> list[int]:
    """Read at least *n* tokens of a scripted stream (it never sends End) and leave."""
    got: list[int] = []
    async with client.stream(req) as chunks:
        while len(got) < n:
            got += (await chunks.__anext__()).token_ids
    return got


async def test_slow_consumer_is_cut_off_alone(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(chunks=10)
    client = await fake_client(nursery, worker, stream_buffer=4)
    async with client.stream(request("slow")) as chunks:
        await trio.testing.wait_all_tasks_blocked()  # all 10 chunks have arrived
        got = await chunks.__anext__()  # what fitted the buffer, merged into one chunk
        with pytest.raises(Disconnected, match="fell 4 replies behind"):
            await chunks.__anext__()
    assert got.token_ids == [0, 1, 2, 3]
    assert Cancel("slow") in worker.received
    assert client.state is ClientState.CONNECTED  # the connection itself is fine
    assert (await collect_n(client, request("next"), 2))[:2] == [0, 1]


async def test_goaway_stops_new_streams_but_not_inflight_ones(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(goaway_after_ack=True, chunks=1)
    client = await fake_client(nursery, worker)
    async with client.stream(request("old")) as chunks:
        assert (await chunks.__anext__()).token_ids == [0]
        await trio.testing.wait_all_tasks_blocked()
        assert client.state is ClientState.DRAINING
        with pytest.raises(CannotConnect, match="goaway"):
            await collect_n(client, request("new"), 1)
        await worker.finish(worker.streams[0], "old")
        assert [c.token_ids async for c in chunks] == [[99]]
    assert len(worker.connects) == 1  # no redial while the old connection drains


async def test_fault_from_the_worker_breaks_the_connection(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(chunks=0)
    client = await fake_client(nursery, worker)
    async with client.stream(request("x")) as chunks:
        await worker.streams[0].send_all(encode(Fault("protocol_error", "you sent junk")))
        with pytest.raises(Disconnected, match="you sent junk"):
            await chunks.__anext__()


async def test_closing_the_client_fails_streams_and_refuses_new_ones(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(chunks=0)
    client = await fake_client(nursery, worker)
    async with client.stream(request("x")) as chunks:
        await client.aclose()
        with pytest.raises(Disconnected):
            await chunks.__anext__()
    with pytest.raises(CannotConnect, match="closed"):
        await collect_n(client, request("y"), 1)


async def test_duplicate_request_id_on_one_connection(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(chunks=0)
    client = await fake_client(nursery, worker)
    async with client.stream(request("dup")):
        with pytest.raises(WorkerError) as info:
            await collect_n(client, request("dup"), 1)
        assert info.value.code is ErrorCode.INVALID_REQUEST


async def test_wrong_worker_at_the_address_is_refused(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker()
    other = WorkerInstance("someone-else", Role.AGG, MODEL, "tcp://fake:1")
    client = TcpWorkerClient(other, connector=worker.connector(nursery))
    await nursery.start(client.run)
    with pytest.raises(CannotConnect, match="expected worker someone-else") as info:
        await client.wait_connected()
    assert isinstance(info.value.__cause__, HandshakeFailed)
    assert info.value.__cause__.code == "wrong_worker"


async def test_worker_drops_a_peer_that_stops_reading(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=REAL), Role.AGG, "w1")
    runtime = await start_runtime(nursery, engine, "w1")
    server = PlaneServer(runtime, role=Role.AGG, model=MODEL, config=ServerConfig(write_timeout=3))
    ours, theirs = trio.testing.lockstep_stream_pair()  # a write waits for the reader
    nursery.start_soon(server.handle_stream, theirs)
    handshake = ClientHandshake(role="frontend", peer_id="sulky", model="", secret=None)
    await ours.send_all(encode(handshake.start()))
    (hello_ok,) = FrameDecoder().feed(await ours.receive_some(65536))
    assert handshake.receive(hello_ok) is None
    await ours.send_all(encode(request("unread", max_tokens=100_000)))
    sent = trio.current_time()
    # We never read again: the worker's first write (the ACK) blocks.
    assert await runtime.drain(60)
    assert trio.current_time() - sent == 3
    assert runtime.statistics().cancelled_total == 1
    assert server.statistics().write_timeouts_total == 1
    assert engine.statistics().kv_blocks_used == 0


# ---- stall-aware attribution, idle streams, reported load -----------------------------------


async def attributed_client(
    nursery: trio.Nursery, worker: ScriptedWorker, attribution: StallAttribution, **config: float
) -> TcpWorkerClient:
    client = TcpWorkerClient(
        INSTANCE,
        config=PlaneConfig(backoff_jitter=0.0, **config),  # type: ignore[arg-type]
        connector=worker.connector(nursery),
        attribution=attribution,
    )
    await nursery.start(client.run)
    await client.wait_connected()
    return client


@pytest.mark.parametrize("stalled", [True, False])
async def test_an_ack_missed_while_our_loop_stalled_is_excused(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, stalled: bool
) -> None:
    log = StallLog()
    attribution = StallAttribution(log)
    worker = ScriptedWorker(ack=False)
    client = await attributed_client(nursery, worker, attribution, ack_timeout=5.0)
    start = trio.current_time()
    if stalled:
        log.add(start + 4.0, 2.0)  # our loop stood still for 2 of the 5 s
    else:
        log.add(start + 4.0, 0.5)  # under a quarter of the window: the worker's fault
    with pytest.raises(AckTimeout) as info:
        async with client.stream(request("late")):
            pytest.fail("entered without an ACK")
    assert info.value.excused is stalled
    assert attribution.excused_total == int(stalled)


async def test_a_kv_handle_that_arrives_after_its_stream_left_is_released(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The frontend gave up waiting for the ACK; the prefill went on and its handle
    # comes back to a stream nobody reads. Unless released, that KV is held for
    # nothing until the worker's transfer timeout.
    worker = ScriptedWorker(ack=False)
    client = await attributed_client(nursery, worker, StallAttribution(StallLog()), ack_timeout=1.0)
    with pytest.raises(AckTimeout):
        async with client.stream(request("late")):
            pytest.fail("entered without an ACK")
    handle = KvHandle("w", "tcp://127.0.0.1:1", "kv-late", 100)
    late: list[Frame] = [
        Ack("late"),
        Chunk("late", [], kv_handle=handle),
        End("late"),
        Chunk("late", [7]),
    ]
    await worker.streams[-1].send_all(b"".join(encode(f) for f in late))
    await trio.testing.wait_all_tasks_blocked()
    assert [f for f in worker.received if isinstance(f, KvRelease)] == [KvRelease("kv-late")]


@pytest.mark.parametrize("attributed", [True, False])
async def test_a_heartbeat_missed_while_our_loop_stalled_keeps_the_connection(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, attributed: bool
) -> None:
    log = StallLog()
    attribution = StallAttribution(log, enabled=attributed)
    worker = ScriptedWorker(answer_pings=False)
    client = await attributed_client(
        nursery, worker, attribution, heartbeat_interval=1.0, heartbeat_timeout=2.0
    )
    start = trio.current_time()
    log.add(start + 10.0, 10.0)  # a loop that stood still through every heartbeat window
    await trio.sleep(9.5)
    if attributed:
        assert client.state is ClientState.CONNECTED
        assert len(worker.connects) == 1
        assert attribution.excused_total == 3  # pings at 1, 4 and 7 s, each given up on
    else:
        assert client.statistics().disconnects_total >= 1
        assert attribution.excused_total == 0


async def test_a_stream_without_replies_on_a_live_connection_fails(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    worker = ScriptedWorker(chunks=1)  # ACKs, sends one chunk, then nothing; pings answered
    client = await fake_client(nursery, worker, heartbeat_interval=1.0, stream_timeout=10.0)
    start = trio.current_time()
    async with client.stream(request("stuck")) as chunks:
        assert (await chunks.__anext__()).token_ids == [0]
        with pytest.raises(Disconnected, match="no reply for 10 s"):
            await chunks.__anext__()
    assert 10.0 <= trio.current_time() - start <= 11.0  # checked with each heartbeat
    await trio.testing.wait_all_tasks_blocked()
    assert Cancel("stuck") in worker.received
    assert client.state is ClientState.CONNECTED  # the connection itself is fine


async def test_the_load_a_worker_reports_reaches_its_client(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    class Loaded(ScriptedWorker):
        async def answer(self, stream: trio.abc.Stream, frame: Frame) -> None:
            if isinstance(frame, Ping):
                await stream.send_all(encode(Pong(frame.seq, WorkerLoad(3, 1, 0.25))))
            else:
                await super().answer(stream, frame)

    client = await fake_client(nursery, Loaded(), heartbeat_interval=1.0)
    assert client.load is None
    await trio.sleep(1.5)
    assert client.load == WorkerLoad(3, 1, 0.25)


async def test_a_served_worker_reports_its_load(nursery: trio.Nursery) -> None:
    worker = await start_worker(nursery)
    server = worker.server
    report = server.load_report()
    assert report is not None
    assert report.kv_usage == 0.0
    assert (report.active, report.waiting) == (0, 0)


# ---- the worker's heartbeat timeout (a peer that vanished without closing) ------------------

SLOW = 0.01  # mocker at 1/100 of GPU speed: a step takes ~0.6 s of virtual time


async def handshaken_peer(
    nursery: trio.Nursery, server: PlaneServer, *, lockstep: bool = False
) -> trio.abc.Stream:
    """Our end of a memory stream that *server* serves, past the handshake."""
    ours, theirs = (
        trio.testing.lockstep_stream_pair() if lockstep else trio.testing.memory_stream_pair()
    )
    nursery.start_soon(server.handle_stream, theirs)
    handshake = ClientHandshake(role="frontend", peer_id="gone", model="", secret=None)
    await ours.send_all(encode(handshake.start()))
    (hello_ok,) = FrameDecoder().feed(await ours.receive_some(65536))
    assert handshake.receive(hello_ok) is None
    return ours


async def receive_frames(stream: trio.abc.Stream, decoder: FrameDecoder, n: int) -> list[Frame]:
    frames: list[Frame] = []
    while len(frames) < n:
        frames += decoder.feed(await stream.receive_some(65536))
    return frames


def test_the_worker_waits_for_a_live_clients_longest_gap_between_pings() -> None:
    """A client pings an interval after the last pong, which may take its timeout."""
    client = PlaneConfig()
    assert ServerConfig().heartbeat_timeout >= client.heartbeat_interval + client.heartbeat_timeout


async def test_worker_drops_a_silent_peer_after_exactly_the_heartbeat_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=SLOW), Role.AGG, "w1")
    runtime = await start_runtime(nursery, engine, "w1")
    server = PlaneServer(runtime, role=Role.AGG, model=MODEL)
    timeout = server.config.heartbeat_timeout
    assert timeout == 15.0
    ours = await handshaken_peer(nursery, server)
    await ours.send_all(encode(request("orphan", max_tokens=100_000)))
    silent_since = trio.current_time()
    ack, first = await receive_frames(ours, FrameDecoder(), 2)
    assert (ack, type(first)) == (Ack("orphan"), Chunk)
    assert engine.statistics().kv_blocks_used > 0
    # The memory stream never blocks a write, so only the silence can give us away.
    assert await runtime.drain(60)
    assert trio.current_time() - silent_since == timeout
    assert runtime.statistics().cancelled_total == 1
    assert engine.statistics().kv_blocks_used == 0
    await trio.testing.wait_all_tasks_blocked()
    stats = server.statistics()
    assert (stats.peer_timeouts_total, stats.write_timeouts_total, stats.connections) == (1, 0, 0)
    assert server.stats_values()["plane_peer_timeouts_total"] == 1


async def test_worker_keeps_a_peer_that_only_pings(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=SLOW), Role.AGG, "w1")
    runtime = await start_runtime(nursery, engine, "w1")
    server = PlaneServer(runtime, role=Role.AGG, model=MODEL)
    ours = await handshaken_peer(nursery, server)
    await ours.send_all(encode(request("long", max_tokens=100_000)))
    for seq in range(1, 25):  # two minutes of pings, nothing else
        await trio.sleep(5.0)
        await ours.send_all(encode(Ping(seq)))
    last_ping = trio.current_time()
    assert server.statistics().connections == 1
    assert runtime.statistics().inflight == 1
    assert server.statistics().peer_timeouts_total == 0
    # Then it falls silent: the timeout counts from its last ping.
    assert await runtime.drain(60)
    assert trio.current_time() - last_ping == server.config.heartbeat_timeout
    assert engine.statistics().kv_blocks_used == 0


async def test_an_idle_plane_connection_keeps_itself_alive(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The real client at its default ping interval against the default timeout."""
    engine = MockerEngine(MockerConfig(speedup_ratio=FAST), Role.AGG, "w1")
    runtime = await start_runtime(nursery, engine, "w1")
    server = PlaneServer(runtime, role=Role.AGG, model=MODEL)
    ours, theirs = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle_stream, theirs)
    conn = await open_connection(
        ours, role="frontend", peer_id="idle", secret=None, config=PlaneConfig()
    )
    await nursery.start(conn.run)
    await trio.sleep(300)
    assert not conn.unusable.is_set()
    assert server.statistics().connections == 1
    assert server.statistics().peer_timeouts_total == 0
    async with conn.stream(request("still-there", max_tokens=3)) as chunks:
        assert len([t async for c in chunks for t in c.token_ids]) == 3


async def test_worker_cancels_the_kv_pull_of_a_silent_peer(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = MockerEngine(
        MockerConfig(speedup_ratio=FAST, kv_bytes_per_token=100_000), Role.PREFILL, "p1"
    )
    runtime = await start_runtime(nursery, engine, "p1")
    server = PlaneServer(
        runtime,
        role=Role.PREFILL,
        model=MODEL,
        kv_source=engine,
        config=ServerConfig(write_timeout=3600),  # only the silence may end it
    )
    ours = await handshaken_peer(nursery, server, lockstep=True)  # a write waits for us
    await ours.send_all(encode(request("p", max_tokens=1, prompt=500)))
    decoder: FrameDecoder = FrameDecoder()
    frames = await receive_frames(ours, decoder, 3)  # ack, the handle, end
    with_handle = frames[1]
    assert isinstance(with_handle, Chunk)
    handle = with_handle.kv_handle
    assert handle is not None
    await ours.send_all(encode(KvPull(handle.transfer_id)))  # 50 MB: far more than fits
    silent_since = trio.current_time()
    await trio.testing.wait_all_tasks_blocked()
    assert engine.statistics().kv_transfers_held == 0  # released to the pull
    assert server.statistics().connections == 1  # the pull waits for us to read
    await trio.sleep(server.config.heartbeat_timeout - 0.001)
    assert server.statistics().connections == 1
    await trio.sleep(0.001)
    await trio.testing.wait_all_tasks_blocked()
    assert server.statistics().connections == 0  # the pull task is gone with it
    assert server.statistics().peer_timeouts_total == 1
    assert trio.current_time() - silent_since == server.config.heartbeat_timeout


def _lowat(stream: object) -> int:
    assert isinstance(stream, trio.SocketStream)
    return stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


async def test_plane_sockets_send_without_trios_watermark(nursery: trio.Nursery) -> None:
    # trio caps unsent bytes at 16 KiB per socket, so a plane connection's large frames
    # (a 40k-token request, a prompt's KV) went out 16 KiB per wake-up of its writer.
    # Both ends of a real connection lift the cap; trio's own streams keep it.
    worker = await start_worker(nursery)
    client = await connect_worker(instance_of(worker), nursery)
    assert len(tokens_of(await collect(client, request("one", max_tokens=2)))) == 2
    stream = await tcp_connector(worker.address)()
    plain = await trio.open_tcp_stream(*parse_tcp_address(worker.address))
    try:
        assert _lowat(stream) == -1
        assert _lowat(plain) == 16384  # what trio does by itself
        with trio.fail_after(5):
            while len(worker.server._connections) < 3:
                await trio.sleep(0.01)
        assert [_lowat(c.stream) for c in worker.server._connections] == [-1, -1, -1]
    finally:
        await stream.aclose()
        await plain.aclose()
