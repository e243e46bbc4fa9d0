"""llhttp (``httptools``) fed one request at a time, without I/O, for
:class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol`.

llhttp parses all it is given, and says nowhere where a message ended; so
:class:`RequestReader` is given exactly a request's own bytes: its head up to the blank
line (the protocol finds it, as h11 does), then as many body bytes as Content-Length
says, or as :class:`~frontend.http.serving.http11_codec.ChunkedExtent` measures for a
chunked body. A head that llhttp refuses is read again by h11
(:func:`~frontend.http.serving.http11_codec.h11_request_head`), the reference.
"""

from __future__ import annotations

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser

from frontend.http.serving.http11_codec import (
    LLHTTP_MAX_SIZE,
    ChunkedExtent,
    RequestHead,
    h11_request_head,
)


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


class RequestReader:
    """A connection's requests as llhttp reads them, a head (:meth:`head`) then its
    body (:meth:`start_body`, then :meth:`feed_body` until :attr:`complete`), the
    body's pieces in :attr:`pieces`. *limit* bounds a chunked body's size and trailer
    lines, as the head limit bounds a head."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._sink = _Sink()
        self._parser = self._new_parser()
        # The body: bytes still to come (Content-Length), or a chunked body's extent.
        self._body_left = 0
        self._chunks: ChunkedExtent | None = None

    @property
    def pieces(self) -> list[bytes]:
        """The body's pieces read and not yet taken (the caller pops them)."""
        return self._sink.pieces

    @property
    def complete(self) -> bool:
        """The body has ended."""
        return self._sink.complete

    def head(self, head: bytes) -> tuple[RequestHead | int, bool]:
        """The request *head* as llhttp reads it, or as h11 does if llhttp refuses it
        (:func:`~frontend.http.serving.http11_codec.h11_request_head`: the request, or
        h11's status); and whether its body needs a fresh parser."""
        sink, parser = self._sink, self._parser
        sink.clear()
        if head.count(b" ", 0, head.find(b"\n")) != 2:
            # h11's request line has two spaces, llhttp's one or more between its parts
            return h11_request_head(head), True
        try:
            parser.feed_data(head)
        except HttpParserUpgrade:
            pass  # llhttp stops at an Upgrade (or CONNECT): served as HTTP/1.1
        except HttpParserError:
            return h11_request_head(head), True
        else:
            if sink.head_done and parser.get_http_version() != "0.9":
                version = parser.get_http_version().encode()
                return RequestHead(parser.get_method(), sink.target, version, sink.headers), False
        if not sink.head_done or parser.get_http_version() == "0.9":
            # llhttp serves a request line without a version as HTTP/0.9; h11 refuses it
            return h11_request_head(head), True
        version = parser.get_http_version().encode()
        return RequestHead(parser.get_method(), sink.target, version, sink.headers), True

    def start_body(self, headers: list[tuple[bytes, bytes]], fresh: bool) -> None:
        """Set the framing of the body that follows a head with *headers* (lowercased
        names). A parser that refused the head (h11 read it), or ended an upgrade
        request at its head, its body skipped, is replaced: a *fresh* one, past a
        stand-in head of the same framing, reads that body instead."""
        self._chunks = None
        self._body_left = 0
        stand_in = b""
        if any(name == b"transfer-encoding" for name, _ in headers):
            self._chunks = ChunkedExtent(self._limit)
            stand_in = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        elif lengths := [value for name, value in headers if name == b"content-length"]:
            self._body_left = int(lengths[0])
            # llhttp counts to 2**64 - 1 at most; a longer body cannot be sent anyway.
            length = min(self._body_left, LLHTTP_MAX_SIZE)
            stand_in = b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % length
        if fresh:
            self._parser = self._new_parser()
            self._sink.complete = not stand_in
            if stand_in:
                self._sink.headers = []  # the request's own are kept by the caller
                self._parser.feed_data(stand_in)
                self._sink.complete = self._body_left == 0 and self._chunks is None

    def feed_body(self, buffer: bytearray) -> None:
        """Give the parser the body bytes it may have, and no more: its pieces and end
        land in the sink. Raises HttpParserError or ChunkError for a malformed body."""
        if not buffer:
            return
        if self._chunks is not None:
            plain = bytearray()
            size, done = self._chunks.measure(buffer, plain)
            if plain:
                self._parser.feed_data(plain)
            del buffer[:size]
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

    def _new_parser(self) -> HttpRequestParser:
        """A parser reporting to the sink. Content-Length with Transfer-Encoding is let
        through llhttp so that :func:`~frontend.http.serving.limits.request_fault`
        refuses it, with the h11 protocol's answer."""
        parser = HttpRequestParser(self._sink)
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        return parser
