"""HTTP/1.1 without I/O, for :class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol`:
the rules h11 applies around the parsing that llhttp does, written again so that a
connection behaves the same whichever parser reads it.

- What h11 refuses in a request head that llhttp lets through
  (:func:`request_head_status`), what it makes of one that llhttp refuses
  (:func:`h11_request_head`), when a request waits for ``100 Continue``
  (:func:`wants_continue`), and when its connection may carry another
  (:func:`keep_alive`);
- a response's head as h11 writes it (:func:`response_head`): the framing chosen from
  the request and the fields, ``Transfer-Encoding: chunked`` for a body of unknown
  length (no framing and a close for an HTTP/1.0 client), ``Connection: close`` when the
  connection will not be reused, and the fields checked, since hypercorn does not;
- where a chunked request body ends in the bytes received (:class:`ChunkedExtent`):
  llhttp parses whatever it is given, a pipelined request behind the body included,
  and says nowhere where one ended; each is given exactly its own bytes instead.

Each function names the h11 function it follows; ``tests/test_http_parsers.py`` checks
that the two protocols answer alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import h11

#: A field's name and value as h11 accepts them (h11._abnf: token, field_value).
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
_CONTENT_LENGTH = re.compile(rb"[0-9]{1,20}")
#: A chunk's size line as h11 reads it (h11._abnf.chunk_header).
_CHUNK_HEADER = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")

Framing = Literal["length", "chunked", "close"]
#: The largest Content-Length or chunk size llhttp counts to (h11: any, and 20 hex digits).
LLHTTP_MAX_SIZE = 2**64 - 1


class ResponseHeadError(ValueError):
    """The app's response head cannot be sent as it is (h11's LocalProtocolError)."""


class ChunkError(ValueError):
    """A chunked request body is malformed (*status* 400), or one of its lines is longer
    than the head limit (431, as h11 answers an event it cannot complete)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def comma_tokens(value: bytes) -> list[bytes]:
    """A comma-separated field value's tokens, lowercased (h11's ``get_comma_header``)."""
    return [token for piece in value.lower().split(b",") if (token := piece.strip())]


def _tokens(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [token for n, value in headers if n == name for token in comma_tokens(value)]


def wants_continue(http_version: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request (lowercased field names) waits for ``100 Continue`` (h11's
    ``has_expect_100_continue``): HTTP/1.1, and an ``Expect`` naming ``100-continue``."""
    return http_version >= b"1.1" and b"100-continue" in _tokens(headers, b"expect")


def proposes_switch(method: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request (lowercased field names) proposes a protocol switch (h11's
    ``_process_event``): CONNECT, or an ``Upgrade`` field. h11 then reads nothing after
    it until it has been answered (the answer refuses the switch)."""
    return method == b"CONNECT" or bool(_tokens(headers, b"upgrade"))


def keep_alive(http_version: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a message (lowercased field names) lets its connection carry another
    (h11's ``_keep_alive``): HTTP/1.1 and no ``Connection: close``. An HTTP/1.0 client's
    ``Connection: keep-alive`` is not honoured, as h11 does not."""
    return http_version >= b"1.1" and b"close" not in _tokens(headers, b"connection")


def request_head_status(http_version: bytes, headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The status h11 answers a parsed request head (lowercased field names) with, that
    llhttp lets through; None if h11 takes it (its ``Request`` and
    ``normalize_and_validate``):

    - 501 for a ``Transfer-Encoding`` other than ``chunked`` alone, or given twice;
    - 400 for an HTTP/1.1 request without a ``Host`` field, or any with two.
    """
    coded = False
    hosts = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            if coded or value.lower() != b"chunked":
                return 501
            coded = True
        elif name == b"host":
            hosts += 1
    if hosts > 1 or (hosts == 0 and http_version == b"1.1"):
        return 400
    return None


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A request head as h11 reads it: fields as sent (names in their case)."""

    method: bytes
    target: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]


def h11_request_head(head: bytes) -> RequestHead | int:
    """h11's reading of a whole request *head* that llhttp refused: the request, or
    the status h11 refuses it with. llhttp is stricter than h11 in places (a bare LF
    line end, a method or version it does not know, a control character in a value, a
    repeated Content-Length), and h11 is the reference: what it takes is served, what
    it refuses gets its answer."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=len(head) + 1)
    connection.receive_data(head)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError as error:
        return error.error_status_hint
    if not isinstance(event, h11.Request):  # cannot be: the head is whole
        return 400
    return RequestHead(
        event.method, event.target, event.http_version, list(event.headers.raw_items())
    )


def h11_trailer_status(trailer: bytes) -> int | None:
    """The status h11 refuses a chunked body's *trailer* section with (its lines, and
    the empty line that ends them), or None if it takes it. llhttp refuses some that h11
    takes (an obs-fold, a control character), and is not asked: the request's trailer
    fields are dropped anyway."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=len(trailer) + 100)
    connection.receive_data(_TRAILER_STAND_IN + trailer)
    try:
        connection.next_event()  # the stand-in's Request
        connection.next_event()  # its EndOfMessage, with the trailer fields
    except h11.RemoteProtocolError as error:
        return error.error_status_hint
    return None


_TRAILER_STAND_IN = b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A response's head as it goes on the wire, how its body is framed (and its length,
    for ``"length"``), and whether the connection may carry another request after it."""

    data: bytes
    framing: Framing
    length: int
    keep_alive: bool


def informational_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A 1xx response's head, its fields checked (h11's ``write_any_response``)."""
    return _head_bytes(status, _checked(headers))


def response_head(
    status: int,
    headers: list[tuple[bytes, bytes]],
    *,
    method: bytes | None,
    http_version: bytes | None,
    keep_alive: bool,
) -> ResponseHead:
    """The head of a response with *headers* to a request of *method* and
    *http_version* (None for both: no request was read), on a connection that may be
    reused (*keep_alive*) until this response says otherwise.

    h11's ``_clean_up_response_headers_for_sending`` and ``_body_framing``: a body of
    unknown length is chunked for an HTTP/1.1 client, and for an older one sent bare
    and ended by closing the connection (but for HEAD); ``Connection: close`` replaces
    the connection's tokens whenever it will close. Raises :class:`ResponseHeadError`
    for a field h11 would not send (a line break in a value, conflicting lengths, a
    transfer coding other than chunked)."""
    items = _checked(headers)
    names = {name.lower() for name, _ in items}
    chooser = b"GET" if method == b"HEAD" else method
    need_close = False
    if not _empty_body(status, chooser) and (
        b"transfer-encoding" in names or b"content-length" not in names
    ):
        items = _without(items, b"content-length")
        if http_version is None or http_version < b"1.1":
            items = _without(items, b"transfer-encoding")
            need_close = method != b"HEAD"
        else:
            items = [*_without(items, b"transfer-encoding"), (b"Transfer-Encoding", b"chunked")]
    if not keep_alive or need_close:
        tokens = set(_tokens(_lowered(items), b"connection"))
        tokens.discard(b"keep-alive")
        tokens.add(b"close")
        items = [*_without(items, b"connection"), *((b"Connection", t) for t in sorted(tokens))]
    lowered = _lowered(items)
    framing: Framing
    length = 0
    if _empty_body(status, method):
        framing = "length"
    elif b"transfer-encoding" in {name for name, _ in lowered}:
        framing = "chunked"
    elif lengths := [value for name, value in lowered if name == b"content-length"]:
        framing, length = "length", int(lengths[0])
    else:
        framing = "close"
    reused = keep_alive and b"close" not in _tokens(lowered, b"connection")
    return ResponseHead(_head_bytes(status, items), framing, length, reused)


def _empty_body(status: int, method: bytes | None) -> bool:
    """A response that has no body whatever its fields say (RFC 9112 section 6.3)."""
    return (
        status in (204, 304) or method == b"HEAD" or (method == b"CONNECT" and 200 <= status < 300)
    )


def _checked(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """*headers* as h11's ``normalize_and_validate`` leaves them: each field checked,
    a Content-Length list of one value made that value, a transfer coding lowercased."""
    out: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    coded = False
    for name, value in headers:
        if _FIELD_NAME.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
            raise ResponseHeadError(f"illegal header field {name!r}: {value!r}")
        lowered = name.lower()
        if lowered == b"content-length":
            values = {piece.strip() for piece in value.split(b",")}
            if len(values) != 1 or _CONTENT_LENGTH.fullmatch(value := values.pop()) is None:
                raise ResponseHeadError(f"bad Content-Length {value!r}")
            if length is not None:
                if value != length:
                    raise ResponseHeadError("conflicting Content-Length headers")
                continue
            length = value
        elif lowered == b"transfer-encoding":
            value = value.lower()
            if coded or value != b"chunked":
                raise ResponseHeadError("only Transfer-Encoding: chunked is supported")
            coded = True
        out.append((name, value))
    return out


def _lowered(items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in items]


def _without(items: list[tuple[bytes, bytes]], name: bytes) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in items if n.lower() != name]


def _head_bytes(status: int, items: list[tuple[bytes, bytes]]) -> bytes:
    """h11's ``write_any_response``: no reason phrase, a ``Host`` field first."""
    lines = [b"HTTP/1.1 %d \r\n" % status]
    lines += [b"%s: %s\r\n" % item for item in items if item[0].lower() == b"host"]
    lines += [b"%s: %s\r\n" % item for item in items if item[0].lower() != b"host"]
    lines.append(b"\r\n")
    return b"".join(lines)


class ChunkedExtent:
    """Where a chunked request body ends, in the bytes received after its head.

    Reads only the framing, as h11's ``ChunkedReader`` does (a size line, that many
    bytes and a CRLF, again until a size of zero, then trailer lines until an empty
    one), so that the parser can be given the body's bytes and no more. llhttp checks
    and decodes them; this only measures.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._data = 0  # bytes of chunk data (with its CRLF) still to come
        self._trailers = False  # past the last chunk: trailer lines until an empty one
        self._trailer = bytearray()  # the trailer lines read (h11 holds them all unparsed)

    def measure(
        self, buffer: bytes | bytearray, plain: bytearray | None = None
    ) -> tuple[int, bool]:
        """How many of *buffer*'s first bytes belong to the body, and whether the body
        ends with them; the count is consumed (the next call starts after them). Those
        bytes are added to *plain*, if given, with each size line as llhttp takes it:
        the size alone, in hex, at most :data:`LLHTTP_MAX_SIZE` (h11 takes an
        extension, and blanks after it, that llhttp refuses) and no trailer lines
        (h11 checks them, :func:`h11_trailer_status`). Raises
        :class:`ChunkError` for a malformed size line, or a line that has not ended
        within the limit."""
        pos, size = 0, len(buffer)
        while pos < size:
            if self._data:
                taken = min(self._data, size - pos)
                if plain is not None:
                    plain += buffer[pos : pos + taken]
                pos += taken
                self._data -= taken
                continue
            end = buffer.find(b"\n", pos)
            if end < 0:
                if size - pos + len(self._trailer) > self._limit:
                    raise ChunkError(431, "a chunk size or trailer line is too long")
                return pos, False
            line = bytes(buffer[pos : end + 1])
            pos = end + 1
            if self._trailers:
                if line in (b"\r\n", b"\n"):
                    if self._trailer:
                        status = h11_trailer_status(bytes(self._trailer) + line)
                        if status is not None:
                            raise ChunkError(status, "a trailer field h11 refuses")
                    if plain is not None:  # no trailer lines: h11 checked them
                        plain += b"\r\n"
                    return pos, True
                self._trailer += line
                continue
            match = _CHUNK_HEADER.fullmatch(line)
            if match is None:
                raise ChunkError(400, f"bad chunk size line {line!r}")
            chunk = int(match[1], 16)
            if plain is not None:  # llhttp counts to 2**64 - 1; no client sends more
                plain += b"%x\r\n" % min(chunk, LLHTTP_MAX_SIZE)
            if chunk:
                self._data = chunk + 2
            else:
                self._trailers = True
        if len(self._trailer) > self._limit:  # whole lines, but no end to them yet
            raise ChunkError(431, "the trailer section is too long")
        return pos, False
