"""headwater's connection: hypercorn-trio's ``TCPServer`` with fixes 2–5 as overrides.

:class:`HeadwaterTCPServer` is what :func:`frontend.http.serving.serve` hands to
``trio.serve_listeners``, one per accepted connection; hypercorn's own class, and any
server that uses it, is unchanged. Each override is a copy of the upstream method it
replaces, changed where its docstring says; ``tests/test_hypercorn_seam.py`` holds a
fingerprint of every upstream function these copies and assumptions are taken from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, LifespanState

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.h11_protocol import HeadWithBodyH11Protocol


class HeadwaterTCPServer(TCPServer):
    """One HTTP connection, served as hypercorn serves it, but:

    - its idle timer is an :class:`IdleDeadline` (fix 2);
    - each socket write has a deadline, ``config.write_timeout``, and a non-blocking
      fast path (fix 3, :meth:`protocol_send`);
    - its reads grow from ``config.read_size`` to ``config.read_size_large`` once one
      fills the former, and the idle timer ends with the reads (fix 4, :meth:`_read_data`);
    - its HTTP/1.1 protocol writes a known-length response's head with its body
      (fix 5, :class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`).

    *stream* is a plain ``trio.SocketStream``: :func:`~frontend.http.serving.serve`
    does not do TLS.
    """

    config: ServerConfig
    # hypercorn's annotation is its TrioSingleTask; this server's is the stand-in.
    idle_task: IdleDeadline  # type: ignore[assignment]

    def __init__(
        self,
        app: AppWrapper,
        config: ServerConfig,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SocketStream,
    ) -> None:
        # hypercorn annotates *stream* as an SSLStream but serves plain ones as well.
        super().__init__(app, config, context, state, stream)  # type: ignore[arg-type]
        self.idle_task = IdleDeadline(self)

    async def protocol_send(self, event: Event) -> None:
        """hypercorn's ``protocol_send``, whose writes (:class:`RawData`) have a
        deadline and try one non-blocking ``write(2)`` first. Other events go to it."""
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        data = event.data
        if not data:  # h11's end of a Content-Length body: nothing to write
            return
        lock = self.send_lock
        if lock.locked():
            async with lock:
                await self._send_bounded(data)
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
                await self._drop()
            elif sent < len(data):
                await self._send_bounded(memoryview(data)[sent:])
        finally:
            lock.release()

    async def _send_bounded(self, data: bytes | memoryview) -> None:
        timed_out = False
        try:
            # Shielded as in hypercorn (a half-written frame corrupts the stream), but
            # with a deadline: a reader that stalls this long is treated as gone.
            with trio.move_on_after(self.config.write_timeout, shield=True) as scope:
                await self.stream.send_all(data)
            timed_out = scope.cancelled_caught
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            timed_out = True
        if timed_out:
            await self._drop()

    async def _drop(self) -> None:
        with trio.move_on_after(1, shield=True):
            await trio.aclose_forcefully(self.stream)
        await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        """hypercorn's ``TCPServer._read_data`` with reads that grow, ending the idle
        timer (:class:`IdleDeadline`) when the connection stops reading.

        A read that fills ``read_size`` (64 KiB) means the connection carries large
        bodies (a 40k-token prompt is ~240 kB), so from then on it reads up to
        ``read_size_large`` (256 KiB) at a time: such a body takes two reads instead of
        four or five, each a pass through hypercorn, h11 and Quart
        (docs/performance.md). Connections of short requests keep 64 KiB reads: glibc
        serves a buffer above its mmap threshold (128 KiB until the process has freed a
        larger block) from fresh pages, ~20 us more per read. The size is not larger
        still for the same reason: the threshold only rises to the largest block freed,
        so a 1 MiB buffer would stay above it (~200 us per 240 kB body).

        First, the connection's HTTP/1.1 protocol becomes a
        :class:`HeadWithBodyH11Protocol` (:meth:`_adopt_protocol`).
        """
        self._adopt_protocol()
        small, large = self.config.read_size, self.config.read_size_large
        size = small
        try:
            while True:
                try:
                    with trio.fail_after(self.config.read_timeout or math.inf):
                        data = await self.stream.receive_some(size)
                except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                    break
                if len(data) >= small:
                    size = large
                # A SocketStream hands out bytes (hypercorn copies them with bytes() all
                # the same); h11 takes any bytes-like.
                await self.protocol.handle(RawData(data))  # type: ignore[arg-type]
                if not data:
                    break
            await self.protocol.handle(Closed())
        finally:
            self.idle_task.end()

    def _adopt_protocol(self) -> None:
        """Replace the H11Protocol that hypercorn's ``ProtocolWrapper`` made for this
        connection by a :class:`HeadWithBodyH11Protocol` built from the same arguments.

        Why this way: hypercorn's ``run`` builds the wrapper, and the wrapper its
        protocol, from names bound in their own modules; taking either over would mean
        a copy of ``run`` (TLS handshake, ALPN, addresses) or of the wrapper's
        protocol switching, both to drift from upstream. The wrapper keeps every
        argument it gave the protocol as an attribute of the same name, so the
        replacement is built as the wrapper built the original, once per connection,
        before its first byte is read: ``run`` has only called the protocol's
        ``initiate`` (a no-op for HTTP/1.1), so no response can have started, and the
        discarded protocol was never used. (Assigning the object's ``__class__``
        would spare that construction, but CPython then keeps the object's attributes
        in a plain dict, and each of the protocol's many attribute reads per request
        takes twice as long.) A connection that upgrades to HTTP/2 (h2c, prior
        knowledge) gets hypercorn's H2Protocol, as before.
        """
        w = self.protocol
        if type(w.protocol) is H11Protocol:
            w.protocol = HeadWithBodyH11Protocol(
                w.app, w.config, w.context, w.task_group, w.state, w.ssl, w.client, w.server,
                w.send,
            )  # fmt: skip


def _write_now(stream: trio.abc.Stream, data: bytes) -> int | None:
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


class IdleDeadline:
    """A connection's keep-alive idle timer: one task, a deadline that moves.

    Stands in for hypercorn's ``TrioSingleTask`` as ``TCPServer.idle_task``, which
    hypercorn cancels and spawns afresh, behind a lock, each time a connection goes idle
    (and cancels when its next request arrives): a task spawn and about five scheduler
    passes per request. It keeps the same two calls: ``restart`` (the connection went
    idle) sets the deadline to ``keep_alive_timeout`` from now, ``stop`` (a request
    arrived) lifts it. Neither yields to the scheduler. When the deadline passes, or the
    server terminates while the connection is idle, the connection is closed, as by
    hypercorn's own ``TCPServer._idle_timeout``. A connection busy with a request when
    the server terminates is left to finish it: hypercorn closes it after the response
    (it does not recycle a connection once terminated), and the graceful timeout bounds
    the wait. When the connection stops reading (the client went away, or the server
    closed it), :meth:`end` ends the task: hypercorn cancelled its timer at ``stop``,
    but this one lives on with no deadline and would hold the connection open.
    """

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._ended = False

    async def restart(self, task_group: TaskGroup, action: Callable[[], Awaitable[None]]) -> None:
        """Close the connection ``keep_alive_timeout`` from now unless moved again.

        *action* is hypercorn's ``TCPServer._idle_timeout``; it is not called, the
        timer's own task does what it does. The task runs in the connection's nursery.
        """
        if self._ended:
            return
        self._idle = True
        deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            nursery = task_group._nursery
            assert nursery is not None  # the connection's TaskGroup is entered
            nursery.start_soon(self._watch, self._scope)
        else:
            self._scope.deadline = deadline

    async def stop(self) -> None:
        """Lift the deadline: a request arrived."""
        self._idle = False
        if self._scope is not None:
            self._scope.deadline = math.inf

    def end(self) -> None:
        """The connection stopped reading: end the timer's task, for good."""
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self, scope: trio.CancelScope) -> None:
        server = self._server
        with scope:
            await server.context.terminated.wait()
        # Terminated while busy: the request runs on, and hypercorn closes the
        # connection after the response instead of recycling it.
        if not self._ended and (self._idle or scope.cancelled_caught):
            with trio.CancelScope(shield=True):
                await server._initiate_server_close()
