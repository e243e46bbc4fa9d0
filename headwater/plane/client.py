"""The TCP client for one worker: reconnects, backoff, routing state.

:class:`TcpWorkerClient` is the TCP twin of :class:`~headwater.plane.memory.MemoryWorkerClient`:
same contract, same errors. It keeps one persistent connection to its worker (a
:class:`~headwater.plane.connection.PlaneConnection`, the layer it shares with the
workers' KV transfer) and multiplexes every concurrent request over it. Its tasks
need an owner, so the client has a :meth:`~TcpWorkerClient.run` method to start in
a nursery (:func:`connect_worker` does both)::

    client = await connect_worker(instance, nursery, secret=secret)   # connected
    async with client.stream(request) as chunks:   # entered once the worker ACKed
        async for chunk in chunks: ...
    await client.aclose()   # ends run(); in-flight streams fail with Disconnected

Behaviour (all times from :class:`~headwater.plane.connection.PlaneConfig`):

* connecting: TCP connect (and TLS, with ``PlaneConfig.tls``) plus handshake within
  ``connect_timeout``, else ``ConnectTimeout``. A broken connection is re-opened at once, then with
  exponential backoff; while backing off ``stream()`` fails fast with CannotConnect
  (the router then routes elsewhere) instead of queueing behind a dead worker.
* ACK timeout, heartbeats, cancellation and slow consumers: see
  :mod:`headwater.plane.connection`.
* a worker's ``goaway`` puts the client in ``DRAINING``: in-flight streams finish,
  new ones fail with CannotConnect.
"""

from __future__ import annotations

import enum
import logging
import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import trio
from trio_util import AsyncValue

from headwater.instrumentation.attribution import StallAttribution
from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    ResponseStream,
    WorkerClient,
    WorkerInstance,
)
from headwater.plane.connection import (
    Connector,
    PlaneConfig,
    PlaneConnection,
    dial,
    tcp_connector,
)
from headwater.wire import GenerateRequest, KvHandle, WorkerLoad
from headwater.wire.capabilities import Capabilities
from headwater.wire.frames import KvRelease
from headwater.wire.handshake import load_secret
from headwater.wire.kv_events import KvEventBatch

log = logging.getLogger(__name__)


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
        attribution: StallAttribution | None = None,
    ) -> None:
        """*attribution* excuses a missed ACK or heartbeat when this loop stalled."""
        self.instance = instance
        self.attribution = attribution
        self.config = config or PlaneConfig()
        self.client_id = client_id or f"frontend-{uuid.uuid4().hex[:8]}"
        self._secret = secret
        self._connector = connector or tcp_connector(instance.address, self.config.tls)
        self._rng = rng or random.Random()
        self._scope = trio.CancelScope()
        self._state = AsyncValue(ClientState.IDLE)
        self._conn: PlaneConnection | None = None
        self._declared: Capabilities | None = None
        self._retry_at = 0.0
        self._last_error: str | None = None
        self._last_failure: CannotConnect | None = None  # why the last connect failed
        self._connects = 0
        self._connect_failures = 0
        self._disconnects = 0

    @property
    def state(self) -> ClientState:
        state: ClientState = self._state.value
        return state

    def _set_state(self, state: ClientState) -> None:
        self._state.value = state

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a connection to the worker open until :meth:`aclose` (or cancellation).

        Reports started at once; the first connect happens in the background and
        ``stream()`` calls meanwhile wait for it. May be called once.
        """
        if self.state is not ClientState.IDLE:
            raise RuntimeError(f"TcpWorkerClient.run() called in state {self.state}")
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
                    # A static entry without id= names the worker by address only.
                    expect_worker_id=self.instance.metadata.get(
                        "expect_worker_id", self.instance.worker_id
                    ),
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
                    self.instance.worker_id,
                    self.instance.address,
                    exc,
                    delay,
                )
                await trio.sleep(delay)
                continue
            if self._connects:  # the first connect is the caller's to report
                log.info(
                    "reconnected to %s at %s after %d failed attempts",
                    self.instance.worker_id,
                    self.instance.address,
                    failures,
                )
            failures = 0
            self._connects += 1
            conn.attribution = self.attribution
            await nursery.start(conn.run)
            self._conn = conn
            # Kept between connections: a worker restarted under its id says it again.
            self._declared = conn.peer.capabilities
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
        delay = min(cfg.backoff_max, cfg.backoff_initial * 2.0 ** (failures - 1))
        return delay * (1 - cfg.backoff_jitter * self._rng.random())

    async def _connection(self) -> PlaneConnection:
        while True:
            state, conn = self.state, self._conn
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
            await self._state.wait_transition()  # CONNECTING: bounded by connect_timeout

    async def wait_connected(self) -> None:
        """Wait for the current connection attempt; raises CannotConnect if it failed,
        with the attempt's own error (ConnectTimeout, HandshakeFailed, ...) as cause."""
        await self._connection()

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        conn = await self._connection()
        async with conn.stream(request) as replies:
            yield replies

    @property
    def load(self) -> WorkerLoad | None:
        """The load the worker sent with its last heartbeat answer on this connection."""
        conn = self._conn
        return conn.load if conn is not None else None

    @property
    def capabilities(self) -> Capabilities:
        """What the worker declared in its last handshake; before one, or from a worker
        that declares nothing, what discovery said (see :class:`WorkerClient`)."""
        return self._declared or super().capabilities

    @property
    def reachable(self) -> bool:
        """Connected, the connection alive by its heartbeats (a draining one is not:
        the worker said goodbye)."""
        conn = self._conn
        live = conn is not None and not conn.unusable.is_set()
        return live and self.state is ClientState.CONNECTED

    async def wait_lost(self) -> None:
        """Return once the current connection is lost: a heartbeat timeout, a reset,
        the worker's goaway, or :meth:`aclose`."""
        await self._state.wait_value(lambda state: state is not ClientState.CONNECTED)

    def release_kv(self, handle: KvHandle) -> None:
        """Queue a ``kv_release`` on the live connection (a draining one too: the
        worker still holds the KV). Without one there is nothing to do: a worker we
        cannot reach frees the KV at its transfer timeout, or is gone with it."""
        conn = self._conn
        if conn is None or conn.unusable.is_set():
            return
        with suppress(Disconnected):
            conn.send_frame(KvRelease(handle.transfer_id))

    async def probe(self) -> None:
        """A stats round trip over the live connection (it goes through the worker's
        reader and back, as a request would). Raises CannotConnect, Disconnected."""
        await self.fetch_stats()

    async def fetch_stats(self) -> dict[str, int | float | str | bool]:
        """The worker's counters over the live connection. Raises CannotConnect,
        Disconnected."""
        conn = await self._connection()
        return await conn.fetch_stats()

    async def poll_kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """The worker's KV events over the live connection (see
        :meth:`PlaneConnection.poll_kv_events`)."""
        conn = await self._connection()
        return await conn.poll_kv_events(since, limit)

    async def aclose(self) -> None:
        """Stop :meth:`run`; in-flight streams fail with Disconnected."""
        if self.state is ClientState.IDLE:
            self._set_state(ClientState.CLOSED)
        self._scope.cancel()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> TcpClientStats:
        conn = self._conn
        return TcpClientStats(
            state=self.state,
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
    attribution: StallAttribution | None = None,
) -> TcpWorkerClient:
    """A connected :class:`TcpWorkerClient` for *instance* (``tcp://host:port``).

    The client's tasks run in *nursery*; by default in the nursery that owns the
    calling task, so a discovery membership that calls ``connect_worker(instance)``
    from its own tasks keeps its clients alive exactly as long as itself. *secret*
    defaults to ``$HEADWATER_PLANE_SECRET`` (None when unset).

    Returns once the first connection is up. Raises CannotConnect whose ``__cause__``
    is the attempt's error (then nothing is left running), ValueError for an address
    that is not ``tcp://host:port``. Close the client with ``await client.aclose()``
    when the worker goes away.
    """
    if nursery is None:
        task = trio.lowlevel.current_task()
        nursery = task.eventual_parent_nursery or task.parent_nursery
        if nursery is None:
            raise RuntimeError("connect_worker() needs a nursery here")
    if secret is None:
        secret = load_secret()
    client = TcpWorkerClient(
        instance, secret=secret, config=config, client_id=client_id, attribution=attribution
    )
    await nursery.start(client.run)
    try:
        await client.wait_connected()
    except BaseException:
        await client.aclose()
        raise
    return client
