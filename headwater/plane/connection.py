"""The request plane's connection layer: one multiplexed, heartbeated TCP connection.

Both clients of the plane run on it: the per-worker client
(:class:`headwater.plane.client.TcpWorkerClient`, which adds reconnects and routing
state) and a decode worker pulling KV from prefill workers
(:class:`headwater.plane.kv.TcpKvTransfer`).

:func:`dial` connects (over TLS with ``PlaneConfig.tls``: :mod:`headwater.plane.tls`)
and runs the client handshake within ``connect_timeout`` (else :class:`ConnectTimeout`;
a refused TLS handshake is :class:`HandshakeFailed`, code ``tls``, naming what TLS
said); the :class:`PlaneConnection` it returns carries any
number of concurrent streams, routed by request id, once its :meth:`~PlaneConnection.run`
task is started in a nursery::

    conn = await dial(tcp_connector("tcp://127.0.0.1:7001"), role="frontend",
                      peer_id="fe-1", secret=None, config=PlaneConfig())
    await nursery.start(conn.run)
    async with conn.stream(request) as chunks:   # entered once the worker ACKed
        async for chunk in chunks: ...
    kv_bytes = await pull_kv(conn, transfer_id)   # worker-to-worker (headwater.plane.kv)
    conn.close()                                 # in-flight streams fail with Disconnected

Behaviour (all times from :class:`PlaneConfig`):

* ``stream()`` sends the request and waits ``ack_timeout`` for the ACK, else
  :class:`AckTimeout` (a CannotConnect) and a cancel goes out for the request.
* heartbeat: a ping every ``heartbeat_interval``; no pong within
  ``heartbeat_timeout`` marks the connection broken and every in-flight stream
  fails with :class:`~headwater.plane.base.Disconnected`.
* leaving ``stream()`` before the End sends a cancel; a worker's ``goaway`` stops new
  streams on the connection (``unusable`` is set) while in-flight ones finish.

The reader never blocks on a slow consumer (a slow HTTP client must not stall the
other streams sharing the connection): each stream buffers up to ``stream_buffer``
replies, and a stream that falls further behind is cancelled and fails with
Disconnected. :class:`PlaneConnection` runs over any ``trio.abc.Stream``, which is how
the tests drive it over memory streams on virtual time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial

import trio

from headwater.instrumentation.attribution import StallAttribution
from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    ResponseStream,
    WorkerError,
)
from headwater.plane.sockets import unthrottle
from headwater.plane.tls import TlsConfig, tls_reason
from headwater.wire import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    ErrorCode,
    GenerateRequest,
    WorkerLoad,
)
from headwater.wire.addresses import parse_tcp_address
from headwater.wire.capabilities import PROMPT_FROM_KV
from headwater.wire.codec import FrameDecoder, encode, encode_checked, read_size
from headwater.wire.errors import AuthError, ProtocolError
from headwater.wire.frames import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    Fault,
    Frame,
    GetStats,
    GoAway,
    HelloOk,
    KvData,
    KvEvents,
    KvPoll,
    KvPrompt,
    KvRelease,
    Ping,
    Pong,
    Stats,
)
from headwater.wire.handshake import ClientHandshake
from headwater.wire.kv_events import KvEventBatch
from headwater.wire.session import FrameMac
from headwater.wire.tokens import token_array

log = logging.getLogger(__name__)

#: Opens the byte stream to a worker (a TCP connect in production, memory in tests).
Connector = Callable[[], Awaitable[trio.abc.Stream]]

_COALESCE_BYTES = 256 * 1024  # frames queued together go out in one send_all


class ConnectTimeout(CannotConnect):
    """TCP connect plus handshake took longer than ``connect_timeout``."""


class AckTimeout(CannotConnect):
    """The worker did not ACK the request within ``ack_timeout``."""


class HandshakeFailed(CannotConnect):
    """The worker refused the handshake or is not the worker expected. ``code`` says why:
    a wire error code (``unauthorized``, ...), ``wrong_worker``, ``wrong_model``, or
    ``tls`` (a certificate refused by either end, or TLS against plain TCP)."""

    def __init__(self, message: str, code: str = "protocol_error") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PlaneConfig:
    """Timeouts and limits of the plane's client side (frontends and KV-pulling workers).

    The backoff fields govern reconnects of the frontend's ``TcpWorkerClient``.
    """

    #: Seconds to wait for the ACK after sending a request (Dynamo: 5 s).
    ack_timeout: float = 5.0
    #: Seconds for TCP connect plus handshake.
    connect_timeout: float = 5.0
    #: Seconds between heartbeat pings on an open connection.
    heartbeat_interval: float = 5.0
    #: Seconds a ping may go unanswered before the connection counts as broken.
    heartbeat_timeout: float = 10.0
    #: Seconds a stream may go without a reply, on a connection that is otherwise
    #: alive, before it fails with Disconnected (a worker whose engine is stuck): so no
    #: stream waits forever. Checked with the heartbeat, so it fires up to
    #: ``heartbeat_interval`` late.
    stream_timeout: float = 300.0
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
    #: Mutual TLS to the workers (this end's certificate, the CA, the workers' host
    #: names checked); None: plain TCP. The HMAC secret handshake runs inside it.
    tls: TlsConfig | None = None


# ---- one connection -----------------------------------------------------------------


class _Route:
    """The frames for one request (or KV pull, or stats query) on a connection."""

    __slots__ = ("done", "failure", "last", "receive", "send")

    def __init__(self, size: int) -> None:
        self.send, self.receive = trio.open_memory_channel[Frame](size)
        self.failure: Disconnected | None = None
        #: When a frame last arrived for it (or it opened), on trio's clock.
        self.last = trio.current_time()
        #: The exchange ended as the protocol says (End, Error, last KV piece): no cancel.
        self.done = False

    async def next(self) -> Frame:
        """The next frame; raises Disconnected once the route was failed and drained.

        A frame already buffered is returned without a schedule point (cancellation
        is still checked), so a burst of chunks costs one wake-up, not one each.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        frame = self.ready()
        if frame is not None:
            return frame
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            raise self.failure or Disconnected("connection closed") from None

    def ready(self) -> Frame | None:
        """A frame already buffered, or None (also once failed: :meth:`next` says why)."""
        try:
            return self.receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None


class _TcpResponseStream(ResponseStream):
    def __init__(self, route: _Route) -> None:
        self._route = route

    async def _receive(self) -> Frame:
        return await self._route.next()

    def _ready(self) -> Frame | None:
        return self._route.ready()


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
        config: PlaneConfig,
        mac: FrameMac | None = None,
    ) -> None:
        """*decoder* holds what arrived after the handshake, and checks the session's
        tags when it has a ``mac``; *mac* signs what this end sends (None: no secret)."""
        self.peer = peer
        self.config = config
        self._stream = stream
        self._decoder = decoder
        self._mac = mac
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
        #: Whether the worker answers ``kv_poll`` (None: not asked yet).
        self.kv_events: bool | None = None
        self._read_at = trio.current_time()  # when the reader's current batch arrived
        #: Excuses a missed ACK or heartbeat when our own loop stalled (None: never).
        self.attribution: StallAttribution | None = None
        #: Set on goaway or when the connection ends: take no new streams.
        self.unusable = trio.Event()
        #: Set when :meth:`run` has finished and every stream on it has failed.
        self.closed = trio.Event()
        self.draining = False  # the worker sent goaway
        self.rtt: float | None = None  # seconds, last heartbeat round trip
        #: The worker's load from its last heartbeat answer (None until one carried it).
        self.load: WorkerLoad | None = None
        #: The worker takes a decode leg's prompt from its KV pull (it declared so).
        caps = peer.capabilities
        self.prompt_from_kv = caps is not None and caps.honours(PROMPT_FROM_KV)

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
        """Queue *frame*; never blocks. Raises FrameTooLarge, Disconnected if closed; for a
        request the worker could not read, ProtocolError or ValueError (nothing sent).

        Frames are signed here, as they are queued: the writer sends them in this order,
        which is the order the worker counts them in. A request is checked first against
        the worker's own decoder (:func:`~headwater.wire.codec.encode_checked`): one the
        worker would refuse must fail alone, here, not close the connection there."""
        if isinstance(frame, GenerateRequest):
            data = encode_checked(frame, self.config.max_frame, self._mac)
        else:
            data = encode(frame, self.config.max_frame, self._mac)
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
            self._fail_idle_streams()
            if self._pong_seq < seq:
                if self._excused(sent):
                    log.warning(
                        "%s: heartbeat reply late while this loop was stalled; "
                        "not the worker's fault",
                        self.peer.worker_id,
                    )
                    continue
                self._break(f"no heartbeat reply within {cfg.heartbeat_timeout:g} s")
                return
            self.rtt = trio.current_time() - sent

    def _fail_idle_streams(self) -> None:
        """Fail the streams that had no reply for ``stream_timeout``, and cancel them."""
        limit = trio.current_time() - self.config.stream_timeout
        for key, route in list(self._routes.items()):
            if route.last < limit and isinstance(key, str):
                del self._routes[key]
                route.failure = Disconnected(
                    f"no reply for {self.config.stream_timeout:g} s on an open connection"
                )
                route.send.close()
                self._cancel_quietly(key)

    # -- receiving --

    async def _reader(self) -> None:
        decoder = self._decoder
        try:
            self._dispatch_all(decoder.feed(b""))  # what came with the end of the handshake
        except ProtocolError as exc:
            self._break(f"protocol error from the worker: {exc.message}")
            return
        while True:
            try:
                data = await self._stream.receive_some(read_size(decoder, self.config.receive_size))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                reason = tls_reason(exc)
                if reason is not None and "EOF" in reason:  # TLS, closed without close_notify
                    self._break("the worker closed the connection")
                else:
                    self._break(f"read failed: {reason or repr(exc)}")
                return
            if not data:
                self._break("the worker closed the connection")
                return
            try:
                frames = decoder.feed(data)
            except ProtocolError as exc:
                self._break(f"protocol error from the worker: {exc.message}")
                return
            del data
            self._read_at = trio.current_time()  # one clock read per batch of frames
            self._dispatch_all(frames)
            del frames

    def _dispatch_all(self, frames: list[Frame]) -> None:
        """Dispatch *frames*, holding none of them after (a ``kv_data`` piece's payload
        buffer is reused only once nothing holds it)."""
        for frame in frames:
            self._dispatch(frame)
        frames.clear()

    def _dispatch(self, frame: Frame) -> None:
        match frame:
            case Ack() | Chunk() | End() | Error():
                self._deliver(frame.request_id, frame)
            case KvData() | KvPrompt():
                self._deliver(frame.transfer_id, frame)
            case Pong():
                if frame.load is not None:
                    self.load = frame.load
                if frame.seq == self._ping_seq:
                    self._pong_seq = frame.seq
                    self._pong.set()
            case Stats():
                self._deliver(("stats", frame.seq), frame)
            case KvEvents():
                self._deliver(("kv", frame.seq), frame)
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
            # Its stream already left; late replies are expected after a cancel. A
            # prefill's KV handle among them is one nobody will pull: say so, or the
            # worker holds that KV until its transfer timeout.
            if isinstance(frame, Chunk) and frame.kv_handle is not None:
                with suppress(Disconnected):
                    self.send_frame(KvRelease(frame.kv_handle.transfer_id))
            return
        route.last = self._read_at
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
    async def route(self, key: str | tuple[str, int], opening: Frame) -> AsyncIterator[_Route]:
        """Open the route for *key*, send *opening* on it, and yield the route.

        Raises CannotConnect (the connection is closing or lost), WorkerError
        (``invalid_request``: the frame is too large, or the worker could not read it;
        *key* is in use). Leaving the block before the route's exchange is ``done`` sends
        a cancel for a request or KV pull.
        """
        route = self._open_route(key)
        try:
            try:
                self.send_frame(opening)
            except (ProtocolError, ValueError) as exc:
                route.done = True  # never sent: nothing to cancel
                message = exc.message if isinstance(exc, ProtocolError) else str(exc)
                raise WorkerError(
                    ErrorCode.INVALID_REQUEST, f"the request cannot go to a worker: {message}"
                ) from exc
            except Disconnected as exc:
                route.done = True
                raise CannotConnect(str(exc)) from exc
            yield route
        finally:
            self._close_route(key, route)
            if not route.done and isinstance(key, str):
                self._cancel_quietly(key)

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        """Send *request*; enter once ACKed, yielding its chunks (see the module docstring).

        Raises :class:`AckTimeout`, CannotConnect (connection closing or lost before
        the ACK), WorkerError (refused, or the frame is too large). Leaving before
        the End sends a cancel.
        """
        async with self.route(request.request_id, self._outgoing(request)) as route:
            stream = _TcpResponseStream(route)
            try:
                sent = trio.current_time()
                with trio.move_on_after(self.config.ack_timeout) as ack_scope:
                    try:
                        first = await route.next()
                    except Disconnected as exc:
                        route.done = True
                        raise CannotConnect(f"no ACK, connection lost: {exc}") from exc
                if ack_scope.cancelled_caught:
                    # After a stall of our own loop the ACK may be in the socket, with the
                    # reader (and the canary that saw the stall) due in this same batch.
                    await trio.lowlevel.checkpoint()
                    ready = route.ready()
                    if ready is None:
                        raise AckTimeout(
                            f"no ACK from {self.peer.worker_id} within "
                            f"{self.config.ack_timeout:g} s",
                            excused=self._excused(sent),
                        )
                    first = ready
                if isinstance(first, Error):
                    route.done = True
                    raise WorkerError(first.code, first.message)
                if not isinstance(first, Ack):
                    raise Disconnected(f"expected Ack, got {type(first).__name__}")
                yield stream
            finally:
                route.done = route.done or stream.finished

    def _outgoing(self, request: GenerateRequest) -> GenerateRequest:
        """*request* as it goes on the wire: without its prompt's ids when it is a decode
        leg whose prefill worker holds that prompt (its handle's ``holds_prompt``, over
        the ``num_tokens`` it prefilled) and this worker takes the ids from its KV pull.
        Why: the prefill leg already carried the prompt (a 40k-token one is ~160 KB);
        sent again it cost this end an encode, a check and a write. The caller keeps
        the whole request, for a retry or a migration."""
        handle = request.kv_handle
        if (
            self.prompt_from_kv
            and handle is not None
            and handle.holds_prompt
            and handle.num_tokens == len(request.token_ids)
        ):
            return replace(request, token_ids=token_array())
        return request

    def _excused(self, since: float) -> bool:
        """A deadline that started at *since* passed while this loop was stalled."""
        attribution = self.attribution
        return attribution is not None and attribution.excuses(since, trio.current_time())

    def _cancel_quietly(self, key: str) -> None:
        with suppress(Disconnected):  # a closed connection has cancelled everything
            self.send_frame(Cancel(key))

    async def fetch_stats(self) -> dict[str, int | float | str | bool]:
        """The worker's counters (runtime, engine, plane), flat. Raises CannotConnect,
        Disconnected."""
        self._stats_seq += 1
        key = ("stats", self._stats_seq)
        async with self.route(key, GetStats(self._stats_seq)) as route:
            msg = await route.next()
        if not isinstance(msg, Stats):
            raise Disconnected(f"unexpected {type(msg).__name__} for a stats query")
        return msg.values

    async def poll_kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """The worker's KV events from *since* on (a dump when negative); None when it
        publishes none. Asks its stats first, once per connection, so that an older
        worker is never sent a ``kv_poll``. Raises CannotConnect, Disconnected."""
        if self.kv_events is None:
            self.kv_events = (await self.fetch_stats()).get("kv_events") is True
        if not self.kv_events:
            return None
        self._stats_seq += 1
        key = ("kv", self._stats_seq)
        async with self.route(key, KvPoll(self._stats_seq, since, limit)) as route:
            msg = await route.next()
        if not isinstance(msg, KvEvents):
            raise Disconnected(f"unexpected {type(msg).__name__} for a KV events poll")
        return msg.batch


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

    Until the worker has proved the secret its frames are capped at
    ``HANDSHAKE_MAX_FRAME``, as the worker caps ours: a stranger posing as a worker
    cannot make a client buffer ``max_frame``. Frames are read one at a time, so that
    those after the hello_ok are read with the session's key set.
    """
    try:
        handshake = ClientHandshake(role=role, peer_id=peer_id, model=expect_model, secret=secret)
        decoder = FrameDecoder(min(config.max_frame, HANDSHAKE_MAX_FRAME))
        await stream.send_all(encode(handshake.start()))
        data: bytes | bytearray = b""
        while handshake.peer is None:
            frames = decoder.feed(data, limit=1)
            data = b""
            if not frames:
                data = await stream.receive_some(config.receive_size)
                if not data:
                    hint = (
                        ""
                        if isinstance(stream, trio.SSLStream)
                        else (" (a worker that requires TLS does that to a client without it)")
                    )
                    raise CannotConnect(
                        f"the worker closed the connection during the handshake{hint}"
                    )
                continue
            reply = handshake.receive(frames[0])
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
        decoder.max_frame = config.max_frame
        session = handshake.session
        if session is not None:
            decoder.mac = session.receive
        return PlaneConnection(
            stream, peer, decoder, config, session.send if session is not None else None
        )
    except BaseException as exc:
        await trio.aclose_forcefully(stream)
        if isinstance(exc, AuthError | ProtocolError):
            if not isinstance(stream, trio.SSLStream) and exc.code == "frame_too_large":
                # What a TLS worker's first bytes look like as a frame header.
                raise HandshakeFailed(
                    f"handshake failed: {exc.message} (is the worker using TLS?)", exc.code
                ) from exc
            raise HandshakeFailed(f"handshake failed: {exc.message}", exc.code) from exc
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
            if (reason := tls_reason(exc)) is not None:
                # TLS 1.3: the worker checks our certificate after our side of the TLS
                # handshake ended, so its refusal arrives as the first read fails: an
                # alert, or (trio does not flush one on a failed handshake) an EOF.
                if "EOF" in reason:
                    reason = "it closed the TLS connection (does it accept this end's certificate?)"
                raise HandshakeFailed(f"TLS: refused by the worker: {reason}", "tls") from exc
            raise CannotConnect(f"connection lost during the handshake: {exc!r}") from exc
        raise


def tcp_connector(address: str, tls: TlsConfig | None = None) -> Connector:
    """A :data:`Connector` for ``tcp://host:port``, over TLS with *tls* (the worker's
    certificate must name *host*). Raises ValueError on a bad address."""
    host, port = parse_tcp_address(address)
    if tls is None:
        return partial(_open_tcp_stream, host, port)
    return partial(_open_tls_stream, host, port, tls)


async def _open_tcp_stream(host: str, port: int) -> trio.SocketStream:
    """TCP, without trio's send watermark (:mod:`headwater.plane.sockets`). Raises OSError."""
    stream = await trio.open_tcp_stream(host, port)
    unthrottle(stream)
    return stream


async def _open_tls_stream(
    host: str, port: int, tls: TlsConfig
) -> trio.SSLStream[trio.SocketStream]:
    """TCP, then the TLS handshake. Raises OSError (connect), HandshakeFailed (``tls``)."""
    tcp = await _open_tcp_stream(host, port)
    stream = trio.SSLStream(tcp, tls.client_context(), server_hostname=host)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tcp)
        reason = tls_reason(exc) or "the worker closed the connection (is it using TLS?)"
        raise HandshakeFailed(f"TLS handshake with {host}:{port} failed: {reason}", "tls") from exc
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream


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
