"""Attack: lenient HTTP/1.1 framing, the ground of request smuggling behind a proxy.

A request with both Content-Length and Transfer-Encoding was read as chunked and its
connection kept open, and an obs-folded header line was unfolded. RFC 9112 lets a server
refuse both (sections 6.1 and 5.2); a frontend behind proxies, which may frame the same
bytes the other way, must: 400 and close, before the app sees the request.

Policy: a real frontend on 127.0.0.1:0; raw sockets.
"""

from __future__ import annotations

import pytest

from attack_fixture import open_raw, read_answer, until_closed
from frontend_fixture import serve_frontend

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.mark.parametrize("order", ["cl-first", "te-first"])
async def test_content_length_with_transfer_encoding_is_a_400_and_a_close(
    order: str, http_parser: str
) -> None:
    chunked = b"0\r\n\r\n" + SMUGGLED  # as chunked: an empty body, then a second request
    framing = [b"Content-Length: %d\r\n" % len(chunked), b"Transfer-Encoding: chunked\r\n"]
    if order == "te-first":
        framing.reverse()
    async with serve_frontend(http_parser=http_parser) as (fe, url):
        stream = await open_raw(url)
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
            b"Content-Type: application/json\r\n" + b"".join(framing) + b"\r\n" + chunked
        )
        buffered = bytearray()
        answer = await read_answer(stream, buffered)
        assert answer.status == 400
        assert answer.error()["code"] == "invalid_framing"
        assert answer.header("connection") == "close"
        rest = bytes(buffered) + await until_closed(stream)
        assert rest == b"", rest  # no answer to a smuggled request
        counted = fe.metrics.rejected_requests_total.labels("invalid_framing")._value.get()
        assert counted == 1


async def test_an_obs_folded_header_is_a_400_and_a_close(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(
            b"GET /live HTTP/1.1\r\nHost: test\r\nX-Folded: one\r\n two\r\n\r\n" + SMUGGLED
        )
        buffered = bytearray()
        answer = await read_answer(stream, buffered)
        assert answer.status == 400
        assert "obs-fold" in str(answer.error()["message"])
        assert bytes(buffered) + await until_closed(stream) == b""


async def test_a_tab_folded_header_in_a_pipelined_head_is_refused_too(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(
            b"GET /live HTTP/1.1\r\nHost: test\r\n\r\n"
            b"GET /live HTTP/1.1\r\nHost: test\r\nX-Folded: one\r\n\ttwo\r\n\r\n"
        )
        buffered = bytearray()
        assert (await read_answer(stream, buffered)).status == 200
        assert (await read_answer(stream, buffered)).status == 400
        assert bytes(buffered) + await until_closed(stream) == b""


async def test_plain_content_length_and_chunked_requests_are_served(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser) as (_, url):
        stream = await open_raw(url)
        body = b'{"model": "deepseek-v4", "prompt": "hi", "max_tokens": 2}'
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (len(body), body)
            + b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked
        )
        buffered = bytearray()
        for _ in range(2):
            assert (await read_answer(stream, buffered)).status == 200
        await stream.aclose()
