"""The worker's side of the TCP request plane, in front of one :class:`RequestHandler`.

One task per connection reads and decodes frames; one writer task per connection
frames the replies of all its requests back. A request is handed to
``handler.submit`` (the worker runtime) as soon as it is decoded, with a send channel
that queues its replies for the writer; the runtime sends the ACK first, before any
engine work.

Per connection::

    reader ── request ─▶ handler.submit(request, _ReplyChannel) ─┐
           ── cancel  ─▶ handler.cancel(request_id)              ├─▶ queue ─▶ writer ─▶ socket
           ── kv_pull ─▶ serve_pull(kv_source, ...) ─────────────┘   (headwater.plane.kv)
           ── ping / get_stats ─▶ pong / stats (control frames skip the reply budget)

TLS: with a :class:`~headwater.plane.tls.TlsConfig` every connection is a
``trio.SSLStream`` whose peer must present a certificate from the CA; the TLS handshake
is part of ``handshake_timeout``, and a failed one is logged and counted
(``tls_failures_total``). The secret's handshake follows, inside TLS.

Session binding: with a secret, every frame after the handshake is authenticated with
the session's keys (:mod:`headwater.wire.session`); one that fails (a relay's injected,
replayed or altered frame) closes the connection like any protocol error, and counts as
an auth failure.

Isolation: a request frame that arrived whole but does not read, while its id does,
fails that request alone (an ``error`` with ``invalid_request``, counted in
``requests_refused_total``): the connection and its other requests go on. A connection
that sends garbage, an oversize or unknown frame gets an error frame and is closed;
its requests are cancelled and every other connection carries on. A peer that
vanishes (EOF, reset, stops reading for ``write_timeout``, or sends nothing at all for
``heartbeat_timeout``) has its requests and KV pulls cancelled the same way, which
frees their KV.

Connections: at most ``max_connections_per_address`` per peer IP address and
``max_connections`` in all (by default half the process's descriptor limit, at most
4096); one more is closed as soon as it is accepted, before TLS or a byte is read, and
counted (``connections_refused_total``). A connection that has not completed the
handshake within ``handshake_timeout`` is closed. So a stranger's silent connections
can neither exhaust the worker's descriptors nor, from one address, crowd out the
frontends.

Liveness: every client of the plane (:class:`~headwater.plane.connection.PlaneConnection`:
frontends and KV-pulling workers alike) pings every ``heartbeat_interval`` (5 s),
so a live peer is never silent for long. A peer that vanished without closing (its
host died, a partition) leaves no EOF and, while its requests' replies still fit
the socket buffers, no blocked write either; a watchdog task per connection drops a
connection once nothing arrived on it for ``heartbeat_timeout``.

Backpressure: replies of all requests on a connection share a budget of
``send_queue`` queued frames, KV payload pieces a budget of ``kv_queue``; a
connection whose peer reads slowly slows its own requests, nobody else's.
"""

from __future__ import annotations

import logging
import resource
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass

import trio

from headwater.config_fields import non_negative_int, option, positive_float
from headwater.plane.base import RequestHandler
from headwater.plane.kv import KvSource, serve_pull
from headwater.plane.sockets import unthrottle
from headwater.plane.tls import TlsConfig, tls_reason
from headwater.wire import Cancel, Error, ErrorCode, GenerateRequest, Reply, Role, WorkerLoad
from headwater.wire.addresses import is_loopback
from headwater.wire.capabilities import Capabilities
from headwater.wire.codec import FrameDecoder, encode, encode_parts, read_size
from headwater.wire.errors import ProtocolError
from headwater.wire.frames import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    PROTOCOL_VERSION,
    Fault,
    Frame,
    GetStats,
    GoAway,
    Hello,
    HelloOk,
    KvData,
    KvEvents,
    KvPoll,
    KvPrompt,
    KvPull,
    KvRelease,
    Ping,
    Pong,
    Stats,
    Unreadable,
)
from headwater.wire.handshake import ServerHandshake
from headwater.wire.kv_events import KvEventBatch
from headwater.wire.session import FrameMac

log = logging.getLogger(__name__)

#: A KV event number far past any real one: reading there answers a gap, or None when
#: the runtime publishes no events.
_NO_EVENT = 1 << 62
#: Most KV events one ``kv_events`` frame carries, whatever the poll asks.
_POLL_LIMIT = 4096

_COALESCE_BYTES = 256 * 1024
_SEND_ALONE_BYTES = 64 * 1024  # a part this large is sent as it is, not joined
_FAULT_GRACE = 1.0  # s to flush a final error frame before closing


class InsecureBind(ValueError):
    """Refused: listening beyond loopback without a plane secret."""


def check_bind(host: str, secret: bytes | None) -> None:
    """Raise :class:`InsecureBind` unless *host* is loopback or a secret is set.

    Off loopback anyone who can reach the port could submit work or pull KV, so a
    worker proves a shared secret with every peer there.
    """
    if secret is None and not is_loopback(host):
        raise InsecureBind(
            f"refusing to listen on {host!r} without a plane secret: set "
            "HEADWATER_PLANE_SECRET or --plane-secret-file, or listen on 127.0.0.1"
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and timeouts of the worker's side of the TCP request plane."""

    #: Largest frame accepted or sent (bytes); frontends must use the same limit.
    max_frame: int = DEFAULT_MAX_FRAME
    #: Seconds a new connection has to complete the handshake.
    handshake_timeout: float = 5.0
    #: Seconds one write may block (the peer stopped reading) before the connection
    #: is dropped and its requests cancelled.
    write_timeout: float = 10.0
    #: Seconds a connection may stay silent (not a byte: no frame, no ping) before
    #: the peer counts as gone: the connection is dropped and its requests and KV
    #: pulls cancelled. A client pings ``PlaneConfig.heartbeat_interval`` (5 s) after
    #: the previous pong, which it waits for up to its ``heartbeat_timeout`` (10 s):
    #: 15 s is the longest gap between the pings of a client that still counts the
    #: connection as alive, three normal intervals (a client loop may stall ~10 s),
    #: and the longest a client takes to give up on a silent worker, so both ends of
    #: a dead connection let go within the same bound. Keep it at least a client's
    #: interval plus its timeout.
    heartbeat_timeout: float = option(
        15.0,
        flags=("--peer-timeout",),
        type=positive_float,
        help="seconds a plane connection may stay silent (peers ping every 5 s) before the "
        "worker closes it and cancels its requests",
    )
    #: Reply frames queued per connection before request tasks wait for the writer.
    send_queue: int = 512
    #: KV payload pieces queued per connection (``kv_queue * kv_piece_bytes`` bytes).
    kv_queue: int = 4
    #: Size of one kv_data piece (bytes).
    kv_piece_bytes: int = 1024 * 1024
    #: Bytes asked of the socket per read.
    receive_size: int = 64 * 1024
    #: Connections open at once from one peer IP address; one more is closed as soon
    #: as it is accepted. A frontend host opens one per frontend process, a decode
    #: worker one per prefill worker: 64 leaves room, and keeps one address (a
    #: stranger's) from taking the worker's descriptors. 0: no limit.
    max_connections_per_address: int = option(
        64,
        type=non_negative_int,
        help="plane connections open at once per peer IP address; one more is closed as "
        "soon as it is accepted (0: no limit)",
    )
    #: Connections open at once in all; None: half the process's descriptor limit
    #: (RLIMIT_NOFILE), at most 4096, so that the engine, its logs and children keep
    #: theirs. 0: no limit.
    max_connections: int | None = option(
        None,
        type=non_negative_int,
        help="plane connections open at once in all (default: half the process's file "
        "descriptor limit, at most 4096; 0: no limit)",
    )

    def __post_init__(self) -> None:
        if self.max_connections_per_address < 0 or (self.max_connections or 0) < 0:
            raise ValueError("connection limits must be >= 0 (0: no limit)")

    def connection_limit(self) -> int:
        """``max_connections``, resolved (0: no limit)."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return 4096 if soft == resource.RLIM_INFINITY else max(1, min(4096, soft // 2))


@dataclass(frozen=True, slots=True)
class ServerStats:
    connections: int
    connections_total: int
    #: Connections closed at once on accept: over ``max_connections_per_address`` or
    #: ``max_connections``.
    connections_refused_total: int
    protocol_errors_total: int
    auth_failures_total: int
    #: Request frames that arrived whole but did not read (their id did): each failed
    #: alone, the connection kept.
    requests_refused_total: int
    #: TLS handshakes that failed (no or a refused client certificate, not TLS at all).
    tls_failures_total: int
    #: Connections dropped because nothing arrived for ``heartbeat_timeout``.
    peer_timeouts_total: int
    #: Connections dropped because a write blocked for ``write_timeout``.
    write_timeouts_total: int
    kv_pulls_served_total: int
    kv_pulls_failed_total: int
    kv_bytes_served_total: int


#: The worker's own counters for the stats frame (must be cheap and never block).
StatsProvider = Callable[[], dict[str, int | float | str | bool]]
#: The worker's load for its heartbeat answers (must be cheap and never block).
LoadProvider = Callable[[], WorkerLoad]


class PlaneServer:
    """The TCP request plane in front of one :class:`RequestHandler`.

    :meth:`serve` accepts on listeners the caller opened (so it can learn the port,
    and give the engine its transfer address, before serving); :meth:`handle_stream`
    serves one already-accepted stream of any kind. Cancelling :meth:`serve` closes
    every connection and cancels their requests. *kv_source* answers KV pulls (a
    prefill engine); without one every pull is refused. *stats* adds the worker's
    counters (runtime, engine) to the ``stats`` frame; *load* goes with every heartbeat
    answer, so that frontends see how busy the worker is. With *tls* :meth:`serve`
    speaks mutual TLS on every listener (:mod:`headwater.plane.tls`). *capabilities*,
    the engine's declaration, goes to every peer in the handshake.
    """

    def __init__(
        self,
        runtime: RequestHandler,
        *,
        role: Role,
        model: str,
        secret: bytes | None = None,
        config: ServerConfig | None = None,
        kv_source: KvSource | None = None,
        stats: StatsProvider | None = None,
        load: LoadProvider | None = None,
        tls: TlsConfig | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.runtime = runtime
        self.tls = tls
        self.config = config or ServerConfig()
        self.identity = HelloOk(PROTOCOL_VERSION, str(role), runtime.worker_id, model, capabilities)
        self.secret = secret
        self.kv_source = kv_source
        self.stats = stats
        self.load = load
        self.draining = False
        self._connections: set[_Connection] = set()
        self._connections_total = 0
        self._per_address: Counter[str] = Counter()
        self._open = 0  # accepted and not yet closed, refused ones aside
        self._refused = 0
        self._refusal_logged_at = -float("inf")
        self._protocol_errors = 0
        self._auth_failures = 0
        self._requests_refused = 0
        self._tls_failures = 0
        self._peer_timeouts = 0
        self._write_timeouts = 0
        self._pulls_served = 0
        self._pulls_failed = 0
        self._kv_bytes = 0
        self._zeros = memoryview(bytes(self.config.kv_piece_bytes))

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on *listeners* until cancelled (over TLS with ``tls``);
        reports them started."""
        accepting: list[trio.abc.Listener[trio.abc.Stream]] = list(listeners)
        if self.tls is not None:
            context = self.tls.server_context()
            accepting = [trio.SSLListener(listener, context) for listener in listeners]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self.handle_stream, accepting)
            task_status.started(listeners)

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it ends (or close it at once, over a connection
        limit). Never raises (except Cancelled)."""
        address = _peer_host(stream)
        if not self._admit(address):
            await trio.aclose_forcefully(stream)
            return
        self._open += 1
        self._per_address[address] += 1
        try:
            unthrottle(stream)
            conn = _Connection(self, stream)
            self._connections.add(conn)
            self._connections_total += 1
            try:
                await conn.run()
            except Exception:
                log.exception("connection from %s failed", conn.peer_name)
            finally:
                self._connections.discard(conn)
        finally:
            self._open -= 1
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]

    def _admit(self, address: str) -> bool:
        """Whether one more connection from *address* is within the limits; counts and
        logs (at most once a second) a refusal."""
        cfg = self.config
        per_address, total = cfg.max_connections_per_address, cfg.connection_limit()
        if (not per_address or not address or self._per_address[address] < per_address) and (
            not total or self._open < total
        ):
            return True
        self._refused += 1
        now = trio.current_time()
        if now - self._refusal_logged_at >= 1.0:
            self._refusal_logged_at = now
            log.warning(
                "refusing a plane connection from %s: %d open from it, %d in all "
                "(limits %s and %s; %d refused so far)",
                address,
                self._per_address[address],
                self._open,
                per_address or "none",
                total or "none",
                self._refused,
            )
        return False

    def goaway(self, reason: str = "shutting down") -> None:
        """Tell every peer, now and from now on, to send no new requests here.

        Connections stay open: in-flight requests finish and KV pulls still work.
        """
        self.draining = True
        for conn in self._connections:
            conn.goaway(reason)

    async def close_connections(self, grace: float) -> None:
        """Flush what every connection has queued, then close them all.

        Call after the runtime drained: a request counts as done once its End is
        queued, and closing without this would drop the frames still in the queue.
        Waits at most *grace* seconds, then closes regardless.
        """
        with trio.move_on_after(grace):
            async with trio.open_nursery() as nursery:
                for conn in list(self._connections):
                    nursery.start_soon(conn.flush_and_close)
        for conn in list(self._connections):
            conn.abort()

    def statistics(self) -> ServerStats:
        return ServerStats(
            connections=len(self._connections),
            connections_total=self._connections_total,
            connections_refused_total=self._refused,
            protocol_errors_total=self._protocol_errors,
            auth_failures_total=self._auth_failures,
            requests_refused_total=self._requests_refused,
            tls_failures_total=self._tls_failures,
            peer_timeouts_total=self._peer_timeouts,
            write_timeouts_total=self._write_timeouts,
            kv_pulls_served_total=self._pulls_served,
            kv_pulls_failed_total=self._pulls_failed,
            kv_bytes_served_total=self._kv_bytes,
        )

    def load_report(self) -> WorkerLoad | None:
        """The load to put in a heartbeat answer; None without a provider."""
        if self.load is None:
            return None
        try:
            return self.load()
        except Exception:
            log.exception("load provider failed; disabled")
            self.load = None
            return None

    def stats_values(self) -> dict[str, int | float | str | bool]:
        """Identity, the worker's counters and the plane's, flat, for the ``stats`` frame."""
        values: dict[str, int | float | str | bool] = {
            "worker_id": self.identity.worker_id,
            "role": self.identity.role,
            "model": self.identity.model,
        }
        if self.stats is not None:
            try:
                values.update(self.stats())
            except Exception:
                log.exception("stats provider failed; disabled")
                self.stats = None
        values.update({f"plane_{k}": v for k, v in asdict(self.statistics()).items()})
        # Whether ``kv_poll`` is answered: a frontend asks before polling, so that it
        # never sends an older worker a frame kind it would refuse.
        values["kv_events"] = self.kv_events(_NO_EVENT, 1) is not None
        return values

    def kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """The runtime's KV events (None: its engine publishes none, or the runtime
        predates them)."""
        read = getattr(self.runtime, "kv_events", None)
        return read(since, limit) if read is not None else None


class _ReplyChannel(trio.abc.SendChannel[Reply]):
    """What the runtime sends one request's replies into: the connection's queue."""

    def __init__(self, conn: _Connection, request_id: str) -> None:
        self._conn = conn
        self.request_id = request_id
        self._closed = False

    async def send(self, value: Reply) -> None:
        if self._closed:
            raise trio.ClosedResourceError
        await self._conn.queue_reply(value)

    async def aclose(self) -> None:
        self._closed = True
        self._conn.request_done(self)
        await trio.lowlevel.checkpoint()


class _Connection:
    def __init__(self, server: PlaneServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.peer_name = _peer_name(stream)
        cfg = server.config
        self.decoder = FrameDecoder(min(cfg.max_frame, HANDSHAKE_MAX_FRAME))  # until hello_ok
        self._mac: FrameMac | None = None  # signs what this end sends, with a secret
        # Unbounded queue of (frame, budget it holds a token of): reply and KV frames
        # take a token first, so only tiny control frames (pong, stats, goaway,
        # refusals) bypass the bound; the writer returns tokens as it takes frames.
        self._out_send, self._out_recv = trio.open_memory_channel[
            tuple[Frame, trio.Semaphore | None]
        ](float("inf"))
        self._reply_budget = trio.Semaphore(cfg.send_queue)
        self._kv_budget = trio.Semaphore(cfg.kv_queue)
        self._requests: dict[str, _ReplyChannel] = {}
        self._pulls: dict[str, trio.CancelScope] = {}
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._writer_done = trio.Event()
        self._goaway_sent = False
        #: trio.current_time() when bytes last arrived (the watchdog's clock).
        self._heard_at = trio.current_time()
        self.peer: Hello | None = None

    # -- lifetime --

    async def run(self) -> None:
        fault: Fault | None = None
        try:
            with self._scope:
                if not await self._handshake():
                    return
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._heard_at = trio.current_time()
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._watchdog)
                    if self.server.draining:
                        self.goaway("shutting down")
                    try:
                        for frame in self.decoder.feed(b""):  # sent right after the auth
                            self._dispatch(frame)
                        await self._read_loop()
                    except ProtocolError as exc:
                        if exc.code == "unauthorized":
                            self.server._auth_failures += 1
                        fault = self._protocol_error(exc)
                    self._cancel_work()
                    if fault is not None:
                        self.send_control(fault)
                        with trio.move_on_after(_FAULT_GRACE):
                            await self._flush()
                    nursery.cancel_scope.cancel()
        finally:
            self._cancel_work()
            await trio.aclose_forcefully(self.stream)

    async def flush_and_close(self) -> None:
        """Stop taking frames, let the writer send what is queued, then close."""
        if self._nursery is not None:  # else still in the handshake: nothing queued
            await self._flush()
        self.abort()

    async def _flush(self) -> None:
        """Close the queue (later replies fail) and wait for the writer to empty it."""
        self._out_send.close()
        await self._writer_done.wait()

    def goaway(self, reason: str) -> None:
        if not self._goaway_sent:
            self._goaway_sent = True
            self.send_control(GoAway(reason))

    def abort(self) -> None:
        self._scope.cancel()

    def _cancel_work(self) -> None:
        for request_id in list(self._requests):
            self.server.runtime.cancel(request_id)
        for scope in self._pulls.values():
            scope.cancel()

    def _protocol_error(self, exc: ProtocolError) -> Fault:
        self.server._protocol_errors += 1
        log.warning("closing connection from %s: %s", self.peer_name, exc.message)
        return Fault(exc.code, exc.message)

    async def _handshake(self) -> bool:
        """Whether the peer completed the handshake (False: it failed or left).

        Frames are read one at a time, so that whatever follows the auth is read only
        once the session's key is set, and checked with it."""
        server = self.server
        handshake = ServerHandshake(server.identity, secret=server.secret)
        with trio.move_on_after(server.config.handshake_timeout):
            if isinstance(self.stream, trio.SSLStream) and not await self._tls_handshake():
                return False
            try:
                data: bytes | bytearray = b""
                while handshake.peer is None:
                    frames = self.decoder.feed(data, limit=1)
                    if not frames:
                        data = await self.stream.receive_some(server.config.receive_size)
                        if not data:
                            return False
                        continue
                    data = b""
                    reply = handshake.receive(frames[0])
                    await self.stream.send_all(encode(reply))
            except ProtocolError as exc:
                if exc.code == "unauthorized":
                    server._auth_failures += 1
                fault = self._protocol_error(exc)
                with trio.move_on_after(_FAULT_GRACE), suppress(trio.BrokenResourceError):
                    await self.stream.send_all(encode(fault))
                return False
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            self.peer = handshake.peer
            self.decoder.max_frame = server.config.max_frame
            if handshake.session is not None:
                self.decoder.mac = handshake.session.receive
                self._mac = handshake.session.send
            log.debug(
                "%s connected from %s as %s", self.peer.peer_id, self.peer_name, self.peer.role
            )
            return True
        log.info("handshake from %s timed out", self.peer_name)
        return False

    async def _tls_handshake(self) -> bool:
        """Whether the client's TLS handshake, its certificate checked, succeeded."""
        assert isinstance(self.stream, trio.SSLStream)
        try:
            await self.stream.do_handshake()
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.server._tls_failures += 1
            log.warning(
                "TLS handshake from %s failed: %s",
                self.peer_name,
                tls_reason(exc) or "the peer closed the connection",
            )
            return False

    # -- writing --

    async def _writer(self) -> None:
        timeout = self.server.config.write_timeout
        try:
            async for item in self._out_recv:
                batch = self._encode(*item)
                size = sum(map(len, batch))
                while size < _COALESCE_BYTES:
                    try:
                        item = self._out_recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    parts = self._encode(*item)
                    batch += parts
                    size += sum(map(len, parts))
                with trio.fail_after(timeout):
                    await self._send(batch)
        except trio.TooSlowError:
            self.server._write_timeouts += 1
            log.warning("%s stopped reading for %g s; closing", self.peer_name, timeout)
            self._scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._scope.cancel()
        finally:
            self._writer_done.set()

    async def _send(self, parts: list[bytes | memoryview]) -> None:
        """Send *parts* in order: small ones joined into one write, a large one (a KV
        payload's own buffer, :func:`encode_parts`) on its own, never copied."""
        small: list[bytes | memoryview] = []
        for part in parts:
            if len(part) < _SEND_ALONE_BYTES:
                small.append(part)
                continue
            if small:
                await self.stream.send_all(small[0] if len(small) == 1 else b"".join(small))
                small = []
            await self.stream.send_all(part)
        if small:
            await self.stream.send_all(small[0] if len(small) == 1 else b"".join(small))

    def _encode(self, frame: Frame, budget: trio.Semaphore | None) -> list[bytes | memoryview]:
        if budget is not None:
            budget.release()
        try:
            return encode_parts(frame, self.server.config.max_frame, self._mac)
        except (ValueError, ProtocolError) as exc:
            # The engine produced something unsendable: fail that request alone.
            rid = str(getattr(frame, "request_id", None) or getattr(frame, "transfer_id", "?"))
            log.error("cannot encode %s for %s: %s", type(frame).__name__, rid, exc)
            self.server.runtime.cancel(rid)
            error = Error(rid, ErrorCode.INTERNAL, f"unencodable reply: {exc}")
            return [encode(error, self.server.config.max_frame, self._mac)]

    async def queue_reply(self, frame: Frame) -> None:
        """Queue a reply, waiting only when the budget is spent.

        Not a schedule point while there is budget (cancellation is still checked):
        an Ack, the first chunk and an End produced in one engine step then leave in
        one write instead of three. Raises ClosedResourceError once closing.
        """
        budget = self._kv_budget if isinstance(frame, KvData | KvPrompt) else self._reply_budget
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            budget.acquire_nowait()
        except trio.WouldBlock:
            await budget.acquire()
        try:
            self._out_send.send_nowait((frame, budget))
        except BaseException:
            budget.release()
            raise

    def send_control(self, frame: Frame) -> None:
        """Queue a small frame outside the reply budget; dropped once closing."""
        with suppress(trio.ClosedResourceError):
            self._out_send.send_nowait((frame, None))

    # -- reading --

    async def _watchdog(self) -> None:
        """Close the connection once nothing arrived for ``heartbeat_timeout``.

        Sleeps until the deadline the last arrival set, and again if bytes came
        meanwhile: one wake-up per timeout period on a busy connection, none per read.
        """
        timeout = self.server.config.heartbeat_timeout
        while True:
            await trio.sleep_until(self._heard_at + timeout)
            if trio.current_time() < self._heard_at + timeout:
                continue
            # After a stall of our own loop the peer's ping may be sitting in the
            # socket with the reader scheduled in this same batch: let it run first.
            await trio.lowlevel.checkpoint()
            if trio.current_time() >= self._heard_at + timeout:
                break
        self.server._peer_timeouts += 1
        who = self.peer.peer_id if self.peer is not None else "?"
        log.warning(
            "nothing from %s (%s) for %g s; closing its connection and cancelling its %d requests",
            who,
            self.peer_name,
            timeout,
            len(self._requests),
        )
        self._scope.cancel()

    async def _read_loop(self) -> None:
        size = self.server.config.receive_size
        while True:
            try:
                data = await self.stream.receive_some(read_size(self.decoder, size))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self._heard_at = trio.current_time()
            for frame in self.decoder.feed(data):
                self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        match frame:
            case GenerateRequest():
                self._submit(frame)
            case Unreadable():
                self._refuse(frame)
            case Cancel():
                if frame.request_id in self._requests:
                    self.server.runtime.cancel(frame.request_id)
                scope = self._pulls.get(frame.request_id)
                if scope is not None:
                    scope.cancel()
            case Ping():
                self.send_control(Pong(frame.seq, self.server.load_report()))
            case Pong():
                pass
            case KvPull():
                assert self._nursery is not None
                self._nursery.start_soon(self._serve_pull, frame.transfer_id, frame.prompt)
            case KvRelease():
                self.server.runtime.release_kv(frame.transfer_id)
            case GetStats():
                self.send_control(Stats(frame.seq, self.server.stats_values()))
            case KvPoll():
                # Answered from the engine's bounded ring, at once: a poll never waits
                # for the engine, and the engine never waits for a poll.
                batch = self.server.kv_events(frame.since, min(frame.limit, _POLL_LIMIT))
                if batch is None:
                    batch = KvEventBatch(frame.since, frame.since, gap=True)
                self.send_control(KvEvents(frame.seq, batch))
            case _:
                raise ProtocolError(f"unexpected {type(frame).__name__} from a client")

    def _submit(self, request: GenerateRequest) -> None:
        rid = request.request_id
        if rid in self._requests:
            self.send_control(Error(rid, ErrorCode.INVALID_REQUEST, "duplicate request id"))
            return
        channel = _ReplyChannel(self, rid)
        self._requests[rid] = channel
        try:
            self.server.runtime.submit(request, channel)
        except RuntimeError as exc:
            del self._requests[rid]
            self.send_control(Error(rid, ErrorCode.SHUTTING_DOWN, str(exc)))

    def _refuse(self, frame: Unreadable) -> None:
        """Fail a request whose frame did not read; the connection goes on."""
        self.server._requests_refused += 1
        log.warning(
            "refusing request %s from %s: %s", frame.request_id, self.peer_name, frame.reason
        )
        if frame.request_id in self._requests:  # not ours to end: the peer reused an id
            message = "duplicate request id"
        else:
            message = f"the worker could not read this request: {frame.reason}"
        self.send_control(Error(frame.request_id, ErrorCode.INVALID_REQUEST, message))

    def request_done(self, channel: _ReplyChannel) -> None:
        if self._requests.get(channel.request_id) is channel:
            del self._requests[channel.request_id]

    async def _serve_pull(self, transfer_id: str, prompt: bool) -> None:
        server = self.server
        if transfer_id in self._pulls:
            self.send_control(Error(transfer_id, ErrorCode.INVALID_REQUEST, "duplicate pull"))
            return
        scope = self._pulls[transfer_id] = trio.CancelScope()
        try:
            with scope:
                size = await serve_pull(
                    server.kv_source,
                    transfer_id,
                    self.queue_reply,
                    piece=server._zeros,
                    prompt=prompt,
                )
                if size:
                    server._pulls_served += 1
                    server._kv_bytes += size
                else:
                    server._pulls_failed += 1
        except trio.ClosedResourceError:
            pass  # the connection is closing; the peer sees its pull fail
        finally:
            del self._pulls[transfer_id]


def _peer_host(stream: trio.abc.Stream) -> str:
    """The peer's IP address ("" when the stream has none: a memory stream, a Unix
    socket), what the per-address limit counts."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    sock = getattr(stream, "socket", None)
    try:
        peer = sock.getpeername() if sock is not None else None
    except (OSError, ValueError, TypeError):
        return ""
    return str(peer[0]) if isinstance(peer, tuple) else ""


def _peer_name(stream: trio.abc.Stream) -> str:
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    sock = getattr(stream, "socket", None)
    if sock is None:
        return type(stream).__name__
    try:
        host, port, *_ = sock.getpeername()
    except (OSError, ValueError, TypeError):
        return "?"
    return f"{host}:{port}"
