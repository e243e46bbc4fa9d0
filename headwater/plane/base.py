"""The request-plane interface: who a worker is, how a caller talks to one, the errors.

A request goes out, the worker ACKs it, chunks stream back, and the stream ends.
Every transport (in-process memory channels, framed TCP) implements
:class:`WorkerClient`, so the router and the pipeline never know which one they hold::

    async with client.stream(request) as replies:   # returns once the worker ACKed
        async for chunk in replies:                 # Chunk messages until End
            ...

Leaving the ``async with`` early, for any reason (the caller's scope is cancelled
because the HTTP client went away, a stop string matched, an exception), cancels the
request on the worker, which frees its KV. That is the whole cancellation design:
the caller's cancel scope is the request's lifetime.

On the worker's side a transport hands each request it decodes to a
:class:`RequestHandler` (the worker runtime), with a channel for the replies.

Errors, grouped by what the caller can do::

    PlaneError
    ├── CannotConnect   no connection, or no ACK within ack_timeout: route elsewhere,
    │                   and the router inhibits that worker for a while
    ├── Disconnected    the stream broke after the ACK: a migration candidate
    └── WorkerError     the worker answered with an Error message (``code``, ``retryable``)
"""

from __future__ import annotations

import abc
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from headwater.wire import (
    Chunk,
    End,
    Error,
    ErrorCode,
    GenerateRequest,
    KvHandle,
    Reply,
    Role,
    WorkerLoad,
)
from headwater.wire.capabilities import BASELINE, Capabilities
from headwater.wire.kv_events import KvEventBatch


class PlaneError(Exception):
    """Root of request-plane failures."""


class CannotConnect(PlaneError):
    """The worker could not be reached or did not ACK in time. Nothing was generated.

    ``excused`` is True when the deadline passed while the caller's own event loop was
    stalled (:mod:`headwater.instrumentation.attribution`): not the worker's fault.
    """

    def __init__(self, message: str, *, excused: bool = False) -> None:
        super().__init__(message)
        self.excused = excused


class Disconnected(PlaneError):
    """The stream broke after the ACK; some chunks may have been delivered."""


class WorkerError(PlaneError):
    """The worker rejected or failed the request with an Error message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN)


@dataclass(frozen=True, slots=True)
class WorkerInstance:
    """A worker as discovery knows it: who, what role, serving which model, where."""

    worker_id: str
    role: Role
    model: str
    address: str  # "memory://<id>" or "tcp://host:port"
    capacity: int = 256  # max concurrent sequences the worker advertises
    metadata: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    #: What its engine declared it honours, as discovery reported it (None: not
    #: reported; a TCP client learns it in the handshake).
    capabilities: Capabilities | None = field(default=None, compare=False, hash=False)


#: Chunks merged into one at most, so that draining a backlog stays a bounded step.
COALESCE_MAX = 64


class ResponseStream(abc.ABC):
    """The chunks of one ACKed request, in order. Ends at the worker's End message.

    ``__anext__`` raises :class:`WorkerError` when the worker sent an Error and
    :class:`Disconnected` when the transport broke mid-stream. A transport supplies
    :meth:`_receive`, and :meth:`_ready` if it can tell that a reply has already
    arrived; how replies end a stream is decided here, once.

    Chunks that are already waiting when one is taken are merged into it, their tokens
    (and logprobs) appended, up to :data:`COALESCE_MAX`: a consumer that fell behind the
    engine catches up in one pass through postprocessing and one SSE write instead of
    one per token.
    A chunk that finishes the stream or carries a KV handle ends a merge.
    """

    finished = False
    _held: Reply | object | None = None  # read ahead by a merge that could not take it

    def __aiter__(self) -> ResponseStream:
        return self

    @abc.abstractmethod
    async def _receive(self) -> Reply | object:
        """The next reply for this request; raise Disconnected if the transport broke.

        Anything that is not a Reply ends the stream as Disconnected.
        """

    def _ready(self) -> Reply | object | None:
        """A reply that has already arrived, taken without waiting; ``None`` if there
        is none yet (or the stream broke: :meth:`_receive` reports that next)."""
        return None

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        msg, self._held = self._held, None
        if msg is None:
            try:
                msg = await self._receive()
            except Disconnected:
                self.finished = True
                raise
        if isinstance(msg, Chunk):
            return self._merge_waiting(msg)
        self.finished = True
        if isinstance(msg, End):
            raise StopAsyncIteration
        if isinstance(msg, Error):
            raise WorkerError(msg.code, msg.message)
        raise Disconnected(f"unexpected {type(msg).__name__} in a response stream")

    def _merge_waiting(self, first: Chunk) -> Chunk:
        last, tokens, cached = first, None, first.cached_tokens
        # A stream's chunks all carry logprobs or none do (the request asked or not).
        logprobs = None if first.logprobs is None else list(first.logprobs)
        prompt_logprobs = first.prompt_logprobs
        for _ in range(COALESCE_MAX - 1):
            if last.finish_reason is not None or last.kv_handle is not None:
                break
            nxt = self._ready()
            if nxt is None:
                break
            if not isinstance(nxt, Chunk) or nxt.kv_handle is not None:
                self._held = nxt  # End, Error or a handle: the next call handles it
                break
            if tokens is None:
                tokens = list(first.token_ids)
            tokens.extend(nxt.token_ids)
            if logprobs is not None and nxt.logprobs is not None:
                logprobs.extend(nxt.logprobs)
            if prompt_logprobs is None:
                prompt_logprobs = nxt.prompt_logprobs
            cached = max(cached, nxt.cached_tokens)
            last = nxt
        if tokens is None:
            return first
        return Chunk(
            first.request_id,
            tokens,
            last.finish_reason,
            cached_tokens=cached,
            logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=prompt_logprobs,
        )


class WorkerClient(abc.ABC):
    """A caller's handle on one worker, over one transport."""

    instance: WorkerInstance

    @property
    def load(self) -> WorkerLoad | None:
        """The worker's load as it last reported it; None when it has not (yet)."""
        return None

    @property
    def capabilities(self) -> Capabilities:
        """What the worker's engine declared it honours (:mod:`headwater.wire.capabilities`):
        as discovery reported it, else the baseline. A transport that hears it from the
        worker itself (the TCP handshake) says that instead."""
        return self.instance.capabilities or BASELINE

    @property
    def reachable(self) -> bool:
        """True while this client holds a live connection to the worker, one its
        heartbeats vouch for. A transport that cannot tell says False: membership then
        believes discovery alone (see ``frontend.discovery.membership``)."""
        return False

    async def wait_lost(self) -> None:
        """Return once the connection :attr:`reachable` vouched for is lost (at once
        when there is none)."""
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[ResponseStream]:
        """Send *request*; enter once ACKed (raises CannotConnect otherwise).

        Exiting the context before the stream ended sends a cancel to the worker.
        """

    @abc.abstractmethod
    def release_kv(self, handle: KvHandle) -> None:
        """Tell the worker that made *handle* (a prefill worker) that nobody will pull
        it, so that it frees the KV now rather than at its transfer timeout.

        Best effort and never blocks, so that it can run while the request is being
        cancelled: the release is queued, not awaited; a worker that is gone has freed
        its KV anyway.
        """

    async def poll_kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """The worker's KV cache events from number *since* on, at most *limit* (a
        dump when *since* is negative; ``headwater.wire.kv_events``); None when the
        worker publishes none (its engine has no events, or it predates them).

        Raises CannotConnect or Disconnected when the worker cannot answer.
        """
        await trio.lowlevel.checkpoint()
        return None

    @abc.abstractmethod
    async def probe(self) -> None:
        """Ask the worker for an answer over this transport (a health check).

        Returns once it answered; raises CannotConnect or Disconnected when it cannot.
        The caller bounds the wait.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the transport's resources; in-flight streams fail with Disconnected."""


class RequestHandler(Protocol):
    """What a transport delivers a worker's requests to (``workers.runtime.WorkerRuntime``).

    ``submit`` never blocks and never raises for a bad request: the handler answers on
    *replies* (Ack first, then chunks, then exactly one End or Error) and closes it.
    It raises RuntimeError only when it cannot take requests at all (not running).
    ``cancel`` stops a request that is still running; unknown ids are ignored.
    ``release_kv`` frees the KV a prefill engine holds for a transfer no decode worker
    will pull; it never blocks (the release runs in the handler's own tasks) and
    ignores unknown ids and engines that hold no KV.
    """

    @property
    def worker_id(self) -> str: ...

    def submit(self, request: GenerateRequest, replies: trio.abc.SendChannel[Reply]) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def release_kv(self, transfer_id: str) -> None: ...
