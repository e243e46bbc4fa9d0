"""The two HTTP/1.1 parsers behind the seam (``ServerConfig.http_parser``: h11, and
httptools' llhttp) answer every request of a corpus alike.

Policy: each case is raw bytes sent to a seam connection (``HeadwaterTCPServer``, the
class ``serve`` runs per connection) over a socket pair, on trio's virtual clock, with a
bare ASGI app that echoes what it was given. A case runs once per parser; what the
client read (the Date field's value blanked), whether the server closed the connection
within 5 s of the last byte sent (the keep-alive timeout is 60 s), what the app saw, the
writes the server asked for (a known-length head leaves with its body), and the
refusals and answers reported to the config's hooks must all be equal. The heads
that llhttp refuses, which the protocol has h11 read again, are listed in H11_READS.
The last test runs a whole frontend over httptools (frontend_fixture, 127.0.0.1:0).
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from httptools import HttpParserError, HttpRequestParser
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.events import Event, RawData
from hypercorn.trio.worker_context import WorkerContext

from frontend.choices import HttpParser
from frontend.http.serving import ServerConfig, serve
from frontend.http.serving.httptools_protocol import HttptoolsProtocol
from frontend.http.serving.tcp_server import HeadwaterTCPServer

from frontend_fixture import serve_frontend

LIMIT = 1024  # bytes of a request head, in these tests
QUIET = 5.0  # seconds of silence after which a connection counts as kept open
EOF = None  # in a case's steps: the client shuts its writing side

#: A case's steps: bytes to send (then a second's pause, in which the server reads and
#: answers what it can), a pause of so many seconds, or EOF.
Step = bytes | float | None


class _App:
    """``/early`` answers 401 without reading the body; ``/stream`` answers in two
    pieces of unknown length; ``/empty`` answers 204; any other path echoes the
    request (method, path, query, version, fields, body) as JSON."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        if path == "/early":
            self.seen.append(["early", scope["method"]])
            await _answer(send, 401, b'{"error": "unauthorized"}')
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.seen.append(["disconnect", path])
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = {
            "method": scope["method"],
            "path": path,
            "query": scope["query_string"].decode(),
            "version": scope["http_version"],
            "headers": [[n.decode(), v.decode("latin-1")] for n, v in scope["headers"]],
            "body": body.decode("latin-1"),
        }
        self.seen.append(request)
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"one,", "more_body": True})
            await send({"type": "http.response.body", "body": b"two", "more_body": False})
        elif path == "/empty":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        else:
            await _answer(send, 200, json.dumps(request).encode())


async def _answer(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Outcome:
    """What one parser made of a case."""

    received: bytes
    closed: bool
    seen: list[Any]
    writes: list[bytes]  # each write(2) the server asked for (a head with its body: one)
    refusals: list[str] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)


_DATE = re.compile(rb"(?im)^(date: )[^\r\n]*")


async def _run(parser: str, steps: list[Step]) -> Outcome:
    config = ServerConfig.from_mapping(
        accesslog=None,
        errorlog=None,
        h11_max_incomplete_size=LIMIT,
        http_parser=parser,
        keep_alive_timeout=60,
    )
    assert isinstance(config, ServerConfig)
    refusals: list[str] = []
    answers: list[int] = []
    config.on_refusal, config.on_answer = refusals.append, answers.append
    app = _App()
    near, far = trio.socket.socketpair()
    client, served = trio.SocketStream(near), trio.SocketStream(far)
    server = HeadwaterTCPServer(ASGIWrapper(app), config, WorkerContext(None), {}, served)
    writes: list[bytes] = []
    send = server.protocol_send

    async def recording(event: Event) -> None:
        if isinstance(event, RawData) and event.data:
            writes.append(_DATE.sub(rb"\1-", event.data))
        await send(event)

    server.protocol_send = recording  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await _send(client, steps)
        received, closed = await _drain(client)
        await trio.sleep(1)  # the app hears of a closed connection, if it was
        if parser == "httptools":  # the case ran through the protocol it names
            protocol: object = server.protocol.protocol  # annotated as hypercorn's two
            assert type(protocol) is HttptoolsProtocol
        nursery.cancel_scope.cancel()  # a connection kept open, or one lingering
    await client.aclose()
    served.socket.close()  # cancelled, the server may not have
    return Outcome(_DATE.sub(rb"\1-", received), closed, app.seen, writes, refusals, answers)


async def _send(client: trio.SocketStream, steps: list[Step]) -> None:
    for step in steps:
        try:
            if isinstance(step, bytes):
                with trio.move_on_after(10):
                    await client.send_all(step)
                await trio.sleep(1)
            elif step is None:
                await client.send_eof()
            else:
                await trio.sleep(step)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the server closed: what it answered is read next


async def _drain(client: trio.SocketStream) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed within QUIET of its last byte."""
    received = bytearray()
    while True:
        with trio.move_on_after(QUIET):
            try:
                data = await client.receive_some(65536)
            except trio.BrokenResourceError:
                return bytes(received), True
            if not data:
                return bytes(received), True
            received += data
            continue
        return bytes(received), False


def _post(path: bytes, body: bytes, *fields: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (path, len(body))
    return head + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


GET = b"GET /a?q=1 HTTP/1.1\r\nHost: t\r\nUser-Agent: test/1  \r\n\r\n"
POST = _post(b"/p", b"hello world")
CHUNKED = (
    b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nTrailer: x\r\n\r\n"
)
CHUNKED_HEAD = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
PIPELINED = GET + POST + b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"
EXPECT = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
UPGRADE_WS = (
    b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
BIG = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * LIMIT + b"\r\n\r\n"

CASES: dict[str, list[Step]] = {
    "get": [GET],
    "post": [POST],
    "post-empty-body": [_post(b"/p", b"")],
    "keep-alive": [GET, POST, b"GET /empty HTTP/1.1\r\nHost: t\r\n\r\n", GET],
    "pipelined": [PIPELINED],
    "pipelined-behind-chunked": [CHUNKED + GET],
    "chunked": [CHUNKED],
    "chunked-in-pieces": [CHUNKED[:60], CHUNKED[60:75], CHUNKED[75:]],
    "expect-continue, the app reads": [EXPECT, b"hello"],
    "expect-continue, body sent at once": [EXPECT + b"hello"],
    "expect-continue, the app answers first": [
        b"POST /early HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    ],
    "expect-continue on HTTP/1.0": [
        b"POST /p HTTP/1.0\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
        b"hello",
    ],
    "answered before the body ended": [_post(b"/early", b"x" * 100)[:-90], b"x" * 90],
    "http/1.0": [b"GET /a HTTP/1.0\r\n\r\n"],
    "http/1.0 keep-alive": [b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"],
    "http/1.0 streamed": [b"GET /stream HTTP/1.0\r\n\r\n"],
    "http/1.0 head streamed": [b"HEAD /stream HTTP/1.0\r\n\r\n"],
    "connection close": [b"GET /a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"],
    "connection close, streamed": [b"GET /stream HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"],
    "streamed": [b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"],
    "head": [b"HEAD /a HTTP/1.1\r\nHost: t\r\n\r\n", GET],
    "head streamed": [b"HEAD /stream HTTP/1.1\r\nHost: t\r\n\r\n", GET],
    "no content": [b"GET /empty HTTP/1.1\r\nHost: t\r\n\r\n"],
    "head over the limit": [BIG],
    "head over the limit, trickled": [BIG[:600], BIG[600:]],
    "head over the limit, pipelined": [GET + BIG],
    "head of exactly the limit": [BIG[: LIMIT - 4 - 1000] + b"\r\n\r\n"],
    "head that never ends": [b"GET / HTTP/1.1\r\nHost: t\r\n", 15.0],
    "head cut by EOF": [b"GET / HTTP/1.1\r\nHost: t\r\n", EOF],
    "body cut by EOF": [_post(b"/p", b"hello")[:-2], EOF],
    "eof after a request": [GET, EOF],
    "obs-fold": [b"GET / HTTP/1.1\r\nHost: t\r\nX-A: one\r\n two\r\n\r\n"],
    "content-length with transfer-encoding": [
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"
    ],
    "transfer-encoding gzip": [b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n"],
    "bad chunk size": [
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
    ],
    "chunk without its CRLF": [
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n"
    ],
    "chunk size line too long": [
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;" + b"e" * 2000
    ],
    "trailers too long": [
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
        + b"X-T: aaaaaaaaaaaaaaaa\r\n" * 60
    ],
    "not a request line": [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"],
    "leading CRLF": [b"\r\n" + GET],
    "missing host": [b"GET / HTTP/1.1\r\n\r\n"],
    "two hosts": [b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"],
    "http/2.0 request": [b"GET / HTTP/2.0\r\nHost: t\r\n\r\n"],
    "upgrade h2c": [
        b"GET /u HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        GET,
    ],
    "upgrade h2c with a body": [
        _post(b"/u", b"hello", b"Connection: Upgrade", b"Upgrade: h2c") + GET
    ],
    "upgrade h2c with a chunked body": [
        b"POST /u HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" + GET
    ],
    "upgrade websocket": [UPGRADE_WS + GET],
    "upgrade without connection upgrade": [b"GET /u HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\n\r\n"],
    "connect": [b"CONNECT t:443 HTTP/1.1\r\nHost: t:443\r\n\r\n"],
    # What h11 takes and llhttp would not, or the reverse: each read as h11 reads it.
    "chunk sizes with blanks after them": [
        CHUNKED_HEAD + b"5 \r\nhello\r\n3\t\r\nabc\r\n0 \r\n\r\n" + GET
    ],
    "a chunk extension with blanks after it": [
        CHUNKED_HEAD + b'5;a=b \r\nhello\r\n3;q="x"\t\r\nabc\r\n0\r\n\r\n' + GET
    ],
    "a blank before a chunk extension": [CHUNKED_HEAD + b"5 ;a=b\r\nhello\r\n0\r\n\r\n"],
    "a chunk size past 64 bits": [CHUNKED_HEAD + b"fffffffffffffffffffff\r\nab"],
    "a chunk size of 20 hex digits": [CHUNKED_HEAD + b"ffffffffffffffffffff\r\nab"],
    "a content-length past 64 bits": [
        b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 99999999999999999999\r\n\r\nab"
    ],
    "a request line without a version (HTTP/0.9)": [b"GET /\r\n\r\n"],
    "two spaces in a request line": [b"GET  /a HTTP/1.1\r\nHost: t\r\n\r\n"],
    "an obs-folded trailer field": [CHUNKED_HEAD + b"0\r\nX: y\r\n  z\r\n\r\n" + GET],
    "a control character in a trailer field": [CHUNKED_HEAD + b"0\r\nX: a\x01b\r\n\r\n"],
    "a bad trailer field name": [CHUNKED_HEAD + b"0\r\nX Y: z\r\n\r\n"],
    "a closing upgrade proposal, bytes behind it": [
        b"GET /u HTTP/1.1\r\nHost: t\r\nConnection: close, upgrade\r\nUpgrade: x\r\n\r\n" + GET
    ],
}

# Bodies and heads split across reads at every byte.
for name, whole in (("post", POST), ("chunked", CHUNKED), ("pipelined", GET + POST)):
    for cut in range(1, len(whole)):
        CASES[f"{name} split at {cut}"] = [whole[:cut], whole[cut:]]

#: Heads llhttp refuses and h11 reads (and serves, or refuses with its own status): the
#: protocol asks h11 for them, so that they are answered as with h11.
H11_READS: dict[str, bytes] = {
    "bare LF line ends": b"GET /a HTTP/1.1\nHost: t\n\n",
    "bare LF, chunked body": (
        b"POST /c HTTP/1.1\nHost: t\nTransfer-Encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n"
    ),
    "unknown method": b"FOO /a HTTP/1.1\r\nHost: t\r\n\r\n",
    "lower-case method": b"get /a HTTP/1.1\r\nHost: t\r\n\r\n",
    "HTTP/1.2": b"GET /a HTTP/1.2\r\nHost: t\r\n\r\n",
    "duplicate content-length": (
        b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi"
    ),
    "content-length list": b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 2, 2\r\n\r\nhi" + GET,
    "control character in a value": b"GET / HTTP/1.1\r\nHost: t\r\nX: a\x01b\r\n\r\n",
    "transfer-encoding twice": (
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "bad content-length": b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5x\r\n\r\nhello",
    "conflicting content-lengths": (
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
    ),
    "http/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "bad request line": b"GET /a b HTTP/1.1\r\nHost: t\r\n\r\n",
    "bad header name": b"GET / HTTP/1.1\r\nHost: t\r\nX Y: z\r\n\r\n",
    "non-ascii target": b"GET /\xc3\xa9 HTTP/1.1\r\nHost: t\r\n\r\n",
}
CASES.update({name: [request] for name, request in H11_READS.items()})


@pytest.mark.parametrize("name", list(CASES))
async def test_both_parsers_answer_alike(name: str, autojump_clock: trio.testing.MockClock) -> None:
    steps = CASES[name]
    h11 = await _run("h11", steps)
    httptools = await _run("httptools", steps)
    assert httptools.received == h11.received
    assert httptools.closed == h11.closed
    assert httptools.seen == h11.seen
    assert httptools.writes == h11.writes
    assert (httptools.refusals, httptools.answers) == (h11.refusals, h11.answers)


@pytest.mark.parametrize("parser", ["h11", "httptools"])
async def test_a_last_body_leaves_with_the_body_end(
    parser: str, autojump_clock: trio.testing.MockClock
) -> None:
    # /stream ends with a body message that carries bytes: those and the chunked body's
    # end leave in one write (frontend/http/serving/stream.py), the earlier piece alone.
    outcome = await _run(parser, [b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"])
    head, *body = outcome.writes
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == [b"4\r\none,\r\n", b"3\r\ntwo\r\n0\r\n\r\n"]


@pytest.mark.parametrize("name", list(H11_READS))
def test_llhttp_alone_refuses_what_h11_reads(name: str) -> None:
    # Else those cases would not reach the protocol's reading by h11.
    head = H11_READS[name]
    with pytest.raises(HttpParserError):
        HttpRequestParser(object()).feed_data(head)


async def test_the_corpus_reaches_each_answer(autojump_clock: trio.testing.MockClock) -> None:
    # A differential test passes as well when both sides fail alike: the corpus must
    # reach the statuses it was written for, and keep connections open as well as close.
    statuses: set[bytes] = set()
    fates: set[bool] = set()
    for name in [n for n in CASES if " split at " not in n]:
        outcome = await _run("httptools", CASES[name])
        statuses.update(re.findall(rb"HTTP/1\.1 (\d{3}) ", outcome.received))
        fates.add(outcome.closed)
    assert statuses >= {b"100", b"200", b"204", b"400", b"401", b"408", b"431", b"501", b"505"}
    assert fates == {True, False}


async def test_serve_refuses_a_parser_it_does_not_have() -> None:
    config = ServerConfig()
    config.http_parser = "picohttpparser"
    with pytest.raises(ValueError, match="http_parser must be one of"):
        await serve(_App(), config, shutdown_trigger=trio.sleep_forever)


@pytest.mark.slow
async def test_the_frontend_over_httptools() -> None:
    """``--http-parser httptools`` end to end: a JSON answer, a stream, a large body,
    keep-alive, through the protocol it names."""
    async with (
        serve_frontend(http_parser=HttpParser.HTTPTOOLS) as (fe, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        chat = {
            "model": fe.pipeline.model_name,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hello " * 40_000}],  # ~240 kB
        }
        unary = await client.post("/v1/chat/completions", json=chat)
        assert unary.json()["usage"]["completion_tokens"] == 5
        async with client.stream(
            "POST", "/v1/chat/completions", json={**chat, "stream": True}
        ) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert (await client.get("/health")).status_code == 200
        gc.collect()  # the connections of earlier tests
        servers = [o for o in gc.get_objects() if type(o) is HeadwaterTCPServer]
        protocols: set[type] = {type(s.protocol.protocol) for s in servers}
        assert protocols == {HttptoolsProtocol}
