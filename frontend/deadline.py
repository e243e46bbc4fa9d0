"""A request's deadline (``--request-timeout``), kept across its stages and its stream.

One :class:`Deadline` per request, from its arrival: :meth:`Deadline.run` awaits a stage
(preprocess) before it, :meth:`Deadline.iterate` takes a stream's items (the pipeline's
deltas) before it. When it passes, the work in progress is cancelled where it waits,
which unwinds the pipeline as a client's disconnect does (the worker is told to cancel
and frees the request's KV), and :class:`~frontend.errors.RequestTimeout` is raised.

Why not one cancel scope around the whole request: a streamed response is an async
generator that yields to the HTTP server between events, and a cancel scope must not be
held across a ``yield`` (trio delivers its cancellation to whatever task iterates the
generator then). :meth:`Deadline.iterate` enters a scope around each wait for the next
item only, and yields outside it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import trio

from frontend.errors import RequestTimeout

T = TypeVar("T")


class Deadline:
    """*timeout* seconds from now (trio's clock); 0 is no deadline."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float) -> None:
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 (0: none), got {timeout}")
        self.timeout = timeout
        self.at = trio.current_time() + timeout if timeout else math.inf

    async def run(self, stage: Callable[[], Awaitable[T]]) -> T:
        """``await stage()``, cancelled at the deadline: then RequestTimeout."""
        if not self.timeout:
            return await stage()
        with trio.CancelScope(deadline=self.at) as scope:
            return await stage()
        assert scope.cancelled_caught
        raise RequestTimeout(self.timeout)

    def iterate(self, items: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """The items of *items* that come before the deadline; then RequestTimeout.
        Owns *items*: closes it however the returned generator ends (close that one
        with ``contextlib.aclosing``).

        With no deadline (the default) that is *items* itself: a cancel scope and a
        generator hop per item cost a short stream's loop ~8% of its CPU for nothing."""
        return self._iterate(items) if self.timeout else items

    async def _iterate(self, items: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        async with aclosing(items):
            while True:
                with trio.CancelScope(deadline=self.at) as scope:
                    try:
                        item = await items.__anext__()
                    except StopAsyncIteration:
                        return
                if scope.cancelled_caught:
                    raise RequestTimeout(self.timeout)
                yield item
