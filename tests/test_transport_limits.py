"""The HTTP transport's limits (frontend.http.serving): head size and time, body stalls,
write stalls, connections per client, and TLS on the listener.

Policy: the seam's ``serve`` runs a bare ASGI app on 127.0.0.1:0 inside the test's nursery,
with limits small enough (fractions of a second, a few KiB) that each test ends in about
a second; clients are raw trio sockets, so that a test sends exactly the bytes it means
to, when it means to. Times are real, and the asserts on them are bounds with room for a
loaded machine, never exact. The write deadline is checked over a lockstep memory stream
on virtual time, as in tests/test_http_pitfalls.py. Certificates are made in the test
(tls_fixture). The last tests go through a whole frontend (frontend_fixture) for its
counters and HTTPS, and one through ``python -m headwater serve`` (port 0, HF tokenizer).
"""

from __future__ import annotations

import gc
import json
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
import trustme
from hypercorn.events import Closed, RawData

from frontend.http.serving import REFUSAL_REASONS, ServerConfig, serve
from frontend.http.serving.limits import ClientConnections, head_fault
from frontend.http.serving.tcp_server import HeadwaterTCPServer, _write_now
from headwater.cluster.recipes import spawn_frontend, wait_healthy

from frontend_fixture import serve_frontend
from tls_fixture import client_context, issue

LIMIT = 4096  # bytes of a request head, in these tests


class _App:
    """``/`` reads the body and answers its length; ``/slow`` answers after 1 s."""

    def __init__(self) -> None:
        self.disconnects = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":
            await trio.sleep(1.0)
        if scope["path"] == "/big":
            body = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than a socket buffer
        else:
            body = json.dumps({"received": size, "scheme": scope["scheme"]}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _Server:
    """A running seam: its URLs, the refusals it reported (in order), and raw client
    connections to it, all closed when the test's block ends."""

    def __init__(self, urls: list[str], refusals: list[str]) -> None:
        self.urls = urls
        self.url = urls[0]
        self.refusals = refusals
        self._opened: list[trio.abc.Stream] = []

    async def connect(self, url: str = "") -> trio.SocketStream:
        host, port = (url or self.url).split("://")[1].rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        self._opened.append(stream)
        return stream

    async def connect_tls(
        self, ca: trustme.CA, alpn: list[str] | None = None
    ) -> trio.SSLStream[trio.SocketStream]:
        context = client_context(ca)
        if alpn:
            context.set_alpn_protocols(alpn)
        stream = trio.SSLStream(await self.connect(), context, server_hostname="127.0.0.1")
        self._opened.append(stream)
        return stream

    async def aclose(self) -> None:
        for stream in self._opened:
            await trio.aclose_forcefully(stream)


@asynccontextmanager
async def serving(app: _App | None = None, **fields: Any) -> AsyncIterator[_Server]:
    """The seam serving *app* on 127.0.0.1:0, with *fields* set on its config (request
    heads of at most LIMIT bytes unless given)."""
    fields.setdefault("h11_max_incomplete_size", LIMIT)
    config = ServerConfig.from_mapping(accesslog=None, errorlog=None, **fields)
    assert isinstance(config, ServerConfig)
    config.bind = ["127.0.0.1:0"]
    refusals: list[str] = []
    config.on_refusal = refusals.append
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: serve(
                app or _App(), config, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        server = _Server(urls, refusals)
        try:
            yield server
        finally:
            await server.aclose()
            nursery.cancel_scope.cancel()


@pytest.fixture(params=["h11", "httptools"])
def parser(request: pytest.FixtureRequest) -> str:
    """Each HTTP/1.1 parser the seam has: the limits hold whichever reads the requests."""
    value: str = request.param
    return value


async def _until_closed(stream: trio.abc.Stream, within: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts)."""
    seen = b""
    with trio.fail_after(within):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # a reset: what it sent before may be lost
                return seen
            if not data:
                return seen
            seen += data


def _head(size: int) -> bytes:
    """A GET head of exactly *size* bytes, its blank line included."""
    start, end = b"GET / HTTP/1.1\r\nHost: test\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def _error(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    error: dict[str, Any] = json.loads(body)["error"]
    return error


# ---- head size ----------------------------------------------------------------------------


def test_a_head_is_refused_once_it_cannot_end_within_the_limit() -> None:
    assert head_fault(_head(300) + b"body" * 5000, LIMIT) is None  # it ended in time
    assert head_fault(_head(LIMIT), LIMIT) is None  # exactly the limit
    assert head_fault(b"x" * 100, LIMIT) is None  # incomplete: it may yet end in time
    assert head_fault(b"x" * LIMIT, LIMIT) is None
    for over in (b"x" * (LIMIT + 1), _head(LIMIT + 1), _head(LIMIT + 100) + _head(100)):
        fault = head_fault(over, LIMIT)
        assert fault is not None
        assert (fault.status, fault.reason) == (431, "header_too_large")


@pytest.mark.parametrize("piece", [None, 1000], ids=["whole", "trickled"])
async def test_a_head_over_the_limit_gets_431(piece: int | None, parser: str) -> None:
    # h11 alone refuses only a head still incomplete over the limit: one that arrives
    # in a single read would pass. Both are refused.
    async with serving(http_parser=parser) as server:
        stream = await server.connect()
        head = _head(LIMIT + 100)
        for i in range(0, len(head), piece or len(head)):
            await stream.send_all(head[i : i + (piece or len(head))])
            await trio.sleep(0.01 if piece else 0)
        answer = await _until_closed(stream)
        assert answer.startswith(b"HTTP/1.1 431 ")
        error = _error(answer)
        assert error["code"] == "header_too_large"
        assert str(LIMIT) in error["message"]
        assert server.refusals == ["header_too_large"]


async def test_a_head_of_exactly_the_limit_is_served(parser: str) -> None:
    async with serving(http_parser=parser) as server, httpx.AsyncClient() as client:
        stream = await server.connect()
        await stream.send_all(_head(LIMIT))
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        # And a normal client, with a body in the same read as its head.
        r = await client.post(server.url + "/", content=b"x" * 200_000)
        assert r.json()["received"] == 200_000
        assert server.refusals == []


# ---- head time ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_head_that_stops_gets_408_after_the_header_timeout(parser: str) -> None:
    async with serving(header_timeout=0.5, keep_alive_timeout=10, http_parser=parser) as server:
        stream = await server.connect()
        await trio.sleep(0.3)  # idle before the first byte: not the head's time
        start = trio.current_time()
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: te")
        answer = await _until_closed(stream)
        assert 0.4 < trio.current_time() - start < 3.0
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert _error(answer)["code"] == "header_timeout"
        assert server.refusals == ["header_timeout"]


@pytest.mark.slow
async def test_a_head_that_trickles_is_cut_however_steadily_it_comes(parser: str) -> None:
    async with serving(header_timeout=0.5, keep_alive_timeout=10, http_parser=parser) as server:
        stream = await server.connect()
        start = trio.current_time()

        async def dribble() -> None:
            for byte in b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 1000:
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dribble)
            await _until_closed(stream)  # a 408 or a reset: the client was still sending
            nursery.cancel_scope.cancel()
        assert 0.4 < trio.current_time() - start < 3.0
        assert server.refusals == ["header_timeout"]


@pytest.mark.slow
async def test_a_head_in_progress_is_not_cut_by_the_keep_alive_timeout(parser: str) -> None:
    # The connection stops being idle at the head's first byte: a head that takes
    # longer than keep_alive_timeout, but not header_timeout, is served.
    async with serving(header_timeout=5.0, keep_alive_timeout=0.3, http_parser=parser) as server:
        stream = await server.connect()
        head = _head(200)
        for i in range(0, len(head), 20):
            await stream.send_all(head[i : i + 20])
            await trio.sleep(0.08)  # ~0.8 s in all
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        # Then idle again: the keep-alive timeout closes it, and that is no refusal.
        assert await _until_closed(stream) == b""
        assert server.refusals == []


# ---- body stalls --------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_body_that_stalls_is_dropped_after_the_read_timeout(parser: str) -> None:
    app = _App()
    async with serving(app, body_read_timeout=0.5, http_parser=parser) as server:
        stream = await server.connect()
        head = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
        await stream.send_all(head + b"x" * 10)
        start = trio.current_time()
        assert await _until_closed(stream) == b""
        assert 0.4 < trio.current_time() - start < 3.0
        assert server.refusals == ["read_timeout"]
        assert app.disconnects == 1  # the app was told


@pytest.mark.slow
async def test_a_body_that_keeps_coming_and_a_silent_client_are_not_cut(parser: str) -> None:
    async with serving(body_read_timeout=0.5, http_parser=parser) as server:
        stream = await server.connect()
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n")
        for _ in range(10):  # 2 s in all, never 0.5 s without a byte
            await trio.sleep(0.2)
            await stream.send_all(b"x" * 10)
        answer = await stream.receive_some(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert b'"received": 100' in answer
        # A response under way has no read deadline: the client has sent all it had to.
        await stream.send_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        with trio.fail_after(5):
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        assert server.refusals == []


# ---- write stalls -------------------------------------------------------------------------


class _FakeProtocol:
    protocol = None

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


def _server_on(stream: trio.abc.Stream, refusals: list[str]) -> HeadwaterTCPServer:
    fake = HeadwaterTCPServer.__new__(HeadwaterTCPServer)  # what protocol_send touches
    fake.stream = stream  # type: ignore[assignment]
    fake.config = ServerConfig()
    fake.config.write_timeout = 7.0
    fake.config.on_refusal = refusals.append
    fake.send_lock = trio.Lock()
    fake.protocol = _FakeProtocol()  # type: ignore[assignment]
    return fake


async def test_a_reader_that_never_reads_is_dropped_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    refusals: list[str] = []
    server_side, client_side = trio.testing.lockstep_stream_pair()
    fake = _server_on(server_side, refusals)
    await fake.protocol_send(RawData(b"x" * 1024))  # nobody reads client_side
    assert any(isinstance(e, Closed) for e in fake.protocol.events)  # type: ignore[attr-defined]
    assert refusals == ["write_timeout"]
    await client_side.aclose()
    # A peer that went away is no refusal: nobody was refused anything.
    gone: list[str] = []
    a, b = trio.socket.socketpair()
    fake = _server_on(trio.SocketStream(a), gone)
    b.close()
    await fake.protocol_send(RawData(b"late"))
    assert gone == []


async def test_tls_streams_take_the_bounded_path(ca: trustme.CA, tmp_path: Path) -> None:
    # The fast path writes to a plain socket's fd: to a TLS stream it writes nothing,
    # and the bounded send_all does all of it.
    pem = issue(ca, tmp_path, "server", "127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pem.certfile, pem.keyfile)
    a, b = trio.socket.socketpair()
    assert _write_now(trio.SSLStream(trio.SocketStream(a), context, server_side=True), b"x") == 0
    b.close()
    a.close()


# ---- connections per client ---------------------------------------------------------------


def test_connections_are_counted_per_address() -> None:
    limiter = ClientConnections(2)
    assert limiter.acquire("10.0.0.1")
    assert limiter.acquire("10.0.0.1")
    assert not limiter.acquire("10.0.0.1")
    assert limiter.acquire("10.0.0.2")
    assert limiter.acquire(None)  # a Unix socket's peer
    limiter.release("10.0.0.1")
    limiter.release(None)
    assert limiter.acquire("10.0.0.1")
    stats = limiter.statistics()
    assert (stats.limit, stats.clients, stats.connections, stats.refused_total) == (2, 2, 3, 1)
    off = ClientConnections(0)
    assert all(off.acquire("10.0.0.1") for _ in range(1000))
    with pytest.raises(ValueError, match=">= 0"):
        ClientConnections(-1)


async def test_a_client_over_its_connections_is_closed_at_once() -> None:
    async with serving(max_connections_per_client=2, keep_alive_timeout=10) as server:
        held = [await server.connect(), await server.connect()]
        await trio.sleep(0.1)  # both accepted and counted
        extra = await server.connect()
        start = trio.current_time()
        assert await _until_closed(extra) == b""
        assert trio.current_time() - start < 2.0
        assert server.refusals == ["too_many_connections"]
        # The two held ones are served; when one closes, a new one is too.
        await held[0].send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await held[0].receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        await held[1].aclose()
        await trio.sleep(0.1)
        async with httpx.AsyncClient() as client:
            assert (await client.get(server.url + "/")).status_code == 200
        assert server.refusals == ["too_many_connections"]


async def test_no_limit_on_connections_per_client_with_zero() -> None:
    async with serving(max_connections_per_client=0) as server:
        streams = [await server.connect() for _ in range(20)]
        for stream in streams:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        for stream in streams:
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        assert server.refusals == []


# ---- TLS ----------------------------------------------------------------------------------


async def test_serve_over_tls(ca: trustme.CA, tmp_path: Path, parser: str) -> None:
    pem = issue(ca, tmp_path, "server", "127.0.0.1", "localhost")
    settings: dict[str, Any] = {
        "certfile": pem.certfile,
        "keyfile": pem.keyfile,
        "insecure_bind": ["127.0.0.1:0"],
    }
    async with serving(**settings, http_parser=parser) as server:
        secure, plain = server.urls
        assert secure.startswith("https://127.0.0.1:")
        assert plain.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(verify=client_context(ca)) as client:
            r = await client.post(secure + "/", content=b"x" * 300_000)
            assert r.json() == {"received": 300_000, "scheme": "https"}
            big = await client.get(secure + "/big")  # the bounded write path, on TLS
            assert big.content == bytes(range(256)) * (32 * 1024)
            assert (await client.get(plain + "/")).json()["scheme"] == "http"
        # ALPN offers HTTP/1.1 alone, whatever the client asks for.
        tls = await server.connect_tls(ca, alpn=["h2", "http/1.1"])
        await tls.do_handshake()
        assert tls.selected_alpn_protocol() == "http/1.1"
        # A client that does not trust the certificate is refused by its own check.
        async with httpx.AsyncClient() as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(secure + "/")
        # A plain HTTP client on the TLS port gets nothing it can read as HTTP.
        stream = await server.connect()
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert not (await _until_closed(stream)).startswith(b"HTTP/1.1 200")
        assert server.refusals == []


@pytest.mark.slow
async def test_tls_handshakes_and_heads_have_the_header_timeout(
    ca: trustme.CA, tmp_path: Path, parser: str
) -> None:
    pem = issue(ca, tmp_path, "server", "127.0.0.1")
    settings: dict[str, Any] = {
        "certfile": pem.certfile,
        "keyfile": pem.keyfile,
        "header_timeout": 0.5,
        "keep_alive_timeout": 10,
    }
    async with serving(**settings, http_parser=parser) as server:
        silent = await server.connect()  # TCP, then not a byte of the TLS handshake
        start = trio.current_time()
        assert await _until_closed(silent) == b""
        assert 0.4 < trio.current_time() - start < 3.0
        assert server.refusals == ["tls_handshake_timeout"]
        # Over TLS, a head that stops gets its 408 as over plain TCP.
        tls = await server.connect_tls(ca)
        await tls.send_all(b"GET / HTTP/1.1\r\nHo")
        assert (await _until_closed(tls)).startswith(b"HTTP/1.1 408 ")
        assert server.refusals == ["tls_handshake_timeout", "header_timeout"]


@pytest.mark.slow
async def test_a_tls_handshake_under_way_at_shutdown_is_closed(
    ca: trustme.CA, tmp_path: Path
) -> None:
    pem = issue(ca, tmp_path, "server", "127.0.0.1")
    async with serving(certfile=pem.certfile, keyfile=pem.keyfile) as server:
        host, port = server.url.removeprefix("https://").rsplit(":", 1)
        silent = await trio.open_tcp_stream(host, int(port))  # outlives the server
        await trio.sleep(0.1)  # accepted; its handshake waits for the client
    gc.collect()  # an unclosed socket would warn here, and warnings are errors
    assert await _until_closed(silent) == b""
    assert server.refusals == []
    await silent.aclose()


def test_every_reason_is_named() -> None:
    assert REFUSAL_REASONS == (
        "header_too_large",
        "header_timeout",
        "tls_handshake_timeout",
        "read_timeout",
        "write_timeout",
        "too_many_connections",
        "invalid_framing",
        "unsupported_protocol",
    )


# ---- through the frontend -----------------------------------------------------------------


async def _metric_lines(url: str, verify: ssl.SSLContext | bool = True) -> dict[str, float]:
    async with httpx.AsyncClient(verify=verify) as client:
        text = (await client.get(url + "/metrics")).text
    rejected = "headwater_frontend_rejected_requests_total{reason="
    return {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(rejected)
    }


@pytest.mark.slow
async def test_the_frontend_counts_each_refusal_by_reason() -> None:
    settings = {
        "max_header_bytes": 2048,
        "header_timeout": 0.5,
        "max_connections_per_client": 3,
        "keep_alive_timeout": 10,
    }
    async with serve_frontend(**settings) as (fe, url):
        counts = await _metric_lines(url)
        assert {r: counts[r] for r in REFUSAL_REASONS} == dict.fromkeys(REFUSAL_REASONS, 0.0)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        big = await trio.open_tcp_stream(host, int(port))
        await big.send_all(_head(3000))
        assert (await _until_closed(big)).startswith(b"HTTP/1.1 431 ")
        slow = await trio.open_tcp_stream(host, int(port))
        await slow.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
        assert (await _until_closed(slow)).startswith(b"HTTP/1.1 408 ")
        held = [await trio.open_tcp_stream(host, int(port)) for _ in range(3)]
        await trio.sleep(0.1)
        extra = await trio.open_tcp_stream(host, int(port))
        assert await _until_closed(extra) == b""
        for stream in (big, slow, extra, *held):
            await stream.aclose()
        await trio.sleep(0.1)
        counts = await _metric_lines(url)
        assert counts["header_too_large"] == 1
        assert counts["header_timeout"] == 1
        assert counts["too_many_connections"] == 1
        assert counts["read_timeout"] == counts["write_timeout"] == 0
        assert counts["max_inflight"] == 0
        # Normal requests were never touched.
        body = {
            "model": fe.pipeline.model_name,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}],
        }
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


@pytest.mark.slow
async def test_the_frontend_over_https(ca: trustme.CA, tmp_path: Path) -> None:
    pem = issue(ca, tmp_path, "frontend", "127.0.0.1", "localhost")
    async with serve_frontend(ssl_certfile=pem.certfile, ssl_keyfile=pem.keyfile) as (fe, url):
        assert url.startswith("https://127.0.0.1:")
        body = {
            "model": fe.pipeline.model_name,
            "max_tokens": 40,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}],
        }
        async with httpx.AsyncClient(base_url=url, verify=client_context(ca)) as client:
            unary = await client.post("/v1/chat/completions", json=body)
            assert unary.json()["usage"]["completion_tokens"] == 40
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert len(events) > 2
            assert (await client.get("/health")).status_code == 200
        assert (await _metric_lines(url, client_context(ca)))["header_timeout"] == 0


@pytest.mark.slow
async def test_headwater_serve_announces_https(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    # --processes 2: the supervisor's line, each process's own URL and the shared port
    # are all https, and each serves over TLS.
    pem = issue(ca, tmp_path, "frontend", "127.0.0.1")
    argv = [
        sys.executable,
        "-m",
        "headwater",
        "serve",
        "--port",
        "0",
        "--tokenizer-backend",
        "hf",
        "--processes",
        "2",
        "--ssl-certfile",
        pem.certfile,
        "--ssl-keyfile",
        pem.keyfile,
    ]
    frontend = await spawn_frontend(
        nursery, argv, name="frontend", log_path=tmp_path / "frontend.log", ready_within=120
    )
    assert frontend.address.startswith("https://127.0.0.1:")
    assert [m.url.split(":")[0] for m in frontend.members] == ["https", "https"]
    await wait_healthy(frontend.address, within=60, child=frontend, verify=client_context(ca))
    async with httpx.AsyncClient(verify=client_context(ca)) as client:
        for member in frontend.members:
            assert (await client.get(member.url + "/live")).status_code == 200
        # The shared port's /metrics is the group's: the supervisor asked both processes
        # on their private ports, over TLS.
        page = (await client.get(frontend.address + "/metrics")).text
        assert "headwater_frontend_group_processes_up 2.0" in page
    frontend.send_signal(signal.SIGTERM)
    with trio.fail_after(60):
        assert await frontend.wait() == 0


async def test_a_client_gone_before_its_connection_is_set_up_takes_nothing_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that resets at once makes hypercorn's first read of the socket's
    addresses fail (OSError): the connection closes before it has a protocol. Once that
    close raised (AttributeError) out of the connection, through the listener's nursery,
    and the whole frontend exited: a soak's resets under load stopped a launched cluster."""
    import hypercorn.trio.tcp_server as upstream

    real, failures = upstream.parse_socket_addr, [1]  # type: ignore[attr-defined]

    def gone_once(family: Any, address: Any) -> Any:
        if failures:
            failures.pop()
            raise OSError(107, "Transport endpoint is not connected")
        return real(family, address)

    monkeypatch.setattr(upstream, "parse_socket_addr", gone_once)
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as http:
        with pytest.raises(httpx.TransportError):  # the first connection: closed
            await http.get("/health")
        assert not failures
        assert (await http.get("/health")).status_code == 200  # and the rest served


async def test_a_connection_that_fails_is_closed_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Any fault in one connection's serving closes that connection, logged; the
    listener and every other connection go on."""
    real, failures = HeadwaterTCPServer._read_data, [1]

    async def broken_once(self: HeadwaterTCPServer) -> None:
        if failures:
            failures.pop()
            raise RuntimeError("a bug in one connection")
        await real(self)

    monkeypatch.setattr(HeadwaterTCPServer, "_read_data", broken_once)
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as http:
        with pytest.raises(httpx.TransportError):
            await http.get("/health")
        assert (await http.get("/health")).status_code == 200
    assert "closing it alone" in caplog.text
    assert "a bug in one connection" in caplog.text
