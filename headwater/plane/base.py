"""What both ends of the request plane agree on: who a worker is, a reply stream, errors.

The frontend's clients (``frontend.plane``) and a decode worker pulling KV from a
prefill worker (``workers.runtime.kv_transfer_tcp``) speak the same protocol over
the same connection layer (:mod:`headwater.plane.connection`); this module holds
the types that layer hands out, so neither side imports the other.

Errors, grouped by what the caller can do::

    PlaneError
    ├── CannotConnect   no connection, or no ACK within ack_timeout: route elsewhere,
    │                   and the router inhibits that worker for a while
    ├── Disconnected    the stream broke after the ACK: a migration candidate
    └── WorkerError     the worker answered with an Error message (``code``, ``retryable``)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from headwater.wire import Chunk, End, Error, ErrorCode, Reply, Role


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
    :class:`Disconnected` when the transport broke mid-stream. A transport supplies
    only :meth:`_receive`; how replies end a stream is decided here, once.
    """

    finished = False

    def __aiter__(self) -> ResponseStream:
        return self

    @abc.abstractmethod
    async def _receive(self) -> Reply | object:
        """The next reply for this request; raise Disconnected if the transport broke.

        Anything that is not a Reply ends the stream as Disconnected.
        """

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        try:
            msg = await self._receive()
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
