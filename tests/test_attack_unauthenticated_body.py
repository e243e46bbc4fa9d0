"""Attack: the body of an unauthenticated request was read before its 401, and invited.

hypercorn answered ``Expect: 100-continue`` at once, and the key check read (and dropped)
the whole body before it answered 401: one byte every 29 s held the connection for as
long as the body lasted. Now the 401 leaves before any byte of the body is read, no
``100 Continue`` is sent for it, and the connection then lingers for
``linger_timeout`` at most (reading and dropping what comes, so that the close does not
reset the answer under a client still writing) before it closes.

Policy: a real frontend with an API key on 127.0.0.1:0; raw sockets and httpx; every
read has a deadline, and the times asserted are bounds with room for a loaded machine.
"""

from __future__ import annotations

import httpx
import trio

from attack_fixture import AUTH, KEY, open_raw, post, read_answer, until_closed
from frontend_fixture import serve_frontend

CHAT = b'{"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


async def test_a_401_leaves_before_the_body_and_invites_none(http_parser: str) -> None:
    settings = {"api_keys": (KEY,), "read_timeout": 30, "http_parser": http_parser}
    async with serve_frontend(**settings) as (fe, url):
        stream = await open_raw(url)
        start = trio.current_time()
        await stream.send_all(
            post(
                "/v1/chat/completions", b"", length=10_000_000, headers=b"Expect: 100-continue\r\n"
            )
        )
        answer = await read_answer(stream, within=2)
        assert answer.status == 401  # the first answer: no 100 Continue before it
        assert trio.current_time() - start < 2
        # A client that sends its body anyway, slowly: the connection closes within the
        # linger, not after the body or the 30 s read timeout.
        await stream.send_all(b"{")
        assert await until_closed(stream, within=6) == b""
        assert trio.current_time() - start < 6
        assert fe.metrics.rejected_requests_total.labels("unauthorized")._value.get() == 1


async def test_a_client_that_writes_its_whole_body_first_still_gets_its_401(
    http_parser: str,
) -> None:
    # httpx writes the whole body before it reads: the linger keeps the connection from
    # resetting the answer under it.
    body = b'{"model": "deepseek-v4", "prompt": "' + b"a" * 4_000_000 + b'"}'
    async with (
        serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url),
        httpx.AsyncClient() as client,
    ):
        for _ in range(3):
            r = await client.post(
                url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"


async def test_an_authenticated_client_that_expects_100_continue_gets_it(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(
            post(
                "/v1/chat/completions",
                b"",
                length=len(CHAT),
                headers=AUTH + b"Expect: 100-continue\r\n",
            )
        )
        buffered = bytearray()
        assert (await read_answer(stream, buffered)).status == 100
        await stream.send_all(CHAT)
        answer = await read_answer(stream, buffered)
        assert answer.status == 200, answer.body
        await stream.aclose()


async def test_a_refused_request_says_its_connection_closes(http_parser: str) -> None:
    # Answered before its body was read, the connection closes after the 401, and the
    # 401 says so: a client does not send its next request on it.
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(post("/v1/chat/completions", b"", length=len(CHAT)))
        answer = await read_answer(stream)
        assert answer.status == 401
        assert answer.header("connection") == "close"
        await stream.send_all(CHAT)
        assert await until_closed(stream, within=6) == b""
        stream = await open_raw(url)
        await stream.send_all(post("/v1/chat/completions", CHAT, headers=AUTH))
        assert (await read_answer(stream)).status == 200
        await stream.aclose()
