"""Five fixes for hypercorn-trio + quart-trio behaviour, measured in FIELD_NOTES §2
and docs/performance.md.

1. hypercorn finishes a response inside its final body send, where quart-trio cancels
   the request task: :class:`frontend.http.middleware.ShieldFinalSend` shields it.
2. The idle timer itself is a task hypercorn cancels and spawns afresh, behind a
   lock, each time a connection goes idle (and cancels when its next request
   arrives): a task spawn and about five scheduler passes per request.
   :func:`install_idle_deadline` makes it one task per connection whose deadline
   moves, by plain assignment, so it no longer depends on the shield either.
3. hypercorn writes to sockets inside a shielded scope with no deadline, so a client
   that stops reading pins its connection and blocks graceful shutdown forever.
   :func:`install_write_deadline` bounds each write; a client that does not take the
   bytes within ``write_timeout`` is disconnected. On the way it gives writes a fast
   path: one non-blocking ``write(2)`` first, the bounded send only for what is left.
4. hypercorn reads 64 KiB at a time, and each read is a pass through hypercorn, h11
   and Quart's body task: a long prompt's body (40k tokens, ~240 kB) took four or
   five. The read loop that :func:`install_idle_deadline` puts in place grows a
   connection's reads to 256 KiB once one of them fills 64 KiB.
5. hypercorn writes a response's head as soon as the app starts the response, and
   its body in a second write. :func:`install_head_with_body` holds the head of a
   response whose length is known (its body is in hand: a JSON answer) and writes it
   with the body, in one ``write(2)``, as hyper and nginx do. A streamed response
   (no Content-Length) still sends its head at once, before the first event.
"""

from __future__ import annotations

import math
import os
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer

_original_protocol_send = TCPServer.protocol_send
_write_timeout = 30.0


async def _protocol_send_with_deadline(self: TCPServer, event: Any) -> None:
    if not isinstance(event, RawData):
        await _original_protocol_send(self, event)
        return
    data = event.data
    if not data:  # h11's end of a Content-Length body: nothing to write
        return
    lock = self.send_lock
    if lock.locked():
        async with lock:
            await _send_bounded(self, data)
        return
    # The fast path: nobody else is writing, and a write of a response head or an SSE
    # event nearly always fits the socket buffer. One non-blocking write(2) then,
    # without a cancel scope, a deadline or a lock round trip through the scheduler
    # (with them a short stream took ~1.8× the loop CPU: docs/performance.md); the
    # rest, if any, takes the bounded path. The lock is held throughout, so writes
    # never interleave.
    lock.acquire_nowait()
    try:
        sent = _write_now(self.stream, data)
        if sent is None:
            await _drop(self)
        elif sent < len(data):
            await _send_bounded(self, memoryview(data)[sent:])
    finally:
        lock.release()


def _write_now(stream: Any, data: bytes) -> int | None:
    """How many bytes of *data* the kernel takes at once from a plain TCP stream, or
    None if the connection is gone. Other streams (TLS) write nothing here."""
    if type(stream) is not trio.SocketStream:
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError:  # reset, EPIPE (Python ignores SIGPIPE), or closed (fd -1)
        return None


async def _send_bounded(self: TCPServer, data: bytes | memoryview) -> None:
    timed_out = False
    try:
        # Shielded as in hypercorn (a half-written frame corrupts the stream), but
        # with a deadline: a reader that stalls this long is treated as gone.
        with trio.move_on_after(_write_timeout, shield=True) as scope:
            await self.stream.send_all(data)
        timed_out = scope.cancelled_caught
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        timed_out = True
    if timed_out:
        await _drop(self)


async def _drop(self: TCPServer) -> None:
    with trio.move_on_after(1, shield=True):
        await trio.aclose_forcefully(self.stream)
    await self.protocol.handle(Closed())


def install_write_deadline(write_timeout: float) -> None:
    """Bound every socket write hypercorn-trio makes by *write_timeout* seconds."""
    global _write_timeout
    _write_timeout = write_timeout
    TCPServer.protocol_send = _protocol_send_with_deadline  # type: ignore[method-assign]


class IdleDeadline:
    """A connection's keep-alive idle timer: one task, a deadline that moves.

    Stands in for hypercorn's ``TrioSingleTask`` as ``TCPServer.idle_task``, with the
    same two calls: ``restart`` (the connection went idle) sets the deadline to
    ``keep_alive_timeout`` from now, ``stop`` (a request arrived) lifts it. Neither
    yields to the scheduler. When the deadline passes, or the server terminates, the
    connection is closed, as by hypercorn's own ``TCPServer._idle_timeout``. When the
    connection stops reading (the client went away, or the server closed it),
    :meth:`end` ends the task: hypercorn cancelled its timer at ``stop``, but this
    one lives on with no deadline and would hold the connection open.
    """

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._ended = False

    async def restart(self, task_group: Any, action: Any) -> None:
        if self._ended:
            return
        server: TCPServer = action.__self__  # hypercorn passes TCPServer._idle_timeout
        deadline = trio.current_time() + server.config.keep_alive_timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            task_group._nursery.start_soon(self._watch, server, self._scope)
        else:
            self._scope.deadline = deadline

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.deadline = math.inf

    def end(self) -> None:
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self, server: TCPServer, scope: trio.CancelScope) -> None:
        with scope:
            await server.context.terminated.wait()
        if not self._ended:
            with trio.CancelScope(shield=True):
                await server._initiate_server_close()


#: hypercorn's read size (its ``MAX_RECV``): a request head, a short body.
READ_SIZE = 2**16
#: A connection's read size once a read has filled :data:`READ_SIZE`.
READ_SIZE_LARGE = 2**18


async def _read_data(self: TCPServer) -> None:
    """hypercorn's ``TCPServer._read_data`` with reads that grow, ending the idle
    timer (:class:`IdleDeadline`) when the connection stops reading.

    A read that fills 64 KiB means the connection carries large bodies (a 40k-token
    prompt is ~240 kB), so from then on it reads up to 256 KiB at a time: such a body
    takes two reads instead of four or five, each a pass through hypercorn, h11 and
    Quart (docs/performance.md). Connections of short requests keep 64 KiB reads:
    glibc serves a buffer above its mmap threshold (128 KiB until the process has
    freed a larger block) from fresh pages, ~20 us more per read. The size is not
    larger still for the same reason: the threshold only rises to the largest block
    freed, so a 1 MiB buffer would stay above it (~200 us per 240 kB body).
    """
    size = READ_SIZE
    try:
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or math.inf):
                    data = await self.stream.receive_some(size)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            if len(data) >= READ_SIZE:
                size = READ_SIZE_LARGE
            await self.protocol.handle(RawData(data))
            if not data:
                break
        await self.protocol.handle(Closed())
    finally:
        self.idle_task.end()


def install_idle_deadline() -> None:
    """Give every hypercorn-trio connection an :class:`IdleDeadline` idle timer, and
    the read loop that ends it (:func:`_read_data`, which also grows its reads)."""
    tcp_server.TrioSingleTask = IdleDeadline  # type: ignore[attr-defined,misc]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]


async def _send_h11_event_head_with_body(self: H11Protocol, event: Any) -> None:
    """hypercorn's ``H11Protocol._send_h11_event``, holding a known-length head back
    until the body's first bytes (or its end) go out with it."""
    held: bytes | None = getattr(self, "_held_head", None)
    try:
        data = self.connection.send(event)
    except h11.LocalProtocolError:
        if self.connection.their_state != h11.ERROR:
            raise
        data = None
    if held is not None:
        self._held_head = None  # type: ignore[attr-defined]
        data = held + (data or b"")
    elif type(event) is h11.Response and data and _has_length(event):
        # The next event is this response's body (or its end, for an empty or HEAD
        # response): the app sends its start and body back to back. A connection
        # that closes in between (the app failed) never sends this head, and the
        # client sees a closed connection instead of a truncated body.
        self._held_head = data  # type: ignore[attr-defined]
        return
    if data is not None:
        await self.send(RawData(data=data))


def _has_length(response: h11.Response) -> bool:
    return any(name == b"content-length" for name, _ in response.headers)


def install_head_with_body() -> None:
    """Write the head of every known-length response together with its body."""
    H11Protocol._send_h11_event = _send_h11_event_head_with_body  # type: ignore[method-assign]
