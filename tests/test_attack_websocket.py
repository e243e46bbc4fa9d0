"""Attack: a WebSocket upgrade went around the key check, and a request value forged a log line.

hypercorn made a ``websocket`` ASGI scope of any ``Upgrade: websocket`` GET; the key
check passed scopes that were not ``http`` through, and the app answered 500 with ~5 kB
of traceback logged per request, the request's path in it: ``%0a`` in a path began a new,
forged log line. Now an upgrade is ignored (served as the HTTP/1.1 request it also is,
behind the keys), a scope that is neither ``http`` nor ``lifespan`` is refused by the key
check, and every request value logged is escaped (:func:`frontend.http.errors.loggable`).

Policy: a real frontend on 127.0.0.1:0; raw sockets; log records through caplog.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from quart import request

from frontend.http.auth import ApiKeys, RequireApiKey
from frontend.http.errors import loggable
from frontend.metrics import FrontendMetrics

from attack_fixture import AUTH, KEY, open_raw, read_answer
from frontend_fixture import serve_frontend

UPGRADE = (
    b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


@pytest.mark.parametrize("path", [b"/v1/models", b"/v1/chat/completions", b"/ws", b"/debug/x"])
async def test_an_upgrade_without_a_key_is_a_plain_401(
    path: bytes, caplog: pytest.LogCaptureFixture, http_parser: str
) -> None:
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        stream = await open_raw(url)
        await stream.send_all(b"GET %s HTTP/1.1\r\nHost: test\r\n%s\r\n" % (path, UPGRADE))
        answer = await read_answer(stream)
        await stream.aclose()
        assert answer.status == 401
        assert answer.error()["code"] == "invalid_api_key"
        assert len(answer.body) < 400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_upgrade_with_a_key_is_served_as_http11(http_parser: str) -> None:
    async with serve_frontend(http_parser=http_parser, api_keys=(KEY,)) as (_, url):
        stream = await open_raw(url)
        for path, status in ((b"/v1/models", 200), (b"/ws", 404)):
            await stream.send_all(
                b"GET %s HTTP/1.1\r\nHost: test\r\n%s%s\r\n" % (path, AUTH, UPGRADE)
            )
            answer = await read_answer(stream)
            assert answer.status == status
            assert answer.head.startswith(b"HTTP/1.1 ")
        await stream.aclose()


async def test_the_key_check_refuses_a_websocket_scope() -> None:
    # Belt and braces: were a server to hand the app a websocket scope, no key, no app.
    reached: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    keyed = RequireApiKey(app, ApiKeys([KEY]), metrics=FrontendMetrics(), max_body_bytes=1024)
    scope = {
        "type": "websocket",
        "path": "/v1/models",
        "headers": [(b"authorization", f"Bearer {KEY}".encode())],
    }
    await keyed(scope, receive, send)  # type: ignore[arg-type]
    assert reached == []
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": None}]


def test_a_logged_value_cannot_begin_a_line() -> None:
    assert loggable("/v1/x\nFORGED line\r\n") == "/v1/x\\nFORGED line\\r\\n"
    assert loggable("tab\there \x1b[31m red \u2028 sep") == "tab\\there \\x1b[31m red \\u2028 sep"
    assert loggable("plain /v1/models?x=1") == "plain /v1/models?x=1"


async def test_a_crafted_path_in_an_error_log_stays_on_its_line(
    caplog: pytest.LogCaptureFixture,
    http_parser: str,
) -> None:
    async with serve_frontend(http_parser=http_parser) as (fe, url):

        @fe.app.before_request
        async def fail() -> None:  # an unexpected error, on a path the client chose
            if request.path.startswith("/boom"):
                raise RuntimeError("boom")

        stream = await open_raw(url)
        await stream.send_all(
            b"GET /boom/x%0a2026-01-01%20CRITICAL%20forged HTTP/1.1\r\nHost: test\r\n\r\n"
        )
        answer = await read_answer(stream)
        await stream.aclose()
        assert answer.status == 500
    [record] = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert "\n" not in record.getMessage()
    assert "x\\n2026-01-01 CRITICAL forged" in record.getMessage()
