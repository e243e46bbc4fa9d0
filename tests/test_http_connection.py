"""The app's ASGI connection (frontend/http/connection.py): a response ends with its last
piece, in the same message; nothing is held back to find it.

Policy: a small QuartTrio app is called as an ASGI app, its messages recorded; the
frontend's own streams are read through headwater.testing on trio's virtual clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from quart import Response
from quart_trio import QuartTrio

from frontend.http.connection import EndingHTTPConnection, LastPiece, use_ending_connection
from headwater.testing.asgi import Exchange, http_scope
from headwater.testing.server import HeadwaterServer

MODEL = "deepseek-v4"


def _app(resumed: list[str]) -> QuartTrio:
    app = QuartTrio(__name__)
    use_ending_connection(app)

    @app.get("/json")
    async def as_json() -> Response:
        return Response(b'{"a": 1}', content_type="application/json")

    @app.get("/ending")
    async def ending() -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            try:
                yield b"one,"
                await trio.sleep(1)  # not ready together: its own message
                yield LastPiece(b"two")
                resumed.append("after the last piece")  # never: it ended the response
                yield b"three"
            finally:
                resumed.append("closed")

        return Response(pieces(), content_type="text/event-stream")

    @app.get("/forever")
    async def forever() -> Response:
        try:
            await trio.sleep_forever()
        finally:
            resumed.append("cancelled")

    @app.get("/plain")
    async def plain() -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            yield b"one,"
            yield b"two"

        return Response(pieces(), content_type="text/event-stream")

    return app


async def _messages(
    app: QuartTrio, path: str, *, leave_after: float | None = None
) -> list[dict[str, Any]]:
    """The ``http.response.body`` messages of one GET *path*; the client leaves after
    *leave_after* seconds, if given, else once the response has ended."""
    sent: list[dict[str, Any]] = []
    done = trio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if leave_after is None:
            await done.wait()
        else:
            await trio.sleep(leave_after)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            sent.append(dict(message))
            if not message.get("more_body", False):
                done.set()

    url = httpx.URL(f"http://test{path}")
    scope = http_scope("GET", url, [(b"host", b"test")], {}, ("127.0.0.1", 1))
    await app(scope, receive, send)  # type: ignore[arg-type]
    return [{"body": m.get("body", b""), "more_body": m.get("more_body", False)} for m in sent]


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def test_a_request_takes_one_task_beside_the_callers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # quart-trio spawns two (the handler, and one reading the request's messages); the
    # messages are read by the caller's task here.
    spawns = _Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        assert await _messages(_app([]), "/json")
    finally:
        trio.lowlevel.remove_instrument(spawns)
    (name,) = spawns.names
    assert name.endswith(".handle_request")


async def test_a_client_that_leaves_cancels_the_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    resumed: list[str] = []
    with trio.fail_after(10):
        assert await _messages(_app(resumed), "/forever", leave_after=1) == []
    assert resumed == ["cancelled"]
    assert trio.current_time() == 1


def test_the_app_uses_the_ending_connection() -> None:
    app = _app([])
    assert app.asgi_http_class is EndingHTTPConnection


async def test_a_known_body_is_one_message(autojump_clock: trio.testing.MockClock) -> None:
    # Quart's own: the body, then an empty message that ends it.
    assert await _messages(_app([]), "/json") == [{"body": b'{"a": 1}', "more_body": False}]


async def test_a_stream_ends_with_its_last_piece(autojump_clock: trio.testing.MockClock) -> None:
    resumed: list[str] = []
    messages = await _messages(_app(resumed), "/ending")
    assert messages == [
        {"body": b"one,", "more_body": True},
        {"body": b"two", "more_body": False},
    ]
    assert resumed == ["closed"]  # the generator was closed at its last piece


async def test_a_stream_without_a_last_piece_ends_as_quart_ends_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    messages = await _messages(_app([]), "/plain")
    assert messages == [
        {"body": b"one,", "more_body": True},
        {"body": b"two", "more_body": True},
        {"body": b"", "more_body": False},
    ]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_the_sse_stream_ends_with_done_in_its_last_message(
    headwater_server: HeadwaterServer,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    include_usage: bool,
) -> None:
    """The frontend's streams: the last delta (with the usage, when asked) and
    ``[DONE]`` end the response, in one message; no empty message after it."""
    bodies: list[tuple[bytes, bool]] = []
    send = Exchange._send

    async def recording(self: Exchange, message: Any) -> None:
        if message["type"] == "http.response.body":
            bodies.append((bytes(message.get("body", b"")), message.get("more_body", False)))
        await send(self, message)

    monkeypatch.setattr(Exchange, "_send", recording)
    client = headwater_server.client()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": include_usage},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = b"".join([piece async for piece in r.aiter_bytes()])
    *pieces, (last, more) = bodies
    assert not more
    assert all(more for _, more in pieces)
    assert last.endswith(b"data: [DONE]\n\n")
    events = [e for e in last.split(b"\n\n") if e]
    assert (b'"usage"' in events[-2]) is include_usage
    assert b'"finish_reason":"length"' in events[-3 if include_usage else -2]
    assert text == b"".join(piece for piece, _ in bodies)
