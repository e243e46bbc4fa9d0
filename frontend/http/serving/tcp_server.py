"""headwater's connection: hypercorn-trio's ``TCPServer`` with fixes 2–5 as overrides,
and the limits on slow clients.

:class:`HeadwaterTCPServer` is what :func:`frontend.http.serving.serve` runs for each
accepted connection; hypercorn's own class, and any server that uses it, is unchanged.
Each override is a copy of the upstream method it replaces, changed where its docstring
says; ``tests/test_hypercorn_seam.py`` holds a fingerprint of every upstream function
these copies and assumptions are taken from.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable

import h11
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, LifespanState

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.h11_protocol import HeadWithBodyH11Protocol
from frontend.http.serving.httptools_protocol import HttptoolsProtocol
from frontend.http.serving.limits import HEADER_TIMEOUT, READ_TIMEOUT, WRITE_TIMEOUT
from frontend.http.serving.policy import Http11

log = logging.getLogger(__name__)

#: A connection's byte stream: plain TCP, or TLS over it.
HttpStream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


class HeadwaterTCPServer(TCPServer):
    """One HTTP connection, served as hypercorn serves it, but:

    - its idle timer is an :class:`IdleDeadline` (fix 2);
    - each socket write has a deadline, ``config.write_timeout``, and a non-blocking
      fast path (fix 3, :meth:`protocol_send`);
    - its reads grow from ``config.read_size`` to ``config.read_size_large`` once one
      fills the former, and the idle timer ends with the reads (fix 4, :meth:`_read_data`);
    - its HTTP/1.1 protocol writes a known-length response's head with its body
      (fix 5, :class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`, or
      with ``config.http_parser = "httptools"``
      :class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol`);
    - a request head must arrive within ``config.header_timeout`` of its first byte and
      within ``config.h11_max_incomplete_size`` bytes, a request body may not stall for
      ``config.body_read_timeout`` (:meth:`_read_data`); each refusal, and each write
      timeout, is reported to ``config.refused``.

    *stream* is a ``trio.SocketStream``, or a ``trio.SSLStream`` over one whose
    handshake is done: :func:`~frontend.http.serving.serve` does it, and hypercorn's
    ``run`` calls ``do_handshake`` again, which then returns at once. Writes to a TLS
    stream skip the fast path (:func:`_write_now` writes nothing to one).
    """

    config: ServerConfig
    # hypercorn's annotation is its TrioSingleTask; this server's is the stand-in.
    idle_task: IdleDeadline  # type: ignore[assignment]
    #: Set when the connection lingers before its close (:meth:`_close`).
    _linger_until: float | None = None
    #: The cancel scope of the read under way, if one is (:meth:`_close` shortens it).
    _read_scope: trio.CancelScope | None = None

    def __init__(
        self,
        app: AppWrapper,
        config: ServerConfig,
        context: WorkerContext,
        state: LifespanState,
        stream: HttpStream,
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
            await self._drop()
            return
        if timed_out:
            self.config.refused(WRITE_TIMEOUT)
            log.debug("dropping a client that took no bytes for %g s", self.config.write_timeout)
            await self._drop()

    async def _drop(self) -> None:
        with trio.move_on_after(1, shield=True):
            await trio.aclose_forcefully(self.stream)
        await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        """hypercorn's ``TCPServer._read_data`` with reads that grow, deadlines on slow
        clients, and the idle timer ended when the connection stops reading.

        A read that fills ``read_size`` (64 KiB) means the connection carries large
        bodies (a 40k-token prompt is ~240 kB), so from then on it reads up to
        ``read_size_large`` (256 KiB) at a time: such a body takes two reads instead of
        four or five, each a pass through hypercorn, h11 and Quart
        (docs/performance.md). Connections of short requests keep 64 KiB reads: glibc
        serves a buffer above its mmap threshold (128 KiB until the process has freed a
        larger block) from fresh pages, ~20 us more per read. The size is not larger
        still for the same reason: the threshold only rises to the largest block freed,
        so a 1 MiB buffer would stay above it (~200 us per 240 kB body).

        Slow clients, on HTTP/1.1 (an h2c or websocket connection has hypercorn's
        ``read_timeout`` only, as every connection also has):

        - the first byte of a request head lifts the keep-alive idle timer (the
          connection is no longer idle), and the head must end within
          ``header_timeout`` of it, however steadily it trickles in: else 408 and close
          (``header_timeout``);
        - the head must end within ``h11_max_incomplete_size`` bytes: the protocol
          refuses a longer one with 431, whole or not, first in its read or pipelined
          (:func:`~frontend.http.serving.limits.head_fault`);
        - while h11 waits for the rest of a request body, each read must bring bytes
          within ``body_read_timeout``: else close (``read_timeout``). No deadline while
          a response is under way: the client has sent what it had to;
        - a connection closed while its client still sends a body lingers
          (:meth:`_close`): what it sends is read and dropped until it stops, or for
          ``linger_timeout`` at most.

        First, the connection's HTTP/1.1 protocol becomes headwater's
        (:meth:`_adopt_protocol`).
        """
        self._adopt_protocol()
        config = self.config
        small, large = config.read_size, config.read_size_large
        size = small
        every_read = config.read_timeout or math.inf  # hypercorn's own, None by default
        deadline, reason = math.inf, ""  # of the next read, and what missing it means
        head_started: float | None = None  # the first byte of an incomplete head
        try:
            while True:
                # One cancel scope per read, as hypercorn's: the earlier of the two deadlines.
                at = (
                    deadline
                    if every_read == math.inf
                    else min(deadline, trio.current_time() + every_read)
                )
                if self._linger_until is not None:
                    at = min(at, self._linger_until)
                with trio.move_on_at(at) as late:
                    self._read_scope = late  # _close shortens it to linger
                    try:
                        data = await self.stream.receive_some(size)
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        break
                    finally:
                        self._read_scope = None
                if self._linger_until is not None:
                    if late.cancelled_caught or not data:
                        break  # lingered long enough, or the client is done
                    continue  # a body nobody reads: dropped
                if late.cancelled_caught:
                    if trio.current_time() >= deadline:
                        await self._refuse_slow(reason)
                    break  # else hypercorn's read_timeout: closed, as hypercorn closes it
                if len(data) >= small:
                    size = large
                http11 = self._http11()
                if http11 is None or not data or not http11.awaiting_head:
                    # A SocketStream hands out bytes (hypercorn copies them with bytes()
                    # all the same); h11 takes any bytes-like.
                    await self.protocol.handle(RawData(data))  # type: ignore[arg-type]
                    if not data:
                        break
                else:  # the bytes of a request head
                    if head_started is None:
                        head_started = trio.current_time()
                        await self.idle_task.stop()
                    heads = http11.keep_alive_requests
                    await self.protocol.handle(RawData(data))  # type: ignore[arg-type]
                    if http11.keep_alive_requests != heads or not http11.awaiting_head:
                        head_started = None  # the head ended
                deadline, reason = self._next_deadline(head_started)
            await self.protocol.handle(Closed())
        finally:
            self.idle_task.end()

    async def _close(self) -> None:
        """hypercorn's ``TCPServer._close``, which lingers first if the client is still
        sending a request body: a response that did not read it (a refusal, a 401) ended
        the request. Closed with unread bytes in its buffer, the socket would send a reset,
        and a client that writes its whole body before it reads (httpx does) would lose
        the answer with it. So the connection's writing side is shut (the client sees the
        answer end), and :meth:`_read_data` drops what comes, until the client stops or
        ``linger_timeout`` has passed; then the connection closes, here again."""
        http11 = self._http11()
        if self._linger_until is None and http11 is not None and http11.receiving_body:
            self._linger_until = trio.current_time() + self.config.linger_timeout
            if self._read_scope is not None:
                self._read_scope.deadline = min(self._read_scope.deadline, self._linger_until)
            stream: HttpStream = self.stream
            if isinstance(stream, trio.SocketStream):  # TLS cannot half-close
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_eof()
            return
        await super()._close()

    def _http11(self) -> Http11 | None:
        """The connection's HTTP/1.1 protocol, unless it went h2c or websocket, or has
        none yet: hypercorn's ``run`` makes it after reading the socket's addresses, and a
        client that resets at once fails that read (OSError) and closes with none."""
        wrapper = getattr(self, "protocol", None)
        if wrapper is None:
            return None
        protocol = wrapper.protocol
        if type(protocol) is HttptoolsProtocol:
            return protocol
        if type(protocol) is not HeadWithBodyH11Protocol:
            return None
        return protocol if type(protocol.connection) is h11.Connection else None

    def _next_deadline(self, head_started: float | None) -> tuple[float, str]:
        """When the next read must have brought bytes, and the refusal if it has not."""
        http11 = self._http11()
        if http11 is None:
            return math.inf, ""
        if head_started is not None:
            return head_started + self.config.header_timeout, HEADER_TIMEOUT
        if http11.receiving_body:
            return trio.current_time() + self.config.body_read_timeout, READ_TIMEOUT
        return math.inf, ""

    async def _refuse_slow(self, reason: str) -> None:
        """A slow client missed the deadline of *reason*: report it, and answer 408 to a
        head that never ended (the caller then closes the connection)."""
        self.config.refused(reason)
        log.debug("closing a connection: %s", reason)
        http11 = self._http11()
        if reason == HEADER_TIMEOUT and http11 is not None and http11.between_requests:
            await http11._send_error_response(408)

    def _adopt_protocol(self) -> None:
        """Replace the H11Protocol that hypercorn's ``ProtocolWrapper`` made for this
        connection by headwater's, built from the same arguments: a
        :class:`HeadWithBodyH11Protocol`, or a :class:`HttptoolsProtocol` when
        ``config.http_parser`` is ``"httptools"``.

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
            httptools = self.config.http_parser == "httptools"
            cls = HttptoolsProtocol if httptools else HeadWithBodyH11Protocol
            # The wrapper's annotation names hypercorn's two protocols; this one stands
            # in for H11Protocol with the same interface.
            w.protocol = cls(  # type: ignore[assignment]
                w.app,
                w.config,
                w.context,
                w.task_group,
                w.state,
                w.ssl,
                w.client,
                w.server,
                w.send,
            )


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
