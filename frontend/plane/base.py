"""The request-plane interface: how the frontend talks to one worker.

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

The types both ends of the plane share — :class:`~headwater.plane.base.WorkerInstance`,
:class:`~headwater.plane.base.ResponseStream` and the error tree (``CannotConnect``:
route elsewhere; ``Disconnected``: migrate; ``WorkerError``: see ``retryable``) — live
in :mod:`headwater.plane.base`; :mod:`frontend.plane` re-exports them.
"""

from __future__ import annotations

import abc
from contextlib import AbstractAsyncContextManager

from headwater.plane.base import ResponseStream, WorkerInstance
from headwater.wire import GenerateRequest


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
