"""The official SDKs' clients on the in-process server: OpenAI's and Anthropic's.

Both SDKs send through ``httpx2`` (the httpx they ship with), so their client is an
``httpx2.AsyncClient`` on :class:`HTTPX2Transport`, the twin of
:class:`~headwater.testing.asgi.ASGITransport` (the same :class:`~headwater.testing.asgi.Exchange`
underneath). Imported only when a test asks for one of these clients: the SDKs are
optional.

Both SDKs look up the platform they run on in a worker thread on their first request;
under a MockClock the clock would jump while that thread runs, so it is looked up here,
once, on the loop (a few microseconds on Linux).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import httpx2
import trio

from headwater.testing.asgi import (
    ASGIApp,
    BrokenResponse,
    Exchange,
    ReadTimedOut,
    http_scope,
)

if TYPE_CHECKING:
    import anthropic
    import openai


class HTTPX2Transport(httpx2.AsyncBaseTransport):
    """:class:`~headwater.testing.asgi.ASGITransport` for ``httpx2``; same arguments."""

    def __init__(self, app: ASGIApp, nursery: trio.Nursery, *,
                 state: dict[str, Any] | None = None,
                 client: tuple[str, int] = ("127.0.0.1", 50000)) -> None:  # fmt: skip
        self.app = app
        self.nursery = nursery
        self.state = state if state is not None else {}
        self.client = client

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        scope = http_scope(request.method, request.url, request.headers.raw, self.state,
                           self.client)  # fmt: skip
        exchange = Exchange(self.app, scope, body)
        read_timeout = request.extensions.get("timeout", {}).get("read")
        try:
            await exchange.start(self.nursery, read_timeout)
        except ReadTimedOut as exc:
            raise httpx2.ReadTimeout(str(exc), request=request) from exc
        assert exchange.status is not None  # a head came (the client has not left)
        return httpx2.Response(
            exchange.status, headers=exchange.headers,
            stream=_Body(exchange, read_timeout, request),
            extensions={"http_version": b"HTTP/1.1"},
        )  # fmt: skip


class _Body(httpx2.AsyncByteStream):
    def __init__(self, exchange: Exchange, read_timeout: float | None,
                 request: httpx2.Request) -> None:  # fmt: skip
        self._exchange = exchange
        self._body = exchange.body(read_timeout)
        self._request = request

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._body.__anext__()
        except ReadTimedOut as exc:
            raise httpx2.ReadTimeout(str(exc), request=self._request) from exc
        except BrokenResponse as exc:
            raise httpx2.RemoteProtocolError(str(exc), request=self._request) from exc

    async def aclose(self) -> None:
        self._exchange.close()
        await trio.lowlevel.checkpoint()


def openai_client(http: httpx2.AsyncClient, base_url: str, api_key: str,
                  **kwargs: Any) -> openai.AsyncOpenAI:  # fmt: skip
    """An ``openai.AsyncOpenAI`` sending through *http*; *kwargs* are its own."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, **kwargs)
    _look_up_platform(client, "openai._base_client")
    return client


def anthropic_client(http: httpx2.AsyncClient, base_url: str, api_key: str,
                     **kwargs: Any) -> anthropic.AsyncAnthropic:  # fmt: skip
    """An ``anthropic.AsyncAnthropic`` sending through *http*; *kwargs* are its own."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, http_client=http,
                                      **kwargs)  # fmt: skip
    _look_up_platform(client, "anthropic._base_client")
    return client


def _look_up_platform(client: Any, module: str) -> None:
    """Do now, on the loop, what the SDK's first request would do in a thread. An SDK
    that no longer has this internal keeps its own way (a thread: see the module
    docstring for what that risks under a MockClock)."""
    try:
        get_platform = importlib.import_module(module).get_platform
    except (ImportError, AttributeError):
        return
    if getattr(client, "_platform", False) is None:
        client._platform = get_platform()
