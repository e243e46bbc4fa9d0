"""HTTP/1.1 read by llhttp (``httptools``), compiled, behind hypercorn's protocol seam.

:class:`HttptoolsProtocol` stands where hypercorn's ``H11Protocol`` stands, with its
interface (``initiate``, ``handle``, ``stream_send``, the stream events of
:mod:`hypercorn.protocol.events`), when ``ServerConfig.http_parser`` is
``"httptools"``. It is the I/O shell around two parts without I/O: a
:class:`~frontend.http.serving.llhttp_reader.RequestReader` reads the requests (llhttp,
a request's own bytes at a time), and a
:class:`~frontend.http.serving.http11_writer.ResponseWriter` writes the responses (h11's
rules: framing, keep-alive, a known-length head held for its body). The protocol carries
the policy of :class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`,
from the same code (:mod:`~frontend.http.serving.policy`,
:mod:`~frontend.http.serving.limits`): head size (431), the HTTP/2 preface (505),
obs-fold and Content-Length with Transfer-Encoding (400), no protocol switch,
``100 Continue`` on the app's first ``receive``, ``Connection: close`` after a response
that starts before its request's body ended, JSON error bodies, and the refusal and
answer hooks. A pipelined request waits, unparsed, until the one before it has been
answered, as with h11.

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

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from httptools import HttpParserError
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

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.http11_codec import (
    ChunkError,
    ResponseHeadError,
    proposes_switch,
    request_head_status,
)
from frontend.http.serving.http11_writer import BODY, DONE, ERROR, IDLE, ResponseWriter
from frontend.http.serving.limits import HEADER_TOO_LARGE, Fault, measure_head, request_fault
from frontend.http.serving.llhttp_reader import RequestReader
from frontend.http.serving.policy import (
    ContinueOnReceive,
    error_body,
    json_error_head,
    limit_error,
    refusal,
)
from frontend.http.serving.stream import EndingHTTPStream, LastBody

if TYPE_CHECKING:
    from hypercorn.config import Config
    from hypercorn.events import Event
    from hypercorn.typing import AppWrapper, ConnectionState, TaskGroup, WorkerContext

STREAM_ID = 1  # hypercorn's: an HTTP/1.1 connection has one stream at a time


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
        self.stream: EndingHTTPStream | None = None
        self.task_group = task_group
        self.connection_state = connection_state
        self._buffer = bytearray()  # received, not yet given to the parser
        self._eof = False
        self._reader = RequestReader(config.h11_max_incomplete_size)
        self._their = IDLE  # the client's side; the server's is the writer's
        self._switch_proposed = False  # by the request under way
        self._writer = ResponseWriter()

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
        return self._writer.state is IDLE

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
            if type(event) is LastBody:
                await self._send_last_body(event.data)
            else:
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
            elif their is DONE and self._buffer and self._waits_for_answer():
                # The next request (or, after a switch proposed, bytes h11 reads only
                # then): it waits until this one's answer has ended.
                await self.can_read.clear()
                await self.can_read.wait()
            else:
                if self._buffer and their is DONE:  # bytes after a last request
                    await self._protocol_error(400)
                elif their is ERROR:
                    await self.send(Closed())
                break

    def _waits_for_answer(self) -> bool:
        """Bytes after the request wait for its answer: the next request, or whatever
        follows a protocol switch proposed, which h11 reads only once the answer has
        refused it, by when the connection closes if not kept alive."""
        return self._writer.keep_alive or (self._switch_proposed and self._writer.state is not DONE)

    async def _deliver_body(self) -> bool:
        """Hand the stream the body's next piece, or its end; False when there is
        nothing more to do now (no bytes yet, the stream gone, or a malformed body)."""
        stream, reader = self.stream, self._reader
        if stream is None:
            return False  # answered and closed: the connection is closing
        if not reader.pieces and not reader.complete:
            try:
                reader.feed_body(self._buffer)
            except (HttpParserError, ChunkError) as error:
                await self._protocol_error(error.status if isinstance(error, ChunkError) else 400)
                return False
            if not reader.pieces and not reader.complete:
                if self._eof:  # the client ended before its body did
                    await self._protocol_error(400)
                return False
        self._writer.waiting_for_continue = False  # the client sent its body
        if reader.pieces:
            await stream.handle(Body(stream_id=STREAM_ID, data=reader.pieces.pop(0)))
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
        read, fresh = self._reader.head(head)
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
        self._reader.start_body(lowered, fresh)
        self._their = BODY
        self._writer.request(method, version, lowered)
        self._switch_proposed = proposes_switch(method, lowered)
        await self.send(Updated(idle=False))
        await self._create_stream(method, target, version, fields)
        return True

    async def _create_stream(
        self, method: bytes, target: bytes, version: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """hypercorn's ``H11Protocol._create_stream`` for an HTTP request (never a
        websocket: no Upgrade field reaches the app, as with the h11 protocol), whose
        last body leaves with the body's end (:class:`EndingHTTPStream`)."""
        self.stream = EndingHTTPStream.of(self)
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
        self._fail()
        if self._writer.may_answer:
            await self._send_error_response(status_code)
        await self.send(Closed())

    async def _refuse_request(self, fault: Fault) -> None:
        """Answer *fault* (:func:`~frontend.http.serving.policy.refusal`) and close."""
        self._fail()
        await self.send(RawData(data=refusal(fault, self.config)))
        await self.send(Closed())

    # -- writing ----------------------------------------------------------------------

    def _fail(self) -> None:
        """The client's side has failed: the connection closes."""
        self._their = ERROR
        self._writer.client_failed = True

    # -- writing (the bytes from the ResponseWriter) ----------------------------------

    async def _continue_if_waiting(self) -> None:
        """The app asks for the request's body: invite it, if the client waits to be."""
        if self._writer.waiting_for_continue:
            await self._send_informational(100, self.config.response_headers("h11"))

    async def _send_informational(
        self, status_code: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        await self._write(self._writer.informational(status_code, headers))

    async def _send_response(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a response (its head written now, or held for the body)."""
        if self._their is BODY:
            # Answered before its body ended (a 401 reads none): the connection closes
            # after this response (lingering, HeadwaterTCPServer._close), and says so.
            headers = [*headers, (b"connection", b"close")]
        await self._write(self._writer.response(status_code, headers))

    async def _send_body(self, data: bytes) -> None:
        await self._write(self._writer.body(data))

    async def _end_body(self) -> None:
        await self._write(self._writer.end())

    async def _send_last_body(self, data: bytes) -> None:
        """The body's last piece and its end, in one write."""
        framed = self._writer.body(data)
        try:
            end = self._writer.end()
        except ResponseHeadError:  # too little for its Content-Length: the piece still goes
            await self._write(framed)
            raise
        await self._write(framed + end)

    async def _write(self, data: bytes) -> None:
        if data:
            await self.send(RawData(data=data))

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
        if not self.context.terminated.is_set() and self._their is DONE and self._writer.reusable:
            self._their = IDLE
            self._writer.recycle()
            await self.can_read.set()
            await self.send(Updated(idle=True))
        else:
            await self.can_read.set()
            await self.send(Closed())

    async def _close_stream(self) -> None:
        if self.stream is not None:
            await self.stream.handle(StreamClosed(stream_id=STREAM_ID))
            self.stream = None
