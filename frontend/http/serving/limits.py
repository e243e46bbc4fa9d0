"""The transport limits' parts without I/O: refusal reasons, connections per client, and
where a request head over its limit must be cut for h11 to refuse it.

Each limit is a field of :class:`~frontend.http.serving.ServerConfig`; what enforces it:

==============================  ==========================  ================================
limit                           field                       enforced by
==============================  ==========================  ================================
request head size               ``h11_max_incomplete_size``  h11 (431), with :func:`head_piece`
request head time               ``header_timeout``          ``HeadwaterTCPServer._read_data``
TLS handshake time              ``header_timeout``          ``serve``'s connection handler
request body stall              ``body_read_timeout``       ``HeadwaterTCPServer._read_data``
client that stops reading       ``write_timeout``           ``HeadwaterTCPServer.protocol_send``
connections per client address  ``max_connections_per_client``  :class:`ClientConnections`
==============================  ==========================  ================================

Every refusal is reported to ``ServerConfig.on_refusal`` with one of
:data:`REFUSAL_REASONS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADER_TOO_LARGE = "header_too_large"
HEADER_TIMEOUT = "header_timeout"
TLS_HANDSHAKE_TIMEOUT = "tls_handshake_timeout"
READ_TIMEOUT = "read_timeout"
WRITE_TIMEOUT = "write_timeout"
TOO_MANY_CONNECTIONS = "too_many_connections"
#: Every reason the server reports to ``on_refusal``.
REFUSAL_REASONS = (
    HEADER_TOO_LARGE, HEADER_TIMEOUT, TLS_HANDSHAKE_TIMEOUT, READ_TIMEOUT, WRITE_TIMEOUT,
    TOO_MANY_CONNECTIONS,
)  # fmt: skip

# Where h11 ends a request head (h11._receivebuffer's blank_line_regex).
_BLANK_LINE = re.compile(b"\n\r?\n")


def head_piece(data: bytes | bytearray, head_bytes: int, limit: int) -> bytes | bytearray:
    """What of *data* to give h11 while it waits for a request head of which it holds
    *head_bytes* already: all of it, unless the head cannot end within *limit* bytes.

    h11 refuses a head over ``max_incomplete_event_size`` (431) only while the head is
    incomplete: one that arrives whole in a single read (16 KiB does, on loopback or a
    fast link) would pass, however long. Cut where the limit is exceeded, such a head is
    incomplete and over the limit, and h11 refuses it as it refuses one that trickles in.
    A head that ends in time is never cut.
    """
    room = limit - head_bytes  # bytes the head may still take
    if len(data) <= room or _BLANK_LINE.search(data, 0, max(room, 0)) is not None:
        return data
    return data[: max(room, 0) + 1]


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
            limit=self.limit, clients=len(self._open), connections=self._connections,
            refused_total=self._refused,
        )  # fmt: skip
