"""The transport limits' parts without I/O: refusal reasons, connections per client, and
what is wrong with a request head before h11 reads it (:func:`head_fault`) or after
(:func:`request_fault`).

Each limit is a field of :class:`~frontend.http.serving.ServerConfig`; what enforces it:

==============================  ==========================  ================================
limit                           field                       enforced by
==============================  ==========================  ================================
request head size               ``h11_max_incomplete_size``  :func:`head_fault` (431), every head
request head time               ``header_timeout``          ``HeadwaterTCPServer._read_data``
TLS handshake time              ``header_timeout``          ``serve``'s connection handler
request body stall              ``body_read_timeout``       ``HeadwaterTCPServer._read_data``
client that stops reading       ``write_timeout``           ``HeadwaterTCPServer.protocol_send``
connections per client address  ``max_connections_per_client``  :class:`ClientConnections`
framing (RFC 9112)              always                      ``*_fault`` (400)
HTTP/1.1 only                   always                      :func:`request_fault` (505)
==============================  ==========================  ================================

Both fault checks run where each protocol reads a request head
(``HeadWithBodyH11Protocol._handle_events``, ``HttptoolsProtocol._read_head``): every
head passes there, the first of a read and one pipelined behind a request alike.

Every refusal is reported to ``ServerConfig.on_refusal`` with one of
:data:`REFUSAL_REASONS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

HEADER_TOO_LARGE = "header_too_large"
HEADER_TIMEOUT = "header_timeout"
TLS_HANDSHAKE_TIMEOUT = "tls_handshake_timeout"
READ_TIMEOUT = "read_timeout"
WRITE_TIMEOUT = "write_timeout"
TOO_MANY_CONNECTIONS = "too_many_connections"
INVALID_FRAMING = "invalid_framing"
UNSUPPORTED_PROTOCOL = "unsupported_protocol"
#: Every reason the server reports to ``on_refusal``.
REFUSAL_REASONS = (
    HEADER_TOO_LARGE,
    HEADER_TIMEOUT,
    TLS_HANDSHAKE_TIMEOUT,
    READ_TIMEOUT,
    WRITE_TIMEOUT,
    TOO_MANY_CONNECTIONS,
    INVALID_FRAMING,
    UNSUPPORTED_PROTOCOL,
)

# Where h11 ends a request head (h11._receivebuffer's blank_line_regex).
_BLANK_LINE = re.compile(b"\n\r?\n")


# A header line that starts with a space or a tab continues the one before (obs-fold).
_OBS_FOLD = re.compile(b"\n[ \t]")


@dataclass(frozen=True, slots=True)
class Fault:
    """Why a request is refused before the app sees it: the status, the refusal reason
    reported to ``on_refusal`` (and the error body's ``code``), and the message."""

    status: int
    reason: str
    message: str


def head_fault(buffered: bytes | bytearray, limit: int) -> Fault | None:
    """:func:`measure_head`'s fault alone."""
    return measure_head(buffered, limit)[0]


def measure_head(buffered: bytes | bytearray, limit: int) -> tuple[Fault | None, int]:
    """What is wrong with the request head at the start of *buffered* (the bytes the
    parser holds unparsed while it waits for a head: at least the first ``limit + 1``),
    or None while nothing is, or the head is incomplete and may yet end in time; and
    where the head ends (the offset past its blank line), or -1 if it has not.

    - Longer than *limit* bytes, whole or not: 431. h11 alone refuses only a head still
      incomplete over its limit, so a head that arrived whole (in one read, or pipelined
      behind a request) would pass however long.
    - A line folded onto the one before (obs-fold): 400. RFC 9112 section 5.2 lets a
      server refuse it, and h11 would unfold it where a proxy in front may not.
    """
    end = _BLANK_LINE.search(buffered, 0, limit + 1)
    if end is None or end.end() > limit:
        if end is None and len(buffered) <= limit:
            return None, -1  # incomplete, and may yet end within the limit
        return Fault(
            431,
            HEADER_TOO_LARGE,
            (
                "The request's head (request line and header fields) is larger than this "
                f"server's limit of {limit} bytes."
            ),
        ), -1
    if _OBS_FOLD.search(buffered, 0, end.start()) is not None:
        return Fault(
            400,
            INVALID_FRAMING,
            (
                "A header field is folded over lines (obs-fold, RFC 9112 section 5.2): send "
                "each field on one line."
            ),
        ), -1
    return None, end.end()


def request_fault(http_version: bytes, headers: Iterable[tuple[bytes, bytes]]) -> Fault | None:
    """What is wrong with a parsed request head (its version and lowercased header
    fields), or None.

    - Both Content-Length and Transfer-Encoding: 400. The two frame the body two ways;
      h11 reads it as chunked and would keep the connection, while a proxy in front may
      have read it by its length: the ground of request smuggling (RFC 9112 section 6.1
      lets a server refuse it, and says to close the connection).
    - HTTP/2 (the prior-knowledge preface, ``PRI * HTTP/2.0``): 505. This server speaks
      HTTP/1.1 only: its deadlines and limits are HTTP/1.1's (docs/security.md).
    """
    if http_version == b"2.0":
        return Fault(
            505,
            UNSUPPORTED_PROTOCOL,
            (
                "HTTP/2 is not served on this port: use HTTP/1.1 (or a proxy that speaks "
                "HTTP/2 to clients and HTTP/1.1 to this server)."
            ),
        )
    names = {name for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return Fault(
            400,
            INVALID_FRAMING,
            (
                "The request has both Content-Length and Transfer-Encoding: send one (RFC 9112 "
                "section 6.1)."
            ),
        )
    return None


@dataclass(frozen=True, slots=True)
class ClientConnectionStats:
    #: The limit per client address (0: none).
    limit: int
    #: Client addresses with a connection open now.
    clients: int
    #: Connections open now, counted under their address.
    connections: int
    #: Connections closed at once because their address was at the limit.
    refused_total: int


class ClientConnections:
    """Counts the open connections of each client address; refuses one over *limit*.

    Each :meth:`acquire` that returns True must be matched by one :meth:`release` of the
    same address. Neither yields; both are O(1).
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_connections_per_client must be >= 0, got {limit}")
        self.limit = limit
        self._open: dict[str, int] = {}
        self._connections = 0
        self._refused = 0

    def acquire(self, address: str | None) -> bool:
        """Count a new connection from *address* (an IP address; None, a Unix socket's
        peer, is not limited). False, and nothing counted, if that address already
        holds ``limit`` connections."""
        if address is None or not self.limit:
            return True
        held = self._open.get(address, 0)
        if held >= self.limit:
            self._refused += 1
            return False
        self._open[address] = held + 1
        self._connections += 1
        return True

    def release(self, address: str | None) -> None:
        """The connection of *address* that :meth:`acquire` counted has closed."""
        if address is None or not self.limit:
            return
        held = self._open.pop(address)
        if held > 1:
            self._open[address] = held - 1
        self._connections -= 1

    def statistics(self) -> ClientConnectionStats:
        return ClientConnectionStats(
            limit=self.limit,
            clients=len(self._open),
            connections=self._connections,
            refused_total=self._refused,
        )
