"""The hypercorn / quart-trio pitfalls of docs/architecture.md stay fixed.

Policy: real loopback sockets for the keep-alive behaviour; the write deadline is
checked on headwater's TCPServer (frontend.http.serving) over a lockstep memory stream
with virtual time, since filling a real socket's send buffer would take megabytes.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing
from hypercorn.events import Closed, RawData

from frontend.http.serving import ServerConfig, tcp_server
from frontend.http.serving.tcp_server import HeadwaterTCPServer

from frontend_fixture import serve_frontend


async def _open(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def _read_response(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head


async def _post_json(stream: trio.SocketStream, path: bytes, payload: bytes) -> None:
    await stream.send_all(
        b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" % path
        + b"Content-Length: %d\r\n\r\n" % len(payload)
        + payload
    )


async def _read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        seen += await stream.receive_some(65536)
    return seen


@pytest.mark.slow
async def test_keep_alive_idle_timeout_closes_the_connection(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, keep_alive_timeout=0.5) as (_, url):
        stream = await _open(url)
        request = b"GET /live HTTP/1.1\r\nHost: test\r\nConnection: keep-alive\r\n\r\n"
        await stream.send_all(request)
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
        # The connection is reused: a second request on it works.
        await stream.send_all(request)
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
        # Then it idles; the server must close it after keep_alive_timeout.
        with trio.fail_after(5):
            assert await stream.receive_some(1024) == b""
        await stream.aclose()


@pytest.mark.slow
async def test_each_request_moves_the_idle_deadline(http_parser: str) -> None:
    # The idle timer is one deadline per connection: a request lifts it, the end of the
    # response sets it afresh. A connection used more often than keep_alive_timeout
    # stays open however long it lives, and still closes once it idles.
    async with serve_frontend(http_parser=http_parser, keep_alive_timeout=0.6) as (_, url):
        stream = await _open(url)
        request = b"GET /live HTTP/1.1\r\nHost: test\r\nConnection: keep-alive\r\n\r\n"
        start = trio.current_time()
        while trio.current_time() - start < 2.0:  # > 3 × keep_alive_timeout
            await stream.send_all(request)
            assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
            await trio.sleep(0.3)
        with trio.fail_after(5):
            assert await stream.receive_some(1024) == b""
        await stream.aclose()


@pytest.mark.slow
async def test_a_request_longer_than_the_idle_timeout_is_not_cut(http_parser: str) -> None:
    # While a request runs its connection is not idle: a stream taking several
    # keep_alive_timeouts arrives whole, and the connection serves the next request.
    async with serve_frontend(
        http_parser=http_parser, keep_alive_timeout=0.3, speedup_ratio=1.0
    ) as (fe, url):
        body = {
            "model": fe.pipeline.model_name,
            "prompt": "hello",
            "max_tokens": 200,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=url) as client:
            start = trio.current_time()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert trio.current_time() - start > 0.9
            assert events[-1] == "data: [DONE]", events[-3:]
            assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] is not None
            assert (await client.get("/live")).status_code == 200


async def test_sse_responses_are_not_cut_by_quart_timeouts() -> None:
    async with serve_frontend() as (fe, _):
        assert fe.app.config["RESPONSE_TIMEOUT"] is None
        assert fe.app.config["BODY_TIMEOUT"] is None


class _FakeProtocol:
    protocol = None  # hypercorn's ProtocolWrapper holds the HTTP/1.1 protocol here

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server_side, client_side = trio.testing.lockstep_stream_pair()
    fake = _server_on(server_side, write_timeout=7.0)
    start = trio.current_time()
    # Nobody reads client_side: without a deadline this send would block forever.
    await fake.protocol_send(RawData(b"x" * 1024))
    assert trio.current_time() - start == 7.0
    assert any(isinstance(e, Closed) for e in fake.protocol.events)  # type: ignore[attr-defined]
    await client_side.aclose()


async def test_a_reading_client_gets_its_bytes(autojump_clock: trio.testing.MockClock) -> None:
    server_side, client_side = trio.testing.lockstep_stream_pair()
    fake = _server_on(server_side, write_timeout=7.0)
    received = bytearray()

    async def reader() -> None:
        while len(received) < 3:
            received.extend(await client_side.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await fake.protocol_send(RawData(b"abc"))
    assert bytes(received) == b"abc"
    assert fake.protocol.events == []  # type: ignore[attr-defined]


class _ScriptedStream:
    """Hands out *pieces* in order, each cut to the size the reader asks for, then EOF."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.asked: list[int | None] = []

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        self.asked.append(max_bytes)
        if not self.pieces:
            return b""
        piece = self.pieces.pop(0)
        if max_bytes is not None and len(piece) > max_bytes:
            piece, rest = piece[:max_bytes], piece[max_bytes:]
            self.pieces.insert(0, rest)
        return piece


class _IdleTimer:
    ended = False

    def end(self) -> None:
        self.ended = True


async def _read_all(pieces: list[bytes]) -> tuple[_ScriptedStream, HeadwaterTCPServer]:
    fake = HeadwaterTCPServer.__new__(HeadwaterTCPServer)  # what _read_data touches
    fake.stream = stream = _ScriptedStream(pieces)  # type: ignore[assignment]
    fake.config = ServerConfig()
    fake.protocol = _FakeProtocol()  # type: ignore[assignment]
    fake.idle_task = _IdleTimer()  # type: ignore[assignment]
    await fake._read_data()
    return stream, fake


async def test_a_connection_that_carries_a_large_body_reads_in_larger_pieces() -> None:
    body = bytes(range(256)) * 2400  # 614,400 bytes: a long prompt's body, arrived whole
    stream, fake = await _read_all([body])
    small, large = ServerConfig.read_size, ServerConfig.read_size_large
    # The first read fills 64 KiB; from then on the connection reads 256 KiB at a time:
    # 5 reads instead of hypercorn's 11 (EOF included).
    assert stream.asked == [small, large, large, large, large]
    events = fake.protocol.events  # type: ignore[attr-defined]
    assert b"".join(e.data for e in events[:-1]) == body
    assert isinstance(events[-1], Closed)
    assert fake.idle_task.ended  # type: ignore[attr-defined]


async def test_a_connection_of_short_requests_keeps_small_reads() -> None:
    stream, fake = await _read_all([b"x" * 1500] * 4 + [b"y" * (ServerConfig.read_size - 1)])
    assert set(stream.asked) == {ServerConfig.read_size}
    assert fake.idle_task.ended  # type: ignore[attr-defined]


def _server_on(stream: trio.abc.Stream, *, write_timeout: float) -> HeadwaterTCPServer:
    fake = HeadwaterTCPServer.__new__(HeadwaterTCPServer)  # what protocol_send touches
    fake.stream = stream  # type: ignore[assignment]
    fake.config = ServerConfig()
    fake.config.write_timeout = write_timeout
    fake.send_lock = trio.Lock()
    fake.protocol = _FakeProtocol()  # type: ignore[assignment]
    return fake


async def _socket_stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_writes_to_a_real_socket_arrive_whole_and_in_order() -> None:
    """The fast path (one non-blocking write) and its fallback for what did not fit:
    8 MiB is more than a socket buffer takes at once."""
    server_side, client_side = await _socket_stream_pair()
    fake = _server_on(server_side, write_timeout=7.0)
    big = bytes(range(256)) * (32 * 1024)
    received = bytearray()

    async def reader() -> None:
        while len(received) < 3 + len(big) + 3:
            received.extend(await client_side.receive_some(1 << 20))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for data in (b"abc", big, b"xyz"):
                await fake.protocol_send(RawData(data))
    assert bytes(received) == b"abc" + big + b"xyz"
    assert fake.protocol.events == []  # type: ignore[attr-defined]
    await server_side.aclose()
    await client_side.aclose()


async def test_a_real_socket_whose_reader_stops_is_dropped_after_the_write_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server_side, client_side = await _socket_stream_pair()
    fake = _server_on(server_side, write_timeout=7.0)
    start = trio.current_time()
    await fake.protocol_send(RawData(b"x" * (16 << 20)))  # never read
    assert trio.current_time() - start == 7.0
    assert any(isinstance(e, Closed) for e in fake.protocol.events)  # type: ignore[attr-defined]
    await client_side.aclose()


async def test_a_write_to_a_socket_closed_by_the_peer_reports_the_connection_closed() -> None:
    server_side, client_side = await _socket_stream_pair()
    fake = _server_on(server_side, write_timeout=7.0)
    await client_side.aclose()
    with trio.fail_after(5):
        await fake.protocol_send(RawData(b"late"))
    assert any(isinstance(e, Closed) for e in fake.protocol.events)  # type: ignore[attr-defined]


def _tasks_named(fragment: str) -> list[trio.lowlevel.Task]:
    found, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None:
            continue
        if fragment in task.name:
            found.append(task)
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return found


async def test_a_client_gone_mid_request_leaves_no_connection_task_behind(http_parser: str) -> None:
    # While a request runs the idle timer is lifted; if the client then goes away,
    # the connection's tasks (idle timer included) must end with it, not linger
    # until the server shuts down.
    async with serve_frontend(
        http_parser=http_parser, keep_alive_timeout=60, speedup_ratio=1.0
    ) as (fe, url):
        assert not _tasks_named("serve_listeners._run_handler")
        stream = await _open(url)
        payload = orjson.dumps(
            {"model": fe.pipeline.model_name, "prompt": "hello", "max_tokens": 500, "stream": True}
        )
        await _post_json(stream, b"/v1/completions", payload)
        await _read_until(stream, b"data: ")
        assert len(_tasks_named("serve_listeners._run_handler")) == 1
        await stream.aclose()
        with trio.fail_after(5):
            while _tasks_named("serve_listeners._run_handler") or _tasks_named("IdleDeadline"):
                await trio.sleep(0.05)


async def test_a_known_length_response_leaves_in_one_write(
    monkeypatch: Any, http_parser: str
) -> None:
    # Head and body of a JSON answer go out in one write(2); a streamed answer (no
    # Content-Length) still sends its head alone, at once, before its first event.
    writes: list[bytes] = []
    write_now = tcp_server._write_now

    def recording(stream: Any, data: bytes) -> int | None:
        writes.append(bytes(data))
        return write_now(stream, data)

    monkeypatch.setattr(tcp_server, "_write_now", recording)
    async with serve_frontend(http_parser=http_parser) as (fe, url):
        stream = await _open(url)
        chat = orjson.dumps(
            {
                "model": fe.pipeline.model_name,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hello"}],
            }
        )
        for body, status in ((chat, b"200"), (b"{", b"400")):
            writes.clear()
            await _post_json(stream, b"/v1/chat/completions", body)
            assert (await _read_response(stream)).startswith(b"HTTP/1.1 " + status)
            assert len(writes) == 1, writes
            head, _, answer = writes[0].partition(b"\r\n\r\n")
            assert b"content-length" in head.lower()
            assert answer.startswith(b'{"')
        # A HEAD answer is a head alone: it still goes out, and the connection goes on.
        writes.clear()
        await stream.send_all(b"HEAD /v1/models HTTP/1.1\r\nHost: test\r\n\r\n")
        seen = await _read_until(stream, b"\r\n\r\n")
        assert seen.startswith(b"HTTP/1.1 200")
        assert seen.endswith(b"\r\n\r\n")
        assert len(writes) == 1
        await stream.send_all(b"GET /live HTTP/1.1\r\nHost: test\r\n\r\n")
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")

        writes.clear()
        streamed = orjson.dumps(
            {"model": fe.pipeline.model_name, "max_tokens": 3, "prompt": "hello", "stream": True}
        )
        await _post_json(stream, b"/v1/completions", streamed)
        await _read_until(stream, b"data: [DONE]")
        assert writes[0].startswith(b"HTTP/1.1 200")
        assert writes[0].endswith(b"\r\n\r\n")
        assert b"data: " in writes[1]  # the events follow in writes of their own
        await stream.aclose()


async def test_a_stream_in_flight_at_shutdown_runs_to_its_end(http_parser: str) -> None:
    # Graceful shutdown closes idle connections at once but lets a request in flight
    # finish (within graceful_timeout): the idle timer must not close a busy connection.
    # No drain (drain_timeout 0): hypercorn's graceful shutdown alone lets the stream finish.
    settings: dict[str, Any] = {"speedup_ratio": 1.0, "graceful_timeout": 10.0, "drain_timeout": 0}
    async with serve_frontend(http_parser=http_parser, **settings) as (fe, url):
        body = {
            "model": fe.pipeline.model_name,
            "prompt": "hello",
            "max_tokens": 30,
            "stream": True,
        }
        events: list[str] = []
        async with (
            httpx.AsyncClient(base_url=url) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    fe.stop()
        assert events[-1] == "data: [DONE]", events[-3:]
        assert len(events) > 2
