"""Fix 5: a known-length response's head leaves with its body, in one write; the HTTP/1.1
policy (strict framing, no protocol switch, ``100 Continue`` only for a body the app reads);
and the limits' own answers say what was refused.

hypercorn writes a response's head as soon as the app starts the response, and its body
in a second write. :class:`HeadWithBodyH11Protocol` holds the head of a response whose
length is known (its body is in hand: a JSON answer) and writes it with the body, in one
``write(2)``, as hyper and nginx do. A streamed response (no Content-Length) still sends
its head at once, before the first event; its last body leaves with the body's end, one
write, when the app ends it that way (a :class:`~frontend.http.serving.stream.LastBody`).

Each request head passes :meth:`HeadWithBodyH11Protocol._handle_events` (hypercorn's, with
the policy) before the app sees it, wherever in a read it came:

- Its size and framing (:func:`~frontend.http.serving.limits.head_fault`,
  :func:`~frontend.http.serving.limits.request_fault`): 431 for a head over the limit,
  whole or pipelined; 400 for obs-fold or Content-Length with Transfer-Encoding; 505 for
  the HTTP/2 preface. Each closes the connection.
- No switch of protocol: an ``Upgrade`` (h2c, websocket) is ignored, as RFC 9110 section
  7.8 lets a server do, and the request is served as the HTTP/1.1 request it also is
  (behind the API keys like any other). HTTP/2 would go around every deadline and limit
  here, which are HTTP/1.1's; TLS offers only ``http/1.1`` by ALPN for the same reason.
- ``100 Continue`` only once the app asks for the body (its first ``receive``): hypercorn
  sent it as soon as the head arrived, inviting the body of a request about to be refused
  (a 401 answers without reading it, and the client need not send it).

hypercorn answers a request it cannot parse with an empty error response; the refusals of
the transport limits and of the policy, 431 (head over ``h11_max_incomplete_size``), 408
(head not done within ``header_timeout``), 400 and 505, get an OpenAI-style error body
naming what was refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from itertools import chain
from typing import TYPE_CHECKING

import h11
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, Request
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import H11SendableEvent

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.limits import HEADER_TOO_LARGE, Fault, head_fault, request_fault
from frontend.http.serving.policy import (
    ContinueOnReceive,
    error_body,
    json_error_head,
    limit_error,
    refusal,
)
from frontend.http.serving.stream import EndingHTTPStream, LastBody

if TYPE_CHECKING:
    from hypercorn.events import Event
    from hypercorn.typing import AppWrapper, ConnectionState, TaskGroup, WorkerContext

STREAM_ID = 1  # hypercorn's: an HTTP/1.1 connection has one stream at a time


class HeadWithBodyH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, holding a known-length head for its body.

    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` puts one in place of
    the H11Protocol hypercorn made for a connection, before the connection's first
    byte is read; built with the same arguments, it adds only :attr:`_held_head`.
    """

    config: ServerConfig
    #: The head of a known-length response, until the body's first bytes (or its end).
    _held_head: bytes | None = None
    #: The bytes of a response's last body and its end, while both are being framed.
    _corked: list[bytes] | None = None

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        task_group: TaskGroup,
        connection_state: ConnectionState,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
    ) -> None:
        """hypercorn's, with the app's ``receive`` asking for ``100 Continue``."""
        super().__init__(
            app, config, context, task_group, connection_state, ssl, client, server, send
        )
        self.app = ContinueOnReceive(app, self._continue_if_waiting)

    @property
    def awaiting_head(self) -> bool:
        """The next bytes received start a request head (the client is IDLE)."""
        return self.connection.their_state is h11.IDLE

    @property
    def receiving_body(self) -> bool:
        """A request's body is still to come (the client is in SEND_BODY)."""
        return self.connection.their_state is h11.SEND_BODY

    @property
    def between_requests(self) -> bool:
        """No request is under way (the server is IDLE)."""
        return self.connection.our_state is h11.IDLE

    async def _handle_events(self) -> None:
        """hypercorn's ``H11Protocol._handle_events``, with the policy of the module
        docstring: each head checked before h11 reads it and after, no protocol switch,
        and no ``100 Continue`` sent here (the app's first ``receive`` sends it)."""
        limit = self.config.h11_max_incomplete_size
        while True:
            connection = self.connection
            if type(connection) is h11.Connection and connection.their_state is h11.IDLE:
                # A head, whole or not, is in h11's buffer from its first byte.
                fault = head_fault(_buffered(connection, limit + 1), limit)
                if fault is not None:
                    await self._refuse_request(fault)
                    break
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as error:
                if connection.our_state in {h11.IDLE, h11.SEND_RESPONSE}:
                    await self._send_error_response(error.error_status_hint)
                await self.send(Closed())
                break
            if isinstance(event, h11.Request):
                fault = request_fault(event.http_version, event.headers)
                if fault is not None:
                    await self._refuse_request(fault)
                    break
                await self.send(Updated(idle=False))
                await self._create_stream(_without_upgrade(event))
            elif event is h11.PAUSED:
                await self.can_read.clear()
                await self.can_read.wait()
            elif (
                isinstance(event, h11.ConnectionClosed)
                or event is h11.NEED_DATA
                or self.stream is None
            ):
                break
            elif isinstance(event, h11.Data):
                await self.stream.handle(Body(stream_id=STREAM_ID, data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await self.stream.handle(EndBody(stream_id=STREAM_ID))

    async def stream_send(self, event: StreamEvent) -> None:
        """hypercorn's ``stream_send``, and a :class:`LastBody` (a response's last bytes
        and its end) in one write."""
        if type(event) is not LastBody:
            await super().stream_send(event)
            return
        self._corked = []
        try:
            await self._send_h11_event(h11.Data(data=event.data))
            await self._send_h11_event(h11.EndOfMessage())
        finally:
            corked, self._corked = self._corked, None
            if corked:
                await self.send(RawData(data=b"".join(corked)))

    async def _create_stream(self, request: h11.Request) -> None:
        """hypercorn's ``_create_stream`` for an HTTP request (never a websocket: no
        Upgrade field reaches here), whose last body leaves with the body's end
        (:class:`EndingHTTPStream`)."""
        self.stream = EndingHTTPStream.of(self)
        raw = self.config.h11_pass_raw_headers
        headers = request.headers.raw_items() if raw else list(request.headers)
        await self.stream.handle(
            Request(
                stream_id=STREAM_ID,
                headers=headers,
                http_version=request.http_version.decode(),
                method=request.method.decode("ascii").upper(),
                raw_path=request.target,
                state=self.connection_state,
            )
        )
        self.keep_alive_requests += 1
        await self.context.mark_request()

    async def _continue_if_waiting(self) -> None:
        """The app asks for the request's body: invite it, if the client waits to be."""
        if self.connection.they_are_waiting_for_100_continue:
            await self._send_h11_event(
                h11.InformationalResponse(
                    status_code=100, headers=self.config.response_headers("h11")
                )
            )

    async def _refuse_request(self, fault: Fault) -> None:
        """Answer *fault* (:func:`~frontend.http.serving.policy.refusal`), and close the
        connection: what follows the head cannot be trusted to be where h11 would look
        for it. Written as bytes, past h11, which has not read the head yet (or would
        take the response for the request's own)."""
        await self.send(RawData(data=refusal(fault, self.config)))
        await self.send(Closed())

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        """hypercorn's ``H11Protocol._send_h11_event``, holding a known-length head back
        until the body's first bytes (or its end) go out with it, and closing the
        connection after a response that starts before its request's body has ended."""
        held = self._held_head
        data: bytes | None
        if type(event) is h11.Response and self.connection.their_state is h11.SEND_BODY:
            # Answered before its body ended (a 401 reads none): the connection closes
            # after this response (lingering, HeadwaterTCPServer._close), and says so.
            headers = [*event.headers.raw_items(), (b"connection", b"close")]
            event = h11.Response(
                status_code=event.status_code, reason=event.reason, headers=headers
            )
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            data = None
        if held is not None:
            self._held_head = None
            data = held + (data or b"")
        elif type(event) is h11.Response and data and _has_length(event):
            # The next event is this response's body (or its end, for an empty or HEAD
            # response): the app sends its start and body back to back. A connection
            # that closes in between (the app failed) never sends this head, and the
            # client sees a closed connection instead of a truncated body.
            self._held_head = data
            return
        if data is not None:
            if self._corked is not None:
                self._corked.append(data)
            else:
                await self.send(RawData(data=data))

    async def _send_error_response(self, status_code: int) -> None:
        """hypercorn's ``H11Protocol._send_error_response``, with a JSON error body for
        the statuses of the transport limits (431 is also reported to
        ``config.refused``); others go to it as they are. Each is reported to
        ``config.answered``."""
        if status_code == 431:
            self.config.refused(HEADER_TOO_LARGE)
        self.config.answered(status_code)
        error = limit_error(status_code, self.config)
        if error is None:
            await super()._send_error_response(status_code)
            return
        await self._send_json_error(status_code, *error)

    async def _send_json_error(self, status_code: int, code: str, message: str) -> None:
        """A whole error response with an OpenAI-style body, and ``Connection: close``."""
        body = error_body(code, message)
        await self._send_h11_event(
            h11.Response(
                status_code=status_code,
                headers=list(chain(json_error_head(body), self.config.response_headers("h11"))),
            )
        )
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def _buffered(connection: h11.Connection, size: int) -> bytes:
    """The first *size* bytes that *connection* holds unparsed. h11's public
    ``trailing_data`` copies all of them, which may be a whole read of pipelined requests
    for each; its buffer keeps them in a bytearray (fingerprinted in
    tests/test_hypercorn_seam.py)."""
    return bytes(connection._receive_buffer._data[:size])


def _without_upgrade(request: h11.Request) -> h11.Request:
    """*request* without its ``Upgrade`` field, if it has one: hypercorn would switch such
    a request's connection to HTTP/2 (h2c) or a WebSocket, which this server does not."""
    headers = request.headers.raw_items()
    if not any(name.lower() == b"upgrade" for name, _ in headers):
        return request
    return h11.Request(
        method=request.method,
        target=request.target,
        http_version=request.http_version,
        headers=[(name, value) for name, value in headers if name.lower() != b"upgrade"],
    )


def _has_length(response: h11.Response) -> bool:
    return any(name == b"content-length" for name, _ in response.headers)
