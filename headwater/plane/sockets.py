"""Socket options of request-plane connections.

trio's :class:`trio.SocketStream` sets ``TCP_NOTSENT_LOWAT`` to 16 KiB on every TCP
socket it wraps: the socket reports writable only while less than 16 KiB is queued
unsent, so a sender that writes a lot never fills the kernel's buffer with bytes it
could still have changed its mind about (trio's reasoning: HTTP/2 prioritisation,
interactive streams). A plane connection has no such second thoughts: a frame once
queued is sent whole, and its large frames (a 40k-token request is ~160 KB, a prompt's
simulated KV ~640 KB in ``kv_data`` pieces) then went out 16 KiB per wake-up of the
writer, each a trip through the event loop and a ``send()``. Lifting the watermark
lets one ``send()`` hand the kernel as much as its send buffer takes.
"""

from __future__ import annotations

import contextlib
import socket

import trio

#: No watermark: the kernel's default (``net.ipv4.tcp_notsent_lowat``, UINT_MAX), as -1.
_UNLIMITED = -1


def unthrottle(stream: trio.abc.Stream) -> None:
    """Lift trio's ``TCP_NOTSENT_LOWAT`` on *stream*'s socket (a :class:`trio.SocketStream`
    or a :class:`trio.SSLStream` over one); any other stream is left as it is."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream) and hasattr(socket, "TCP_NOTSENT_LOWAT"):
        # OSError: not TCP after all (a Unix socket in a test): nothing to lift.
        with contextlib.suppress(OSError):
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _UNLIMITED)
