"""Attack: HTTP/2 on the plain listener, and unauthenticated HTTP/2 streams that wait forever.

hypercorn switched a plain connection to HTTP/2 on ``Upgrade: h2c`` or on the prior-
knowledge preface; HTTP/2 then went around the head and body deadlines, and a stream
without a key waited for a body that never came, with no answer and no deadline. The
policy now: HTTP/1.1 only, on every listener (docs/security.md). The preface is answered
505 and closed; an ``Upgrade: h2c`` is ignored and the request served as HTTP/1.1, behind
the keys like any other.

Policy: a real frontend with an API key on 127.0.0.1:0; raw sockets, and the ``h2``
package (hypercorn's own) as an HTTP/2 client; every read has a deadline.
"""

from __future__ import annotations

import h2.config
import h2.connection
import trio

from attack_fixture import AUTH, KEY, open_raw, read_answer, until_closed
from frontend_fixture import serve_frontend

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


async def test_the_prior_knowledge_preface_is_a_505_and_a_close(http_parser: str) -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    for stream_id in range(1, 400, 2):  # 200 streams without a key, each waiting for a body
        client.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                (":scheme", "http"),
                (":authority", "test"),
                ("content-type", "application/json"),
            ],
        )
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (fe, url):
        stream = await open_raw(url)
        await stream.send_all(client.data_to_send())
        answer = await until_closed(stream, within=5)
        assert answer.startswith(b"HTTP/1.1 505 "), answer[:200]
        assert b'"code": "unsupported_protocol"' in answer
        counted = fe.metrics.rejected_requests_total.labels("unsupported_protocol")._value.get()
        assert counted == 1


async def test_an_h2c_upgrade_is_ignored_and_served_as_http11_behind_the_keys(
    http_parser: str,
) -> None:
    upgrade = (
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n"
    )
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n" + upgrade + b"\r\n")
        answer = await read_answer(stream)
        assert answer.status == 401  # not 101 Switching Protocols
        assert answer.error()["code"] == "invalid_api_key"
        await stream.aclose()
        stream = await open_raw(url)
        await stream.send_all(
            b"GET /v1/models HTTP/1.1\r\nHost: test\r\n" + AUTH + upgrade + b"\r\n"
        )
        answer = await read_answer(stream)
        assert answer.status == 200
        assert answer.head.startswith(b"HTTP/1.1 200")
        # Still HTTP/1.1: a second request on the same connection is served.
        await stream.send_all(b"GET /live HTTP/1.1\r\nHost: test\r\n\r\n")
        assert (await read_answer(stream)).status == 200
        await stream.aclose()


async def test_many_connections_opening_http2_are_all_closed_promptly(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        answers: list[bytes] = []

        async def one() -> None:
            stream = await open_raw(url)
            await stream.send_all(PREFACE)
            answers.append(await until_closed(stream, within=5))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(one)
        assert len(answers) == 50
        assert all(a.startswith(b"HTTP/1.1 505 ") for a in answers)
