"""The in-process request plane: trio memory channels to a worker's runtime.

This is the twin of the TCP transport (same :class:`WorkerClient` contract), used
when the workers live in the frontend's own process and in tests. It talks to any
:class:`~headwater.plane.base.RequestHandler` (the worker runtime is one). The ACK
timeout applies here too, so a wedged in-process worker is handled exactly like a
remote one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from headwater.instrumentation.attribution import StallAttribution
from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    RequestHandler,
    ResponseStream,
    WorkerClient,
    WorkerError,
    WorkerInstance,
)
from headwater.wire import Ack, Error, GenerateRequest, KvHandle, Reply, WorkerLoad
from headwater.wire.kv_events import KvEventBatch

#: Replies buffered per request: enough to decouple engine steps from the HTTP
#: writer, small enough that a slow client applies backpressure to the engine.
REPLY_BUFFER = 64

#: Replies taken in a row without yielding to the scheduler when they are waiting.
BURST = 16


class _ReplyChannel(trio.abc.SendChannel[Reply]):
    """The runtime's end of one request's replies: the memory channel, minus its
    schedule points.

    As with the TCP server's reply queue, a send is not a schedule point while the
    buffer has room (cancellation is still checked). The engine's generator parks
    between tokens anyway, so the loop stays fair, and the runtime's task takes half
    the scheduler passes per streamed request (docs/performance.md).
    """

    def __init__(self, send: trio.MemorySendChannel[Reply]) -> None:
        self._send = send

    async def send(self, value: Reply) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._send.send_nowait(value)
        except trio.WouldBlock:
            await self._send.send(value)

    async def aclose(self) -> None:
        self._send.close()
        await trio.lowlevel.checkpoint_if_cancelled()


class _MemoryResponseStream(ResponseStream):
    """The frontend's end: a reply that is already there is taken without a schedule
    point, up to :data:`BURST` in a row (merged into one chunk or not), so a backlog
    cannot hold the loop for long."""

    def __init__(self, replies: trio.MemoryReceiveChannel[Reply]) -> None:
        self._replies = replies
        self._burst = 0

    async def _receive(self) -> Reply:
        await trio.lowlevel.checkpoint_if_cancelled()
        reply = self._ready()
        if reply is not None:
            return reply
        try:
            reply = await self._replies.receive()
        except trio.EndOfChannel:
            raise Disconnected("worker closed the stream without End") from None
        self._burst = 1  # this loop step's first
        return reply

    def _ready(self) -> Reply | None:
        # Merged or not, BURST replies at most are taken per loop step.
        if self._burst >= BURST:
            return None  # _receive then waits: a schedule point, and a new burst
        try:
            reply = self._replies.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None
        self._burst += 1
        return reply


class MemoryWorkerClient(WorkerClient):
    """A client for a worker runtime (a :class:`RequestHandler`) in this process."""

    def __init__(
        self,
        instance: WorkerInstance,
        runtime: RequestHandler,
        *,
        ack_timeout: float = 5.0,
        load: Callable[[], WorkerLoad] | None = None,
        attribution: StallAttribution | None = None,
    ) -> None:
        """*load* reads the worker's load (in-process it is always current);
        *attribution* excuses a missed ACK when this loop stalled."""
        self.instance = instance
        self.runtime = runtime
        self.ack_timeout = ack_timeout
        self.attribution = attribution
        self._load = load
        self._closed = False

    @property
    def load(self) -> WorkerLoad | None:
        return self._load() if self._load is not None else None

    async def probe(self) -> None:
        """In-process a worker answers while its client is open."""
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise CannotConnect(f"client for {self.instance.worker_id} is closed")

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        if self._closed:
            raise CannotConnect(f"client for {self.instance.worker_id} is closed")
        send, receive = trio.open_memory_channel[Reply](REPLY_BUFFER)
        with receive:  # closing needs no schedule point
            try:
                self.runtime.submit(request, _ReplyChannel(send))
            except RuntimeError as exc:
                raise CannotConnect(str(exc)) from exc
            stream = _MemoryResponseStream(receive)
            sent = trio.current_time()
            with trio.move_on_after(self.ack_timeout) as ack_scope:
                try:
                    first = await receive.receive()
                except trio.EndOfChannel:
                    raise CannotConnect("worker closed the stream before ACK") from None
            if ack_scope.cancelled_caught:
                self.runtime.cancel(request.request_id)
                await trio.lowlevel.checkpoint()  # the canary records a stall that just ended
                attribution = self.attribution
                excused = attribution is not None and attribution.excuses(sent, trio.current_time())
                raise CannotConnect(
                    f"no ACK from {self.instance.worker_id} within {self.ack_timeout:g} s",
                    excused=excused,
                )
            if isinstance(first, Error):
                raise WorkerError(first.code, first.message)
            if not isinstance(first, Ack):
                raise Disconnected(f"expected Ack, got {type(first).__name__}")
            try:
                yield stream
            finally:
                if not stream.finished:
                    self.runtime.cancel(request.request_id)

    async def poll_kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """In-process the runtime's event log is read directly (a copy of the events'
        references; publishing never waits for this)."""
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise CannotConnect(f"client for {self.instance.worker_id} is closed")
        read = getattr(self.runtime, "kv_events", None)
        return read(since, limit) if read is not None else None

    def release_kv(self, handle: KvHandle) -> None:
        if not self._closed:
            self.runtime.release_kv(handle.transfer_id)

    async def aclose(self) -> None:
        self._closed = True
