"""Attack: a request head pipelined behind another goes around --max-header-bytes.

h11 measures a head only while it is incomplete; the seam cut a head that arrived whole
in one read, but only the first head of that read. A second head pipelined behind a
request (its body included) sat whole in h11's buffer and was served however long. Every
head is now measured where h11 is asked for it, whichever read brought it.

Policy: a real frontend on 127.0.0.1:0 with a 2 KiB head limit; raw sockets.
"""

from __future__ import annotations

import trio

from attack_fixture import open_raw, post, read_answer, until_closed
from frontend_fixture import serve_frontend

LIMIT = 2048


def _get(pad: int) -> bytes:
    return b"GET /live HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * pad + b"\r\n\r\n"


async def test_a_long_head_pipelined_behind_a_request_is_refused_with_431(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, max_header_bytes=LIMIT) as (fe, url):
        for first in (_get(10), post("/v1/models", b"{}")):  # with a body before it, too
            stream = await open_raw(url)
            await stream.send_all(first + _get(60_000))  # one write: one read, likely
            buffered = bytearray()
            assert (await read_answer(stream, buffered)).status in (200, 405)
            second = await read_answer(stream, buffered)
            assert second.status == 431, second.head
            assert second.error()["code"] == "header_too_large"
            assert await until_closed(stream, within=5) == b""
            await stream.aclose()
        counted = fe.metrics.rejected_requests_total.labels("header_too_large")._value.get()
        assert counted == 2


async def test_a_pipelined_head_within_the_limit_is_served(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, max_header_bytes=LIMIT) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(_get(10) + _get(LIMIT - 100) + _get(10))
        buffered = bytearray()
        for _ in range(3):
            assert (await read_answer(stream, buffered)).status == 200
        await stream.aclose()


async def test_many_small_pipelined_heads_are_each_measured_alone(http_parser: str) -> None:
    # The limit is per head: forty heads of 200 bytes in one read are forty requests.
    async with serve_frontend(http_parser=http_parser, max_header_bytes=LIMIT) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(_get(150) * 40)
        buffered = bytearray()
        with trio.fail_after(10):
            for _ in range(40):
                assert (await read_answer(stream, buffered)).status == 200
        await stream.aclose()
