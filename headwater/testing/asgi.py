"""HTTP without a socket: an ASGI app called in-process, one request at a time, streamed.

:class:`ASGITransport` is an ``httpx`` transport that hands each request to an ASGI app
running in a nursery of the caller's trio run, as hypercorn would after parsing it off
a connection, and streams the response back as the app sends it. httpx's own
``ASGITransport`` cannot serve here: it runs the app to the end before it returns the
response, so a streamed answer arrives in one piece, after its last token, and one that
never ends never arrives.

What a connection would do is done here, once, in :class:`Exchange` (for any client
library; the transports of ``httpx`` and of the ``httpx2`` the OpenAI and Anthropic SDKs
use are thin shells around it):

* the scope is hypercorn's (HTTP/1.1, the lifespan's state, the client's address);
* the request body goes to the app in one ``http.request`` message; ``receive`` then
  waits, and says ``http.disconnect`` once the response is complete or the client left;
* response bodies queue up to :data:`SEND_BUFFER` messages ahead of the reader (a
  socket's send buffer), then the app waits for the client, as over a slow connection;
* the client's read timeout (httpx's ``Timeout.read``) bounds the wait for the head and
  for each body message, on trio's clock: a test on a ``MockClock`` times out in
  virtual time;
* an app that raises before its response starts gives a 500, as hypercorn answers;
  one that raises or returns mid-body leaves the body incomplete, and reading it raises
  the library's ``RemoteProtocolError`` (a connection dropped mid-response);
* a client that closes the response early (or is cancelled) is a disconnect: the app
  hears ``http.disconnect`` and what it sends afterwards is dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote

import httpx
import trio

log = logging.getLogger(__name__)

#: Body messages the app may send ahead of the client reading them.
SEND_BUFFER = 64

Message = MutableMapping[str, Any]
#: An ASGI 3 app; loosely typed: frameworks type their scopes and events each their way.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class ReadTimedOut(Exception):
    """No head, or no body message, within the client's read timeout."""


class BrokenResponse(Exception):
    """The app ended (returned or raised) before its response's last body message."""


class Exchange:
    """One request through the app and its response back; see the module docstring.

    Made with the request's parts; :meth:`start` runs the app in *nursery* and returns
    once the response's head is there; :meth:`body` iterates its body; :meth:`close`
    is the client leaving (idempotent).
    """

    def __init__(self, app: ASGIApp, scope: Message, body: bytes) -> None:
        self.app = app
        self.scope = scope
        self.request_body = body
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        #: What the app raised, if it did (logged too).
        self.error: Exception | None = None
        self.complete = False  # the last body message was sent
        self._head = trio.Event()
        self._done = trio.Event()  # response complete, or the client left: disconnect
        self._client_left = False
        self._body_sent = False
        self._to_client, self._from_app = trio.open_memory_channel[bytes](SEND_BUFFER)
        self._suppress = scope["method"] == "HEAD"

    async def start(self, nursery: trio.Nursery, read_timeout: float | None) -> None:
        """Run the app in *nursery*; return once the response's head was sent. Raises
        ReadTimedOut; a caller cancelled meanwhile leaves (see :meth:`close`)."""
        nursery.start_soon(self._run, name=f"asgi {self.scope['path']}")
        try:
            with _timeout(read_timeout):
                await self._head.wait()
        except BaseException:
            self.close()
            raise

    def body(self, read_timeout: float | None) -> AsyncIterator[bytes]:
        """The response body's messages as they come. Raises ReadTimedOut or
        BrokenResponse."""
        return _Body(self, read_timeout)

    def close(self) -> None:
        """The client is gone: the app hears ``http.disconnect``; later sends are dropped."""
        if not self.complete:
            self._client_left = True
        self._done.set()
        self._from_app.close()

    async def _run(self) -> None:
        try:
            await self.app(self.scope, self._receive, self._send)
        except Exception as exc:
            # hypercorn logs it too, and answers 500 if nothing was sent yet.
            log.exception("ASGI app failed on %s %s", self.scope["method"], self.scope["path"])
            self.error = exc
        finally:
            if self.status is None and not self._client_left:
                self.status = 500
                self.headers = [(b"content-length", b"0")]
                self.complete = True
            self._head.set()
            self._done.set()
            self._to_client.close()

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}
        await self._done.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._client_left or self.complete:
            await trio.lowlevel.checkpoint()
            return
        kind = message["type"]
        if kind == "http.response.start" and self.status is None:
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self._head.set()
            await trio.lowlevel.checkpoint()
        elif kind == "http.response.body" and self.status is not None:
            data = bytes(message.get("body", b""))
            last = not message.get("more_body", False)
            if data and not self._suppress:
                try:
                    await self._to_client.send(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the client left while we waited for it to read
            else:
                await trio.lowlevel.checkpoint()
            if last:
                self.complete = True
                self._to_client.close()
                self._done.set()
        else:
            await trio.lowlevel.checkpoint()  # trailers, early hints: HTTP/1.1 has none


class _Body:
    """An exchange's body as an async iterator (a class, not an async generator: one
    left unfinished by a client that stops reading needs no finalizer)."""

    def __init__(self, exchange: Exchange, read_timeout: float | None) -> None:
        self._exchange = exchange
        self._timeout = read_timeout

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            with _timeout(self._timeout):
                return await self._exchange._from_app.receive()
        except trio.EndOfChannel:
            if not self._exchange.complete:
                raise BrokenResponse("the app ended before its response was complete") from None
            raise StopAsyncIteration from None
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None  # closed by the client itself


@contextmanager
def _timeout(seconds: float | None) -> Iterator[None]:
    """``trio.fail_after(seconds)``, raising ReadTimedOut; None: no bound."""
    with trio.move_on_after(seconds if seconds is not None else math.inf) as scope:
        yield
    if scope.cancelled_caught:
        raise ReadTimedOut(f"no response data within the client's read timeout ({seconds} s)")


def http_scope(
    method: str,
    url: Any,
    raw_headers: list[tuple[bytes, bytes]],
    state: dict[str, Any],
    client: tuple[str, int],
) -> Message:
    """The ASGI scope hypercorn builds for an HTTP/1.1 request to *url* (an httpx or
    httpx2 URL)."""
    raw_path: bytes = url.raw_path
    path, _, query = raw_path.partition(b"?")
    port = url.port or (443 if url.scheme == "https" else 80)
    return {
        "type": "http",
        "http_version": "1.1",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "method": method,
        "scheme": url.scheme,
        "path": unquote(path.decode("ascii")),
        "raw_path": path,
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in raw_headers],
        "client": client,
        "server": (url.host, port),
        "state": state.copy(),
        "extensions": {},
    }


class ExchangeTransport:
    """A transport's whole work, for either httpx: a request in, an :class:`Exchange`
    run, a streamed response out. A subclass names its library (:attr:`http`, the
    ``httpx`` or ``httpx2`` module, whose classes and errors it answers with) and that
    library's transport base; the two libraries differ in nothing else here.

    Args:
      app: the ASGI app (its lifespan already started, if it has one).
      nursery: where each request's app call runs; it must outlive the client.
      state: the lifespan's state, copied into each scope (ASGI's lifespan state).
      client: the client address the app sees.
    """

    http: ClassVar[Any]  # the httpx module (httpx or httpx2)
    body: ClassVar[type[ExchangeBody]]  # its response-stream class

    def __init__(
        self,
        app: ASGIApp,
        nursery: trio.Nursery,
        *,
        state: dict[str, Any] | None = None,
        client: tuple[str, int] = ("127.0.0.1", 50000),
    ) -> None:
        self.app = app
        self.nursery = nursery
        self.state = state if state is not None else {}
        self.client = client

    async def handle_async_request(self, request: Any) -> Any:
        http = self.http
        body = await request.aread()
        scope = http_scope(
            request.method, request.url, request.headers.raw, self.state, self.client
        )
        exchange = Exchange(self.app, scope, body)
        read_timeout = request.extensions.get("timeout", {}).get("read")
        try:
            await exchange.start(self.nursery, read_timeout)
        except ReadTimedOut as exc:
            raise http.ReadTimeout(str(exc), request=request) from exc
        assert exchange.status is not None  # a head came (the client has not left)
        return http.Response(
            exchange.status,
            headers=exchange.headers,
            stream=self.body(exchange, read_timeout, request),
            extensions={"http_version": b"HTTP/1.1"},
        )


class ExchangeBody:
    """A response body read from an :class:`Exchange`, with its library's errors (a
    subclass names the library, :attr:`http`, and its byte-stream base)."""

    http: ClassVar[Any]

    def __init__(self, exchange: Exchange, read_timeout: float | None, request: Any) -> None:
        self._exchange = exchange
        self._body = exchange.body(read_timeout)
        self._request = request

    def __aiter__(self) -> ExchangeBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._body.__anext__()
        except ReadTimedOut as exc:
            raise self.http.ReadTimeout(str(exc), request=self._request) from exc
        except BrokenResponse as exc:
            raise self.http.RemoteProtocolError(str(exc), request=self._request) from exc

    async def aclose(self) -> None:
        self._exchange.close()
        await trio.lowlevel.checkpoint()


class _HttpxBody(ExchangeBody, httpx.AsyncByteStream):
    http: ClassVar[Any] = httpx


class ASGITransport(ExchangeTransport, httpx.AsyncBaseTransport):
    """An httpx transport to *app* running in *nursery*: no socket, responses streamed
    (:class:`ExchangeTransport` has the arguments)."""

    http: ClassVar[Any] = httpx
    body: ClassVar[type[ExchangeBody]] = _HttpxBody
