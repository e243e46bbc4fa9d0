"""The request-plane interface: how the frontend talks to one worker.

A request goes out, the worker ACKs it, chunks stream back, and the stream ends.
Every transport (in-process memory channels, framed TCP) implements the same two
classes, so the router and the pipeline never know which one they hold::

    async with client.stream(request) as replies:   # returns once the worker ACKed
        async for chunk in replies:                 # Chunk messages until End
            ...

Leaving the ``async with`` early, for any reason (the caller's scope is cancelled
because the HTTP client went away, a stop string matched, an exception), cancels the
request on the worker, which frees its KV. That is the whole cancellation design:
the caller's cancel scope is the request's lifetime.

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

from headwater.wire import Chunk, ErrorCode, GenerateRequest, Role


class PlaneError(Exception):
    """Root of request-plane failures."""


class CannotConnect(PlaneError):
    """The worker could not be reached or did not ACK in time. Nothing was generated."""


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


class ResponseStream(abc.ABC):
    """The chunks of one ACKed request, in order. Ends at the worker's End message.

    ``__anext__`` raises :class:`WorkerError` when the worker sent an Error and
    :class:`Disconnected` when the transport broke mid-stream.
    """

    def __aiter__(self) -> ResponseStream:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> Chunk: ...


class WorkerClient(abc.ABC):
    """The frontend's handle on one worker, over one transport."""

    instance: WorkerInstance

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[ResponseStream]:
        """Send *request*; enter once ACKed (raises CannotConnect otherwise).

        Exiting the context before the stream ended sends a cancel to the worker.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the transport's resources; in-flight streams fail with Disconnected."""

