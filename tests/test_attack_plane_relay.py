"""Attack: a relay between a frontend and a worker, holding no secret.

The plane's handshake proves that both ends hold the secret; a relay that forwards it
untouched learns nothing, but once it has passed, the connection is open to whoever
sits on it. These tests put a relay on loopback between an honest client and a worker
(both with the secret), let the real handshake through, and then have the relay
inject a request of its own, replay one of the client's frames, or tamper with one.
The worker must serve none of them: every frame after the handshake is authenticated
with the session's keys (docs/request-plane.md, "Session binding"), so the worker
closes the connection instead, and counts it.

A plane client must also not buffer much from a peer that has not proved the secret
(a fake worker that announces a huge frame during the handshake).
"""

from __future__ import annotations

import struct
from functools import partial

import pytest
import trio

from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.connection import HandshakeFailed, PlaneConfig, open_connection
from headwater.wire import GenerateRequest, Role, SamplingParams
from headwater.wire.addresses import format_tcp_address, parse_tcp_address
from headwater.wire.codec import FrameDecoder, encode
from headwater.wire.errors import AuthError, ProtocolError
from headwater.wire.frames import PROTOCOL_VERSION, HelloOk, Ping
from headwater.wire.handshake import ClientHandshake, ServerHandshake
from headwater.wire.session import TAG_BYTES, Session, derive_session
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

MODEL = "deepseek-v4"
SECRET = b"relay-test-secret-6f1c2a9e4b7d"
DEADLINE = 5.0  # s: every wait in this module is bounded by it


def request(rid: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        rid, MODEL, list(range(3, 40)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


async def start_worker(nursery: trio.Nursery) -> RunningWorker:
    config = WorkerConfig(
        role=Role.AGG, engine_config=MockerConfig(speedup_ratio=100_000.0), secret=SECRET
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


def served(worker: RunningWorker) -> int:
    return worker.runtime.statistics().served_total


class Relay:
    """Forwards bytes between each client that connects and the worker, and lets the
    test act on the client → worker direction once the worker's hello_ok has passed.

    The relay reads the handshake (its frames are plain), then cuts the client's
    later bytes into frames by their length prefix alone: it cannot read or forge
    what they hold, but it can drop, repeat or alter them, and add its own.
    """

    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address
        self.handshake_passed = trio.Event()
        self.upstream_closed = trio.Event()  # the worker closed its side
        self.client_frames: list[bytes] = []  # client → worker frames after hello_ok
        self.frame_arrived = trio.Event()
        self._to_worker: trio.SocketStream | None = None

    async def serve(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(partial(trio.serve_listeners, self._handle, listeners))
        return format_tcp_address("127.0.0.1", port)

    async def inject(self, data: bytes) -> None:
        assert self._to_worker is not None
        await self._to_worker.send_all(data)

    async def _handle(self, client: trio.SocketStream) -> None:
        if self._to_worker is not None:  # one relayed connection per test
            await client.aclose()
            return
        host, port = parse_tcp_address(self.worker_address)
        worker = await trio.open_tcp_stream(host, port)
        self._to_worker = worker
        async with client, worker, trio.open_nursery() as nursery:
            nursery.start_soon(self._downstream, worker, client, nursery.cancel_scope)
            nursery.start_soon(self._upstream, client, worker, nursery.cancel_scope)

    async def _downstream(
        self, worker: trio.SocketStream, client: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        decoder = FrameDecoder()
        try:
            while data := await worker.receive_some(65536):
                if not self.handshake_passed.is_set():
                    try:
                        frames = decoder.feed(data)
                    except ProtocolError:
                        frames = []
                    if any(isinstance(f, HelloOk) for f in frames):
                        self.handshake_passed.set()
                await client.send_all(data)
        except trio.BrokenResourceError:
            pass
        self.upstream_closed.set()
        done.cancel()

    async def _upstream(
        self, client: trio.SocketStream, worker: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        pending = b""
        try:
            while data := await client.receive_some(65536):
                if self.handshake_passed.is_set():
                    pending += data
                    while len(pending) >= 4:
                        (size,) = struct.unpack(">I", pending[:4])
                        if len(pending) < 4 + size:
                            break
                        self.client_frames.append(pending[: 4 + size])
                        pending = pending[4 + size :]
                        self.frame_arrived.set()
                await worker.send_all(data)
        except trio.BrokenResourceError:
            pass
        done.cancel()


async def relayed_client(nursery: trio.Nursery) -> tuple[RunningWorker, Relay, object]:
    worker = await start_worker(nursery)
    relay = Relay(worker.address)
    address = await relay.serve(nursery)
    instance = WorkerInstance(worker.worker_id, worker.role, worker.model, address)
    client = await connect_worker(instance, nursery, secret=SECRET)
    with trio.fail_after(DEADLINE):
        await relay.handshake_passed.wait()
    return worker, relay, client


async def test_a_request_injected_after_a_relayed_handshake_is_not_served(
    nursery: trio.Nursery,
) -> None:
    worker, relay, _client = await relayed_client(nursery)
    await relay.inject(encode(request("injected-1")))
    with trio.move_on_after(DEADLINE):
        await relay.upstream_closed.wait()
    assert served(worker) == 0, "the worker served a request the relay injected"
    assert relay.upstream_closed.is_set(), "the worker kept the tampered connection open"
    assert worker.server.statistics().auth_failures_total == 1


async def test_a_replayed_request_frame_is_not_served_again(nursery: trio.Nursery) -> None:
    worker, relay, client = await relayed_client(nursery)
    async with client.stream(request("honest-1")) as chunks:  # type: ignore[attr-defined]
        tokens = [t async for c in chunks for t in c.token_ids]
    assert len(tokens) == 4
    assert served(worker) == 1
    (frame,) = relay.client_frames  # the request, the client's only frame so far
    await relay.inject(frame)  # the same bytes again, tag and all
    with trio.move_on_after(DEADLINE):
        await relay.upstream_closed.wait()
    assert served(worker) == 1, "the worker served a replayed request twice"
    assert relay.upstream_closed.is_set()


async def test_an_altered_frame_is_refused(nursery: trio.Nursery) -> None:
    worker, relay, client = await relayed_client(nursery)
    async with client.stream(request("honest-1")) as chunks:  # type: ignore[attr-defined]
        [c async for c in chunks]
    (frame,) = relay.client_frames
    # The same request again with one byte of its body changed: the id is unknown
    # to the worker by now, so unauthenticated it would be served.
    altered = bytearray(frame)
    altered[frame.index(b"honest-1") + 7] = ord("2")
    await relay.inject(bytes(altered))
    with trio.move_on_after(DEADLINE):
        await relay.upstream_closed.wait()
    assert served(worker) == 1
    assert relay.upstream_closed.is_set()


# ---- the session's keys, without sockets ---------------------------------------------


def handshaken(secret: bytes | None = SECRET) -> tuple[ClientHandshake, ServerHandshake]:
    identity = HelloOk(PROTOCOL_VERSION, "agg", "w1", MODEL)
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=secret)
    server = ServerHandshake(identity, secret=secret)
    reply = server.receive(client.start())
    while (answer := client.receive(reply)) is not None:
        reply = server.receive(answer)
    assert client.peer is not None
    assert server.peer is not None
    return client, server


def sessions() -> tuple[Session, Session]:
    """The client's and the server's session after one handshake with the secret."""
    client, server = handshaken()
    assert client.session is not None
    assert server.session is not None
    return client.session, server.session


def test_both_ends_derive_the_same_session_and_each_direction_its_own_key() -> None:
    client, server = sessions()
    frame = encode(Ping(1), mac=client.send)
    assert len(frame) == len(encode(Ping(1))) + TAG_BYTES
    server_decoder = FrameDecoder(mac=server.receive)
    assert server_decoder.feed(frame) == [Ping(1)]
    # A frame the server sent, reflected back to it, fails: the keys differ by direction.
    with pytest.raises(AuthError):
        server_decoder.feed(encode(Ping(2), mac=server.send))


def test_a_dropped_frame_fails_the_next_one() -> None:
    client, server = sessions()
    encode(Ping(1), mac=client.send)  # signed, never delivered
    with pytest.raises(AuthError):
        FrameDecoder(mac=server.receive).feed(encode(Ping(2), mac=client.send))


def test_a_replayed_frame_fails() -> None:
    client, server = sessions()
    decoder = FrameDecoder(mac=server.receive)
    one = encode(Ping(1), mac=client.send)
    assert decoder.feed(one) == [Ping(1)]
    with pytest.raises(AuthError):
        decoder.feed(one)


def test_another_handshake_gives_other_keys() -> None:
    client_a, _ = sessions()
    _, server_b = sessions()
    with pytest.raises(AuthError):
        FrameDecoder(mac=server_b.receive).feed(encode(Ping(1), mac=client_a.send))


def test_without_a_secret_there_is_no_session() -> None:
    client, server = handshaken(secret=None)
    assert client.session is None
    assert server.session is None


def test_the_session_binds_what_the_hello_and_hello_ok_said() -> None:
    """A relay that rewrites the client's hello (its role or id) or the worker's
    hello_ok (its id, model) leaves the two ends with different keys."""
    nonce_c, nonce_s = b"c" * 32, b"s" * 32
    honest = derive_session(
        SECRET, "client", nonce_c, nonce_s, ("frontend", "fe", ""), ("agg", "w1", MODEL)
    )
    for hello, hello_ok in [
        (("decode", "fe", ""), ("agg", "w1", MODEL)),
        (("frontend", "fe", ""), ("agg", "w2", MODEL)),
        (("frontend", "fe", ""), ("agg", "w1", "other")),
    ]:
        server = derive_session(SECRET, "server", nonce_c, nonce_s, hello, hello_ok)
        with pytest.raises(AuthError):
            FrameDecoder(mac=server.receive).feed(encode(Ping(1), mac=honest.send))


# ---- a fake worker that floods the handshake --------------------------------------------


async def test_a_client_refuses_a_huge_frame_before_the_worker_proved_the_secret(
    nursery: trio.Nursery,
) -> None:
    """Before the handshake the client takes frames of at most 16 KiB: a peer that has
    proved nothing announcing 32 MiB is refused from the length header, at once."""

    async def fake_worker(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)  # the hello
            await stream.send_all(struct.pack(">I", 32 << 20) + b"\x00" * 1024)
            await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(partial(trio.serve_listeners, fake_worker, listeners))
    port = listeners[0].socket.getsockname()[1]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(1.0), pytest.raises(HandshakeFailed) as failed:
        await open_connection(
            stream, role="frontend", peer_id="fe", secret=SECRET, config=PlaneConfig()
        )
    assert failed.value.code == "frame_too_large"
