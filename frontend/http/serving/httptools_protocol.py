"""HTTP/1.1 read by llhttp (``httptools``), compiled, behind hypercorn's protocol seam.

:class:`HttptoolsProtocol` stands where hypercorn's ``H11Protocol`` stands, with its
interface (``initiate``, ``handle``, ``stream_send``, the stream events of
:mod:`hypercorn.protocol.events`), when ``ServerConfig.http_parser`` is
``"httptools"``. llhttp parses the request heads and bodies; the protocol writes the
responses itself (:mod:`~frontend.http.serving.http11_codec`, h11's rules) and carries
the policy of :class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`,
from the same code (:mod:`~frontend.http.serving.policy`,
:mod:`~frontend.http.serving.limits`): head size (431), the HTTP/2 preface (505),
obs-fold and Content-Length with Transfer-Encoding (400), no protocol switch,
``100 Continue`` on the app's first ``receive``, a known-length head written with its
body, ``Connection: close`` after a response that starts before its request's body
ended, JSON error bodies, and the refusal and answer hooks.

llhttp parses all it is given, and says nowhere where a message ended; so each request
is given exactly its own bytes: its head up to the blank line (found as h11 finds it,
which the head limit measures anyway), then as many body bytes as Content-Length says,
or as :class:`~frontend.http.serving.http11_codec.ChunkedExtent` measures for a chunked
body. A pipelined request waits, unparsed, until the one before it has been answered,
as with h11.

A head that llhttp refuses is read again by h11
(:func:`~frontend.http.serving.http11_codec.h11_request_head`), which serves it or
answers with its own status: llhttp is stricter in places (bare LF line ends, a method
or version it does not know, a control character in a field value, a Content-Length
given twice), and h11 is the reference. That costs an h11 parse on that path only. So a
client gets the same answer whichever parser reads its request, byte for byte
(``tests/test_http_parsers.py``). Not covered, as with the h11 protocol: HTTP/2,
websockets, a request's trailer fields (read, and dropped).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import (
    Body,
    Data,
    EndBody,
    EndData,
    InformationalResponse,
    Request,
    Response,
    StreamClosed,
)
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.http_stream import HTTPStream

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.http11_codec import (
    ChunkedExtent,
    ChunkError,
    Framing,
    RequestHead,
    ResponseHeadError,
    h11_request_head,
    informational_head,
    keep_alive,
    request_head_status,
    response_head,
    wants_continue,
)
from frontend.http.serving.limits import HEADER_TOO_LARGE, Fault, measure_head, request_fault
from frontend.http.serving.policy import (
    ContinueOnReceive,
    error_body,
    json_error_head,
    limit_error,
    refusal,
)

if TYPE_CHECKING:
    from hypercorn.config import Config
    from hypercorn.events import Event
    from hypercorn.typing import AppWrapper, ConnectionState, TaskGroup, WorkerContext

STREAM_ID = 1  # hypercorn's: an HTTP/1.1 connection has one stream at a time


class _State(enum.Enum):
    """One side of the connection, in h11's terms."""

    IDLE = enum.auto()  # client: before a head; server: before a request
    WAITING = enum.auto()  # server: a request read, no response started
    BODY = enum.auto()  # a body under way (the request's, or the response's)
    DONE = enum.auto()
    ERROR = enum.auto()


IDLE, WAITING, BODY, DONE, ERROR = _State


class _Sink:
    """What llhttp reports of the bytes it is given: a request head's target and
    fields (names as sent, values without their surrounding whitespace, as h11 gives
    them), the body's pieces, and the message's end."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.pieces: list[bytes] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class HttptoolsProtocol:
    """HTTP/1.1 with llhttp as the parser; hypercorn's ``H11Protocol`` interface.

    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` puts one in place of
    the H11Protocol hypercorn made for a connection, before the connection's first byte
    is read, built with the same arguments.
    """

    config: ServerConfig

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
        """As hypercorn's ``H11Protocol``, with the app's ``receive`` asking for
        ``100 Continue``."""
        assert isinstance(config, ServerConfig)
        self.app = ContinueOnReceive(app, self._continue_if_waiting)
        self.can_read = context.event_class()
        self.client = client
        self.config = config
        self.context = context
        self.keep_alive_requests = 0
        self.send = send
        self.server = server
        self.ssl = ssl
        self.stream: HTTPStream | None = None
        self.task_group = task_group
        self.connection_state = connection_state
        self._buffer = bytearray()  # received, not yet given to the parser
        self._eof = False
        self._sink = _Sink()
        self._parser = self._new_parser()
        self._their = IDLE
        self._our = IDLE
        # The request under way: its method and version, whether the connection may
        # carry another after it, whether its client waits for 100 Continue.
        self._method: bytes | None = None
        self._version: bytes | None = None
        self._keep_alive = True
        self._waiting_for_continue = False
        # Its body: bytes still to come (Content-Length), or a chunked body's extent.
        self._body_left = 0
        self._chunks: ChunkedExtent | None = None
        # The response under way: its framing, the bytes its length still allows, and
        # its head while held for its body.
        self._framing: Framing = "length"
        self._length_left = 0
        self._held_head: bytes | None = None

    @property
    def awaiting_head(self) -> bool:
        """The next bytes received start a request head."""
        return self._their is IDLE

    @property
    def receiving_body(self) -> bool:
        """A request's body is still to come."""
        return self._their is BODY

    @property
    def between_requests(self) -> bool:
        """No request is under way."""
        return self._our is IDLE

    async def initiate(self) -> None:
        pass

    async def handle(self, event: Event) -> None:
        """hypercorn's ``H11Protocol.handle``: bytes received (none: the client's EOF),
        or the connection closed."""
        if isinstance(event, RawData):
            if event.data:
                self._buffer += event.data
            else:
                self._eof = True
            await self._handle_events()
        elif isinstance(event, Closed):
            await self._close_stream()

    async def stream_send(self, event: StreamEvent) -> None:
        """hypercorn's ``H11Protocol.stream_send``: the stream's events to the wire."""
        if isinstance(event, Response):
            headers = [*event.headers, *self.config.response_headers("h11")]
            if event.status_code < 200:
                await self._send_informational(event.status_code, headers)
                return
            if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            await self._send_response(event.status_code, headers)
        elif isinstance(event, Body):
            await self._send_body(event.data)
        elif isinstance(event, EndBody):
            await self._end_body()
        elif isinstance(event, Data):  # a websocket's, which this server never makes
            await self.send(RawData(data=event.data))
        elif isinstance(event, StreamClosed):
            await self._maybe_recycle()
        else:
            assert isinstance(event, InformationalResponse | EndData)  # nothing, for HTTP/1

    # -- reading ----------------------------------------------------------------------

    async def _handle_events(self) -> None:
        """hypercorn's ``H11Protocol._handle_events``, an event at a time: a request
        head (checked, as the h11 protocol checks it), then its body's pieces and end;
        a pipelined request waits until the one before has been answered."""
        while True:
            their = self._their
            if their is IDLE:
                if not await self._read_head():
                    break
            elif their is BODY:
                if not await self._deliver_body():
                    break
            elif their is DONE and self._buffer and self._keep_alive:
                # The next request: it waits until this one's answer has ended.
                await self.can_read.clear()
                await self.can_read.wait()
            else:
                if self._buffer and their is DONE:  # bytes after a last request
                    await self._protocol_error(400)
                elif their is ERROR:
                    await self.send(Closed())
                break

    async def _deliver_body(self) -> bool:
        """Hand the stream the body's next piece, or its end; False when there is
        nothing more to do now (no bytes yet, the stream gone, or a malformed body)."""
        stream, sink = self.stream, self._sink
        if stream is None:
            return False  # answered and closed: the connection is closing
        if not sink.pieces and not sink.complete:
            try:
                self._read_body()
            except (HttpParserError, ChunkError) as error:
                await self._protocol_error(error.status if isinstance(error, ChunkError) else 400)
                return False
            if not sink.pieces and not sink.complete:
                if self._eof:  # the client ended before its body did
                    await self._protocol_error(400)
                return False
        self._waiting_for_continue = False  # the client sent its body
        if sink.pieces:
            await stream.handle(Body(stream_id=STREAM_ID, data=sink.pieces.pop(0)))
        else:
            self._their = DONE
            await stream.handle(EndBody(stream_id=STREAM_ID))
        return True

    async def _read_head(self) -> bool:
        """Read the request head at the start of the buffer, if it is all there, and
        start its stream; False when there is nothing more to do now (no whole head
        yet, or the request was refused and the connection closes)."""
        buffer = self._buffer
        if not buffer:
            return False
        fault, end = measure_head(buffer, self.config.h11_max_incomplete_size)
        if fault is not None:
            await self._refuse_request(fault)
            return False
        if buffer[0] < 0x21:
            # What h11 refuses before the head ends: not a request line (a TLS client
            # on the plain port, a stray CRLF).
            await self._protocol_error(400)
            return False
        if end < 0:
            if self._eof:  # the client ended before its head did
                await self._protocol_error(400)
            return False
        head = bytes(buffer[:end])
        del buffer[:end]
        read, fresh = self._parse_head(head)
        if isinstance(read, int):
            await self._protocol_error(read)
            return False
        method, target, version, fields = read.method, read.target, read.http_version, read.headers
        lowered = [(name.lower(), value) for name, value in fields]
        status = request_head_status(version, lowered)
        if status is not None:
            await self._protocol_error(status)
            return False
        fault = request_fault(version, lowered)
        if fault is not None:
            await self._refuse_request(fault)
            return False
        self._start_body(lowered, fresh)
        self._their, self._our = BODY, WAITING
        self._method, self._version = method, version
        self._keep_alive = keep_alive(version, lowered)
        self._waiting_for_continue = wants_continue(version, lowered)
        await self.send(Updated(idle=False))
        await self._create_stream(method, target, version, fields)
        return True

    def _parse_head(self, head: bytes) -> tuple[RequestHead | int, bool]:
        """The request *head* as llhttp reads it, or as h11 does if llhttp refuses it
        (:func:`~frontend.http.serving.http11_codec.h11_request_head`: the request, or
        h11's status); and whether its body needs a fresh parser."""
        sink, parser = self._sink, self._parser
        sink.clear()
        try:
            parser.feed_data(head)
        except HttpParserUpgrade:
            pass  # llhttp stops at an Upgrade (or CONNECT): served as HTTP/1.1
        except HttpParserError:
            return h11_request_head(head), True
        else:
            if sink.head_done:
                version = parser.get_http_version().encode()
                return RequestHead(parser.get_method(), sink.target, version, sink.headers), False
        if not sink.head_done:
            return h11_request_head(head), True
        version = parser.get_http_version().encode()
        return RequestHead(parser.get_method(), sink.target, version, sink.headers), True

    def _start_body(self, headers: list[tuple[bytes, bytes]], fresh: bool) -> None:
        """Set the framing of the body that follows a head with *headers* (lowercased
        names). A parser that refused the head (h11 read it), or ended an upgrade
        request at its head, its body skipped, is replaced: a *fresh* one, past a
        stand-in head of the same framing, reads that body instead."""
        self._chunks = None
        self._body_left = 0
        stand_in = b""
        if any(name == b"transfer-encoding" for name, _ in headers):
            self._chunks = ChunkedExtent(self.config.h11_max_incomplete_size)
            stand_in = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        elif lengths := [value for name, value in headers if name == b"content-length"]:
            self._body_left = int(lengths[0])
            stand_in = b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % self._body_left
        if fresh:
            self._parser = self._new_parser()
            self._sink.complete = not stand_in
            if stand_in:
                self._sink.headers = []  # the request's own are kept by the caller
                self._parser.feed_data(stand_in)
                self._sink.complete = self._body_left == 0 and self._chunks is None

    def _read_body(self) -> None:
        """Give the parser the body bytes it may have, and no more: its pieces and end
        land in the sink. Raises HttpParserError or ChunkError for a malformed body."""
        buffer = self._buffer
        if not buffer:
            return
        if self._chunks is not None:
            size, done = self._chunks.measure(buffer)
        else:
            size = min(self._body_left, len(buffer))
            self._body_left -= size
            done = self._body_left == 0
        if size:
            with memoryview(buffer) as view, view[:size] as part:
                self._parser.feed_data(part)
            del buffer[:size]
        if done != self._sink.complete:
            raise HttpParserError("the body's end is not where its framing says")

    async def _create_stream(
        self, method: bytes, target: bytes, version: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """hypercorn's ``H11Protocol._create_stream`` for an HTTP request (never a
        websocket: no Upgrade field reaches the app, as with the h11 protocol)."""
        self.stream = HTTPStream(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.ssl,
            self.client,
            self.server,
            self.stream_send,
            STREAM_ID,
        )
        raw = self.config.h11_pass_raw_headers
        fields = [
            (name if raw else lowered, value.lower() if lowered == b"transfer-encoding" else value)
            for name, value in headers
            if (lowered := name.lower()) != b"upgrade"
        ]
        await self.stream.handle(
            Request(
                stream_id=STREAM_ID,
                headers=fields,
                http_version=version.decode(),
                method=method.decode("ascii").upper(),
                raw_path=target,
                state=self.connection_state,
            )
        )
        self.keep_alive_requests += 1
        await self.context.mark_request()

    async def _protocol_error(self, status_code: int) -> None:
        """A request that cannot be read: answered *status_code* if no response has
        started (as hypercorn answers h11's RemoteProtocolError), then closed."""
        self._their = ERROR
        if self._our is IDLE or self._our is WAITING:
            await self._send_error_response(status_code)
        await self.send(Closed())

    async def _refuse_request(self, fault: Fault) -> None:
        """Answer *fault* (:func:`~frontend.http.serving.policy.refusal`) and close."""
        self._their = ERROR
        await self.send(RawData(data=refusal(fault, self.config)))
        await self.send(Closed())

    # -- writing ----------------------------------------------------------------------

    async def _continue_if_waiting(self) -> None:
        """The app asks for the request's body: invite it, if the client waits to be."""
        if self._waiting_for_continue:
            await self._send_informational(100, self.config.response_headers("h11"))

    async def _send_informational(
        self, status_code: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        if self._our is not WAITING:
            self._misuse("an informational response outside a request")
            return
        self._waiting_for_continue = False
        await self.send(RawData(data=informational_head(status_code, headers)))

    async def _send_response(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a response: its head is written now, or held for the body's first bytes
        (or its end) when its length is known, so that both leave in one write."""
        if self._our is not IDLE and self._our is not WAITING:
            self._misuse("a second response")
            return
        if self._their is BODY:
            # Answered before its body ended (a 401 reads none): the connection closes
            # after this response (lingering, HeadwaterTCPServer._close), and says so.
            headers = [*headers, (b"connection", b"close")]
        try:
            head = response_head(
                status_code,
                headers,
                method=self._method,
                http_version=self._version,
                keep_alive=self._keep_alive,
            )
        except ResponseHeadError:
            self._our = ERROR
            if self._their is ERROR:
                return
            raise
        self._waiting_for_continue = False
        self._our = BODY
        self._framing, self._length_left = head.framing, head.length
        self._keep_alive = head.keep_alive
        if any(name.lower() == b"content-length" for name, _ in headers):
            # The next event is this response's body (or its end): see the h11 protocol.
            self._held_head = head.data
            return
        await self.send(RawData(data=head.data))

    async def _send_body(self, data: bytes) -> None:
        if self._our is not BODY:
            self._misuse("a body outside a response")
            return
        framing = self._framing
        if framing == "length":
            if len(data) > self._length_left:
                self._our = ERROR
                raise ResponseHeadError("Too much data for declared Content-Length")
            self._length_left -= len(data)
        elif framing == "chunked" and data:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        await self._write(data)

    async def _end_body(self) -> None:
        if self._our is not BODY:
            self._misuse("the end of a body outside a response")
            return
        if self._framing == "length" and self._length_left:
            self._our = ERROR
            raise ResponseHeadError("Too little data for declared Content-Length")
        self._our = DONE
        await self._write(b"0\r\n\r\n" if self._framing == "chunked" else b"")

    async def _write(self, data: bytes) -> None:
        """Write *data*, after the held head if there is one."""
        held = self._held_head
        if held is not None:
            self._held_head = None
            data = held + data
        if data:
            await self.send(RawData(data=data))

    def _misuse(self, what: str) -> None:
        """An event the response's state does not allow: dropped once the client's
        side has failed (h11 would raise, and hypercorn drop it), raised otherwise."""
        if self._their is not ERROR:
            self._our = ERROR
            raise ResponseHeadError(f"cannot send {what} now")

    async def _send_error_response(self, status_code: int) -> None:
        """An answer of the server's own (hypercorn's ``_send_error_response``), with a
        JSON error body for the limits' 431 and 408 (431 also reported to
        ``config.refused``); each reported to ``config.answered``."""
        if status_code == 431:
            self.config.refused(HEADER_TOO_LARGE)
        self.config.answered(status_code)
        error = limit_error(status_code, self.config)
        body = b"" if error is None else error_body(*error)
        head = (
            [(b"content-length", b"0"), (b"connection", b"close")]
            if error is None
            else json_error_head(body)
        )
        await self._send_response(status_code, [*head, *self.config.response_headers("h11")])
        if body:
            await self._send_body(body)
        await self._end_body()

    # -- the connection's cycle ---------------------------------------------------------

    async def _maybe_recycle(self) -> None:
        """hypercorn's ``H11Protocol._maybe_recycle``: after a response, the connection
        waits for the next request, or closes."""
        await self._close_stream()
        if (
            not self.context.terminated.is_set()
            and self._our is DONE
            and self._their is DONE
            and self._keep_alive
        ):
            self._their = self._our = IDLE
            self._method = self._version = None
            self._waiting_for_continue = False
            await self.can_read.set()
            await self.send(Updated(idle=True))
        else:
            await self.can_read.set()
            await self.send(Closed())

    async def _close_stream(self) -> None:
        if self.stream is not None:
            await self.stream.handle(StreamClosed(stream_id=STREAM_ID))
            self.stream = None

    def _new_parser(self) -> HttpRequestParser:
        """A parser reporting to the sink. Content-Length with Transfer-Encoding is let
        through llhttp so that :func:`~frontend.http.serving.limits.request_fault`
        refuses it, with the h11 protocol's answer."""
        parser = HttpRequestParser(self._sink)
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        return parser
