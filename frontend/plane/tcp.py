"""The request plane over TCP: a multiplexed, heartbeated connection to one worker.

:class:`TcpWorkerClient` is the TCP twin of :class:`~frontend.plane.memory.MemoryWorkerClient`:
same contract, same errors. It keeps one persistent connection to its worker and
multiplexes every concurrent request over it by request id. Its connection tasks
need an owner, so the client has a :meth:`~TcpWorkerClient.run` method to start in
a nursery (:func:`connect_worker` does both)::

    client = await connect_worker(instance, nursery, secret=secret)   # connected
    async with client.stream(request) as chunks:   # entered once the worker ACKed
        async for chunk in chunks: ...
    await client.aclose()   # ends run(); in-flight streams fail with Disconnected

Behaviour (all times from :class:`PlaneConfig`):

* connecting: TCP connect plus handshake within ``connect_timeout``, else
  :class:`ConnectTimeout`. A broken connection is re-opened at once, then with
  exponential backoff; while backing off ``stream()`` fails fast with CannotConnect
  (the router then routes elsewhere) instead of queueing behind a dead worker.
* ``stream()`` sends the request and waits ``ack_timeout`` for the ACK, else
  :class:`AckTimeout` (a CannotConnect) and a cancel goes out for the request.
* heartbeat: a ping every ``heartbeat_interval``; no pong within
  ``heartbeat_timeout`` marks the connection broken and every in-flight stream
  fails with :class:`~frontend.plane.base.Disconnected`.
* leaving ``stream()`` before the End sends a cancel; a worker's ``goaway`` stops new
  requests on that connection while in-flight ones finish.

The reader never blocks on a slow consumer (a slow HTTP client must not stall the
other streams sharing the connection): each stream buffers up to ``stream_buffer``
replies, and a stream that falls further behind is cancelled and fails with
Disconnected. :class:`PlaneConnection` runs over any ``trio.abc.Stream``, which is how
the tests drive it over memory streams on virtual time; the worker-to-worker KV
transfer (``workers.runtime.kv_transfer_tcp``) reuses it for ``kv_pull``.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial

import trio

from frontend.plane.base import (
    CannotConnect,
    Disconnected,
    ResponseStream,
    WorkerClient,
    WorkerError,
    WorkerInstance,
)
from headwater.wire import Ack, Cancel, Chunk, End, Error, ErrorCode, GenerateRequest
from headwater.wire.framing import (
    DEFAULT_MAX_FRAME,
    AuthError,
    ClientHandshake,
    Fault,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    GetStats,
    GoAway,
    HelloOk,
    KvData,
    KvPull,
    Ping,
    Pong,
    ProtocolError,
    Stats,
    encode,
    load_secret,
    parse_tcp_address,
)

log = logging.getLogger(__name__)

#: Opens the byte stream to a worker (a TCP connect in production, memory in tests).
Connector = Callable[[], Awaitable[trio.abc.Stream]]

_COALESCE_BYTES = 256 * 1024  # frames queued together go out in one send_all


class ConnectTimeout(CannotConnect):
    """TCP connect plus handshake took longer than ``connect_timeout``."""


class AckTimeout(CannotConnect):
    """The worker did not ACK the request within ``ack_timeout``."""


class HandshakeFailed(CannotConnect):
    """The worker refused the handshake or is not the worker expected. ``code`` says why."""

    def __init__(self, message: str, code: str = "protocol_error") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PlaneConfig:
    """Timeouts and limits of the TCP request plane's client side."""

    #: Seconds to wait for the ACK after sending a request (Dynamo: 5 s).
    ack_timeout: float = 5.0
    #: Seconds for TCP connect plus handshake.
    connect_timeout: float = 5.0
    #: Seconds between heartbeat pings on an open connection.
    heartbeat_interval: float = 5.0
    #: Seconds a ping may go unanswered before the connection counts as broken.
    heartbeat_timeout: float = 10.0
    #: Seconds before the first retry after a failed connect; doubles per failure.
    backoff_initial: float = 0.1
    #: Upper bound of the retry delay (s).
    backoff_max: float = 5.0
    #: Each delay is shortened by up to this fraction at random, so frontends that
    #: lost the same worker do not reconnect in lockstep. 0 = exact delays.
    backoff_jitter: float = 0.1
    #: Largest frame accepted or sent (bytes); the worker must use the same limit.
    max_frame: int = DEFAULT_MAX_FRAME
    #: Replies buffered per stream before that stream is cancelled as too slow.
    stream_buffer: int = 4096
    #: Bytes asked of the socket per read.
    receive_size: int = 64 * 1024


# ---- one connection -----------------------------------------------------------------


class _Route:
    """The frames for one request (or KV pull, or stats query) on a connection."""

    __slots__ = ("failure", "receive", "send")

    def __init__(self, size: int) -> None:
        self.send, self.receive = trio.open_memory_channel[Frame](size)
        self.failure: Disconnected | None = None

    async def next(self) -> Frame:
        """The next frame; raises Disconnected once the route was failed and drained.

        A frame already buffered is returned without a schedule point (cancellation
        is still checked), so a burst of chunks costs one wake-up, not one each.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            try:
                return self.receive.receive_nowait()
            except trio.WouldBlock:
                return await self.receive.receive()
        except trio.EndOfChannel:
            raise self.failure or Disconnected("connection closed") from None


class _TcpResponseStream(ResponseStream):
    def __init__(self, route: _Route) -> None:
        self._route = route
        self.finished = False

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        try:
            msg = await self._route.next()
        except Disconnected:
            self.finished = True
            raise
        if isinstance(msg, Chunk):
            return msg
        self.finished = True
        if isinstance(msg, End):
            raise StopAsyncIteration
        if isinstance(msg, Error):
            raise WorkerError(msg.code, msg.message)
        raise Disconnected(f"unexpected {type(msg).__name__} in a response stream")


class PlaneConnection:
    """One handshaken connection to a worker, shared by many concurrent streams.

    Made by :func:`open_connection`; its reader, writer and heartbeat tasks live in
    :meth:`run`, which the owner starts with ``await nursery.start(conn.run)`` and
    which returns (never raises, except Cancelled) once the connection is over.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        peer: HelloOk,
        decoder: FrameDecoder,
        pending: list[Frame],
        config: PlaneConfig,
    ) -> None:
        self.peer = peer
        self.config = config
        self._stream = stream
        self._decoder = decoder
        self._pending = pending  # frames that arrived with the end of the handshake
        # Unbounded on purpose: senders never block (cancels go out from `finally`),
        # and what is queued is bounded by the streams open on this connection.
        self._out_send, self._out_recv = trio.open_memory_channel[bytes](math.inf)
        self._routes: dict[str | tuple[str, int], _Route] = {}
        self._scope = trio.CancelScope()
        self._reason: str | None = None
        self._ping_seq = 0
        self._pong_seq = 0
        self._pong = trio.Event()
        self._stats_seq = 0
        #: Set on goaway or when the connection ends: take no new streams.
        self.unusable = trio.Event()
        #: Set when :meth:`run` has finished and every stream on it has failed.
        self.closed = trio.Event()
        self.draining = False  # the worker sent goaway
        self.rtt: float | None = None  # seconds, last heartbeat round trip

    @property
    def inflight(self) -> int:
        return len(self._routes)

    @property
    def reason(self) -> str | None:
        """Why the connection ended (None while it is open)."""
        return self._reason

    # -- lifetime --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._heartbeat)
                    task_status.started()
                    await self._reader()
        finally:
            self._fail_all(self._reason or "connection closed")
            await trio.aclose_forcefully(self._stream)
            self.closed.set()

    def close(self, reason: str = "closed by the client") -> None:
        """End the connection now; in-flight streams fail with Disconnected."""
        self._break(reason)

    def _break(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        self.unusable.set()
        self._scope.cancel()

    def _fail_all(self, reason: str) -> None:
        self.unusable.set()
        self._out_send.close()
        for route in self._routes.values():
            route.failure = Disconnected(f"{self.peer.worker_id}: {reason}")
            route.send.close()
        self._routes.clear()

    # -- sending --

    def send_frame(self, frame: Frame) -> None:
        """Queue *frame*; never blocks. Raises FrameTooLarge, Disconnected if closed."""
        data = encode(frame, self.config.max_frame)
        try:
            self._out_send.send_nowait(data)
        except trio.ClosedResourceError:
            raise Disconnected(f"{self.peer.worker_id}: {self._reason}") from None

    async def _writer(self) -> None:
        try:
            async for data in self._out_recv:
                batch, size = [data], len(data)
                while size < _COALESCE_BYTES:
                    try:
                        more = self._out_recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    batch.append(more)
                    size += len(more)
                await self._stream.send_all(data if len(batch) == 1 else b"".join(batch))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._break(f"write failed: {exc!r}")

    async def _heartbeat(self) -> None:
        cfg = self.config
        while True:
            await trio.sleep(cfg.heartbeat_interval)
            self._ping_seq += 1
            seq, sent = self._ping_seq, trio.current_time()
            self._pong = trio.Event()
            self.send_frame(Ping(seq))
            with trio.move_on_after(cfg.heartbeat_timeout):
                await self._pong.wait()
            if self._pong_seq < seq:
                # After a stall of our own loop the pong may be sitting in the socket
                # with the reader scheduled in this same batch: let it run first.
                await trio.lowlevel.checkpoint()
            if self._pong_seq < seq:
                self._break(f"no heartbeat reply within {cfg.heartbeat_timeout:g} s")
                return
            self.rtt = trio.current_time() - sent

    # -- receiving --

    async def _reader(self) -> None:
        for frame in self._pending:
            self._dispatch(frame)
        self._pending = []
        while True:
            try:
                data = await self._stream.receive_some(self.config.receive_size)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._break(f"read failed: {exc!r}")
                return
            if not data:
                self._break("the worker closed the connection")
                return
            try:
                frames = self._decoder.feed(data)
            except ProtocolError as exc:
                self._break(f"protocol error from the worker: {exc.message}")
                return
            for frame in frames:
                self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        match frame:
            case Ack() | Chunk() | End() | Error():
                self._deliver(frame.request_id, frame)
            case KvData():
                self._deliver(frame.transfer_id, frame)
            case Pong():
                if frame.seq == self._ping_seq:
                    self._pong_seq = frame.seq
                    self._pong.set()
            case Stats():
                self._deliver(("stats", frame.seq), frame)
            case Ping():
                self.send_frame(Pong(frame.seq))
            case GoAway():
                log.info("%s sent goaway: %s", self.peer.worker_id, frame.reason)
                self.draining = True
                self.unusable.set()
            case Fault():
                self._break(f"the worker closed the connection: {frame.code}: {frame.message}")
            case _:
                self._break(f"unexpected {type(frame).__name__} from the worker")

    def _deliver(self, key: str | tuple[str, int], frame: Frame) -> None:
        route = self._routes.get(key)
        if route is None:
            return  # its stream already left; late replies are expected after a cancel
        try:
            route.send.send_nowait(frame)
        except trio.WouldBlock:
            del self._routes[key]
            route.failure = Disconnected(
                f"stream fell {self.config.stream_buffer} replies behind its worker; cancelled"
            )
            route.send.close()
            if isinstance(key, str):
                self.send_frame(Cancel(key))

    # -- streams --

    def _open_route(self, key: str | tuple[str, int]) -> _Route:
        if self.unusable.is_set():
            raise CannotConnect(f"{self.peer.worker_id}: connection is closing ({self._reason})")
        if key in self._routes:
            raise WorkerError(ErrorCode.INVALID_REQUEST, f"duplicate id {key!r} on this connection")
        route = self._routes[key] = _Route(self.config.stream_buffer)
        return route

    def _close_route(self, key: str | tuple[str, int], route: _Route) -> None:
        if self._routes.get(key) is route:
            del self._routes[key]
        route.receive.close()

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        """:meth:`WorkerClient.stream` on this connection (see the module docstring)."""
        rid = request.request_id
        route = self._open_route(rid)
        stream = _TcpResponseStream(route)
        try:
            try:
                self.send_frame(request)
            except FrameTooLarge as exc:
                stream.finished = True  # never sent: nothing to cancel
                raise WorkerError(ErrorCode.INVALID_REQUEST, exc.message) from exc
            except Disconnected as exc:
                stream.finished = True
                raise CannotConnect(str(exc)) from exc
            with trio.move_on_after(self.config.ack_timeout) as ack_scope:
                try:
                    first = await route.next()
                except Disconnected as exc:
                    stream.finished = True
                    raise CannotConnect(f"no ACK, connection lost: {exc}") from exc
            if ack_scope.cancelled_caught:
                raise AckTimeout(
                    f"no ACK from {self.peer.worker_id} within {self.config.ack_timeout:g} s"
                )
            if isinstance(first, Error):
                stream.finished = True
                raise WorkerError(first.code, first.message)
            if not isinstance(first, Ack):
                raise Disconnected(f"expected Ack, got {type(first).__name__}")
            yield stream
        finally:
            self._close_route(rid, route)
            if not stream.finished:
                self._cancel_quietly(rid)

    def _cancel_quietly(self, key: str) -> None:
        with suppress(Disconnected):  # a closed connection has cancelled everything
            self.send_frame(Cancel(key))

    async def pull_kv(self, transfer_id: str) -> int:
        """Fetch the KV held under *transfer_id*; return the payload bytes received.

        Raises WorkerError (unknown or expired transfer), Disconnected.
        Cancellation sends a cancel so the worker stops sending the payload.
        """
        route = self._open_route(transfer_id)
        done = False
        try:
            self.send_frame(KvPull(transfer_id))
            received = 0
            while True:
                msg = await route.next()
                if isinstance(msg, KvData):
                    received += len(msg.data)
                    if msg.last:
                        done = True
                        return received
                elif isinstance(msg, Error):
                    done = True
                    raise WorkerError(msg.code, msg.message)
                else:
                    raise Disconnected(f"unexpected {type(msg).__name__} in a KV transfer")
        finally:
            self._close_route(transfer_id, route)
            if not done:
                self._cancel_quietly(transfer_id)

    async def fetch_stats(self) -> dict[str, int | float | str | bool]:
        """The worker's counters (runtime, engine, plane), flat. Raises Disconnected."""
        self._stats_seq += 1
        key = ("stats", self._stats_seq)
        route = self._open_route(key)
        try:
            self.send_frame(GetStats(self._stats_seq))
            msg = await route.next()
        finally:
            self._close_route(key, route)
        if not isinstance(msg, Stats):
            raise Disconnected(f"unexpected {type(msg).__name__} for a stats query")
        return msg.values


async def open_connection(
    stream: trio.abc.Stream,
    *,
    role: str,
    peer_id: str,
    secret: bytes | None,
    expect_worker_id: str = "",
    expect_model: str = "",
    config: PlaneConfig,
) -> PlaneConnection:
    """Run the client handshake on *stream*; return the (not yet running) connection.

    Raises :class:`HandshakeFailed` (refused, wrong secret, not the expected worker;
    *stream* is closed then) and CannotConnect if the stream breaks. No timeout of
    its own: the caller bounds it (``connect_timeout``).
    """
    try:
        handshake = ClientHandshake(role=role, peer_id=peer_id, model=expect_model, secret=secret)
        decoder = FrameDecoder(config.max_frame)
        await stream.send_all(encode(handshake.start()))
        frames: list[Frame] = []
        while handshake.peer is None:
            if not frames:
                data = await stream.receive_some(config.receive_size)
                if not data:
                    raise CannotConnect("the worker closed the connection during the handshake")
                frames = decoder.feed(data)
                continue
            reply = handshake.receive(frames.pop(0))
            if reply is not None:
                await stream.send_all(encode(reply))
        peer = handshake.peer
        if expect_worker_id and peer.worker_id != expect_worker_id:
            raise HandshakeFailed(
                f"expected worker {expect_worker_id}, found {peer.worker_id}", "wrong_worker"
            )
        if expect_model and peer.model != expect_model:
            raise HandshakeFailed(
                f"worker {peer.worker_id} serves {peer.model!r}, expected {expect_model!r}",
                "wrong_model",
            )
        return PlaneConnection(stream, peer, decoder, frames, config)
    except BaseException as exc:
        await trio.aclose_forcefully(stream)
        if isinstance(exc, AuthError | ProtocolError):
            raise HandshakeFailed(f"handshake failed: {exc.message}", exc.code) from exc
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
            raise CannotConnect(f"connection lost during the handshake: {exc!r}") from exc
        raise


def tcp_connector(address: str) -> Connector:
    """A :data:`Connector` for ``tcp://host:port``. Raises ValueError on a bad address."""
    host, port = parse_tcp_address(address)
    return partial(trio.open_tcp_stream, host, port)


async def dial(
    connector: Connector,
    *,
    role: str,
    peer_id: str,
    secret: bytes | None,
    expect_worker_id: str = "",
    expect_model: str = "",
    config: PlaneConfig,
) -> PlaneConnection:
    """Connect and handshake within ``config.connect_timeout``.

    Raises :class:`ConnectTimeout`, :class:`HandshakeFailed` or CannotConnect
    (refused, unreachable).
    """
    with trio.move_on_after(config.connect_timeout) as scope:
        try:
            stream = await connector()
        except OSError as exc:
            raise CannotConnect(f"connect failed: {exc}") from exc
        return await open_connection(
            stream,
            role=role,
            peer_id=peer_id,
            secret=secret,
            expect_worker_id=expect_worker_id,
            expect_model=expect_model,
            config=config,
        )
    assert scope.cancelled_caught
    raise ConnectTimeout(f"connect + handshake took over {config.connect_timeout:g} s")


# ---- the client -------------------------------------------------------------------------


class ClientState(enum.StrEnum):
    IDLE = "idle"  # run() not started
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKOFF = "backoff"  # the last connect failed; waiting to retry
    DRAINING = "draining"  # the worker sent goaway; its in-flight streams finish
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class TcpClientStats:
    state: ClientState
    inflight: int
    connects_total: int
    connect_failures_total: int
    disconnects_total: int
    last_error: str | None
    rtt_s: float | None


class TcpWorkerClient(WorkerClient):
    """A :class:`WorkerClient` for a worker at ``tcp://host:port``.

    Start :meth:`run` in a nursery before streaming (or use :func:`connect_worker`);
    ``stream()`` raises CannotConnect while run() is not running.
    """

    def __init__(
        self,
        instance: WorkerInstance,
        *,
        secret: bytes | None = None,
        config: PlaneConfig | None = None,
        connector: Connector | None = None,
        client_id: str = "",
        rng: random.Random | None = None,
    ) -> None:
        self.instance = instance
        self.config = config or PlaneConfig()
        self.client_id = client_id or f"frontend-{uuid.uuid4().hex[:8]}"
        self._secret = secret
        self._connector = connector or tcp_connector(instance.address)
        self._rng = rng or random.Random()
        self._scope = trio.CancelScope()
        self._state = ClientState.IDLE
        self._changed = trio.Event()
        self._conn: PlaneConnection | None = None
        self._retry_at = 0.0
        self._last_error: str | None = None
        self._last_failure: CannotConnect | None = None  # why the last connect failed
        self._connects = 0
        self._connect_failures = 0
        self._disconnects = 0

    @property
    def state(self) -> ClientState:
        return self._state

    def _set_state(self, state: ClientState) -> None:
        self._state = state
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a connection to the worker open until :meth:`aclose` (or cancellation).

        Reports started at once; the first connect happens in the background and
        ``stream()`` calls meanwhile wait for it. May be called once.
        """
        if self._state is not ClientState.IDLE:
            raise RuntimeError(f"TcpWorkerClient.run() called in state {self._state}")
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self._set_state(ClientState.CONNECTING)
                    task_status.started()
                    await self._maintain(nursery)
        finally:
            self._conn = None
            self._set_state(ClientState.CLOSED)

    async def _maintain(self, nursery: trio.Nursery) -> None:
        failures = 0
        while True:
            self._set_state(ClientState.CONNECTING)
            try:
                conn = await dial(
                    self._connector,
                    role="frontend",
                    peer_id=self.client_id,
                    secret=self._secret,
                    expect_worker_id=self.instance.worker_id,
                    expect_model=self.instance.model,
                    config=self.config,
                )
            except CannotConnect as exc:
                failures += 1
                self._connect_failures += 1
                delay = self._backoff(failures)
                self._last_error = str(exc)
                self._last_failure = exc
                self._retry_at = trio.current_time() + delay
                self._set_state(ClientState.BACKOFF)
                log.warning(
                    "cannot connect to %s at %s (%s); retrying in %.2f s",
                    self.instance.worker_id, self.instance.address, exc, delay,
                )
                await trio.sleep(delay)
                continue
            failures = 0
            self._connects += 1
            await nursery.start(conn.run)
            self._conn = conn
            self._set_state(ClientState.CONNECTED)
            await conn.unusable.wait()
            self._conn = None
            if conn.draining and not conn.closed.is_set():
                self._set_state(ClientState.DRAINING)
                await conn.closed.wait()
            self._disconnects += 1
            self._last_error = conn.reason
            log.info("connection to %s ended: %s", self.instance.worker_id, conn.reason)

    def _backoff(self, failures: int) -> float:
        cfg = self.config
        delay = min(cfg.backoff_max, cfg.backoff_initial * 2 ** (failures - 1))
        return delay * (1 - cfg.backoff_jitter * self._rng.random())

    async def _connection(self) -> PlaneConnection:
        while True:
            state, conn = self._state, self._conn
            if state is ClientState.CONNECTED and conn is not None and not conn.unusable.is_set():
                return conn
            if state is ClientState.BACKOFF:
                wait = max(0.0, self._retry_at - trio.current_time())
                raise CannotConnect(
                    f"{self.instance.worker_id} unreachable ({self._last_error}); "
                    f"next attempt in {wait:.2f} s"
                ) from self._last_failure
            if state is ClientState.DRAINING:
                raise CannotConnect(f"{self.instance.worker_id} is shutting down (goaway)")
            if state in (ClientState.IDLE, ClientState.CLOSED):
                raise CannotConnect(f"client for {self.instance.worker_id} is {state}")
            await self._changed.wait()  # CONNECTING: bounded by connect_timeout

    async def wait_connected(self) -> None:
        """Wait for the current connection attempt; raises CannotConnect if it failed,
        with the attempt's own error (ConnectTimeout, HandshakeFailed, ...) as cause."""
        await self._connection()

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        conn = await self._connection()
        async with conn.stream(request) as replies:
            yield replies

    async def fetch_stats(self) -> dict[str, int | float | str | bool]:
        """The worker's counters over the live connection. Raises CannotConnect,
        Disconnected."""
        conn = await self._connection()
        return await conn.fetch_stats()

    async def aclose(self) -> None:
        """Stop :meth:`run`; in-flight streams fail with Disconnected."""
        if self._state is ClientState.IDLE:
            self._set_state(ClientState.CLOSED)
        self._scope.cancel()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> TcpClientStats:
        conn = self._conn
        return TcpClientStats(
            state=self._state,
            inflight=conn.inflight if conn is not None else 0,
            connects_total=self._connects,
            connect_failures_total=self._connect_failures,
            disconnects_total=self._disconnects,
            last_error=self._last_error,
            rtt_s=conn.rtt if conn is not None else None,
        )


async def connect_worker(
    instance: WorkerInstance,
    nursery: trio.Nursery | None = None,
    *,
    secret: bytes | None = None,
    config: PlaneConfig | None = None,
    client_id: str = "",
) -> TcpWorkerClient:
    """A connected :class:`TcpWorkerClient` for *instance* (``tcp://host:port``).

    The client's tasks run in *nursery*; by default in the nursery that owns the
    calling task, so a discovery membership that calls ``connect_worker(instance)``
    from its own tasks keeps its clients alive exactly as long as itself. *secret*
    defaults to ``$HEADWATER_PLANE_SECRET`` (None when unset).

    Returns once the first connection is up. Raises CannotConnect whose ``__cause__``
    is the attempt's error (then nothing is left running), ValueError for an address that is not ``tcp://host:port``.
    Close the client with ``await client.aclose()`` when the worker goes away.
    """
    if nursery is None:
        task = trio.lowlevel.current_task()
        nursery = task.eventual_parent_nursery or task.parent_nursery
        if nursery is None:
            raise RuntimeError("connect_worker() needs a nursery here")
    if secret is None:
        secret = load_secret()
    client = TcpWorkerClient(instance, secret=secret, config=config, client_id=client_id)
    await nursery.start(client.run)
    try:
        await client.wait_connected()
    except BaseException:
        await client.aclose()
        raise
    return client
