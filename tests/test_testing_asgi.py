"""headwater.testing's HTTP without a socket: the streaming ASGI transport, and the
in-process server's clients (httpx, httpx2, the SDKs) on it.

Policy: toy ASGI apps pin the transport's contract (streaming, disconnects, the read
timeout on trio's clock, failing apps); the in-process server shows the same over the
real app stack. Virtual time (``autojump_clock``) unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypedDict

import httpx
import pytest
import trio
import trio.testing

from headwater.plane.memory import MemoryWorkerClient
from headwater.testing import ASGITransport, HeadwaterServer, open_server
from headwater.testing.faults import ObservedRuntime
from workers.engines.scripted import ScriptedEngine

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
TEXT = "The river ran to the sea and it never stopped, not once, not ever."
SCRIPT = [{"default": True, "text": TEXT}]


class Chat(TypedDict):
    """A chat completion's body, as the OpenAI SDK's ``create`` takes it too."""

    model: str
    messages: list[ChatCompletionMessageParam]


CHAT: Chat = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "Go on."}]}


def client(app: Any, nursery: trio.Nursery) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=ASGITransport(app, nursery), base_url="http://t")


async def start(send: Send, status: int = 200) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain")],
        }
    )


class Ticker:
    """An app that streams ``tick N`` every second until told to stop, and notes what it
    heard from its client."""

    def __init__(self, ticks: int = 1000) -> None:
        self.ticks = ticks
        self.heard: list[str] = []
        self.done = trio.Event()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        try:
            self.heard.append((await receive())["type"])
            await start(send)
            async with trio.open_nursery() as nursery:

                async def listen() -> None:
                    while (event := await receive())["type"] != "http.disconnect":
                        pass  # the rest of a body: our requests have none
                    self.heard.append(event["type"])
                    nursery.cancel_scope.cancel()

                nursery.start_soon(listen)
                for n in range(self.ticks):
                    await send(
                        {"type": "http.response.body", "body": b"tick %d\n" % n, "more_body": True}
                    )
                    await trio.sleep(1)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.done.set()


async def test_a_response_streams_as_the_app_sends_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app = Ticker(ticks=3)
    got: list[tuple[str, float]] = []
    async with client(app, nursery) as c, c.stream("GET", "/") as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            got.append((line, trio.current_time()))
    assert got == [("tick 0", 0), ("tick 1", 1), ("tick 2", 2)]
    assert app.heard == ["http.request", "http.disconnect"]  # then the response ended


async def test_httpx_own_asgi_transport_would_deliver_it_at_the_end(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Why this transport exists: httpx's runs the app to its end before returning.
    app = Ticker(ticks=3)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/")
    assert r.text == "tick 0\ntick 1\ntick 2\n"
    assert trio.current_time() == 3


async def test_a_client_that_leaves_is_a_disconnect_and_later_sends_are_dropped(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app = Ticker()
    async with client(app, nursery) as c, c.stream("GET", "/") as r:
        lines = r.aiter_lines()
        assert isinstance(lines, AsyncGenerator)  # typed an iterator: it has aclose()
        assert await lines.__anext__() == "tick 0"
        await lines.aclose()
    with trio.fail_after(5):
        await app.done.wait()
    assert app.heard == ["http.request", "http.disconnect"]
    assert trio.current_time() < 5


@pytest.mark.parametrize("where", ["head", "body"])
async def test_the_read_timeout_runs_on_trios_clock(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, where: str
) -> None:
    async def slow(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        await receive()
        if where == "head":
            await trio.sleep(30)
        await start(send)
        await trio.sleep(30)
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    transport = ASGITransport(slow, nursery)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/")
    assert trio.current_time() == 10


async def test_an_app_that_fails_gives_a_500_or_a_cut_body(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def fails(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        await receive()
        if scope["path"] == "/late":
            await start(send)
            await send({"type": "http.response.body", "body": b"half", "more_body": True})
        raise RuntimeError("boom")

    async with client(fails, nursery) as c:
        r = await c.get("/early")
        assert (r.status_code, r.content) == (500, b"")
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get("/late")
    assert caplog.text.count("ASGI app failed") == 2


async def test_a_head_request_gets_no_body(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def app(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        await receive()
        await start(send)
        await send({"type": "http.response.body", "body": b"body", "more_body": False})

    async with client(app, nursery) as c:
        assert (await c.head("/")).content == b""
        assert (await c.get("/")).content == b"body"


# -- the in-process server's clients -----------------------------------------------------


async def read_sse(
    server: HeadwaterServer, client: Any, leave_after: int | None = None
) -> list[float]:
    """Stream CHAT with *client* (httpx or httpx2); the trio time of each SSE event, up
    to *leave_after* events (then the client leaves)."""
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                times.append(trio.current_time())
                if len(times) == leave_after:
                    break
    return times


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
@pytest.mark.slow
async def test_the_servers_stream_comes_token_by_token(
    autojump_clock: trio.testing.MockClock, library: str
) -> None:
    async with open_server(script=SCRIPT, token_delay=0.5) as server:
        http = server.client() if library == "httpx" else server.httpx2_client()
        start_time = trio.current_time()
        times = await read_sse(server, http)
    (record,) = server.requests
    # The role's event leaves with the first token's, then one event per token, each as
    # the engine makes it, and [DONE] with the last.
    assert [t - start_time for t in times[:4]] == [0.5, 0.5, 1.0, 1.5]
    assert len(times) == 1 + record.tokens + 1
    assert times[-1] - start_time == record.tokens * 0.5
    assert record.events()[-1] == "DONE"


async def test_a_client_that_leaves_cancels_the_answer_on_its_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_server(script=SCRIPT, token_delay=0.5) as server:
        await read_sse(server, server.client(), leave_after=3)
        await server.settled()
        assert server.metric("inflight_requests") == 0
        (record,) = server.requests
        decode = record.generated[0]
        assert decode.outcome == "cancelled"
        assert decode.tokens < record.tokens + 1 < 10  # it stopped early
        assert server.metric("disconnected_clients_total") == 1
        (engine,) = [
            c.runtime.engine
            for c in server.frontend.router.clients()
            if isinstance(c, MemoryWorkerClient)
            and isinstance(c.runtime, ObservedRuntime)
            and c.instance.role.value == "decode"
        ]
        assert isinstance(engine, ScriptedEngine)
        assert engine.counters.requests_cancelled == 1


async def test_the_server_runs_on_the_real_clock_too() -> None:
    async with open_server(script=SCRIPT, token_delay=0.001) as server:
        assert not server.virtual_time
        times = await read_sse(server, server.client())
        assert len(times) > 2
        r = await server.openai_client().chat.completions.create(**CHAT)
        assert r.choices[0].message.content == TEXT


async def test_the_anthropic_sdk_talks_to_the_server(
    autojump_clock: trio.testing.MockClock,
) -> None:
    anthropic = pytest.importorskip("anthropic")
    async with open_server(script=SCRIPT, token_delay=0.5, api_keys=("k1",)) as server:
        client = server.anthropic_client()
        assert isinstance(client, anthropic.AsyncAnthropic)
        ask: Any = [{"role": "user", "content": "Hi"}]
        message = await client.messages.create(model="deepseek-v4", max_tokens=100, messages=ask)
        assert message.content[0].text == TEXT
        assert message.stop_reason == "end_turn"
        start_time = trio.current_time()
        async with client.messages.stream(
            model="deepseek-v4", max_tokens=100, messages=ask
        ) as stream:
            pieces = [(text, trio.current_time() - start_time) async for text in stream.text_stream]
        assert "".join(text for text, _ in pieces) == TEXT
        assert [t for _, t in pieces[:2]] == [0.5, 1.0]  # token by token
        # The SDK's key, in the header its version sends, passed the API-key check.
        sent = server.requests[-1].headers
        assert "k1" in sent.get("x-api-key", sent.get("authorization", ""))
        assert [r.status for r in server.requests] == [200, 200]
