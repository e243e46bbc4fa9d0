"""Fix 5: a known-length response's head leaves with its body, in one write.

hypercorn writes a response's head as soon as the app starts the response, and its body
in a second write. :class:`HeadWithBodyH11Protocol` holds the head of a response whose
length is known (its body is in hand: a JSON answer) and writes it with the body, in one
``write(2)``, as hyper and nginx do. A streamed response (no Content-Length) still sends
its head at once, before the first event.
"""

from __future__ import annotations

import h11
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import H11SendableEvent


class HeadWithBodyH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, holding a known-length head for its body.

    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` puts one in place of
    the H11Protocol hypercorn made for a connection, before the connection's first
    byte is read; built with the same arguments, it adds only :attr:`_held_head`.
    """

    #: The head of a known-length response, until the body's first bytes (or its end).
    _held_head: bytes | None = None

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        """hypercorn's ``H11Protocol._send_h11_event``, holding a known-length head back
        until the body's first bytes (or its end) go out with it."""
        held = self._held_head
        data: bytes | None
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
            await self.send(RawData(data=data))


def _has_length(response: h11.Response) -> bool:
    return any(name == b"content-length" for name, _ in response.headers)
