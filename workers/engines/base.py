"""The engine interface every worker runtime drives.

An engine turns a :class:`~headwater.wire.GenerateRequest` into a stream of
:class:`~headwater.wire.Chunk`. It knows nothing of transports: the runtime
(:mod:`workers.runtime`) ACKs, frames and cancels around it.

Cancellation contract: ``generate`` is an async generator consumed inside the
caller's cancel scope. When that scope is cancelled (client gone, ``Cancel``
frame), the generator is closed and the engine must release everything the
request held (KV blocks, batch slot) in its ``finally`` before returning.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from headwater.wire import Chunk, GenerateRequest, KvHandle, Role


class EngineError(Exception):
    """The engine cannot serve this request (bad input, KV transfer failed, ...).

    ``code`` is one of :class:`headwater.wire.ErrorCode`'s values.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load, read by metrics and by least-loaded routing."""

    active_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_transfers_held: int = 0


class KvTransfer(abc.ABC):
    """How a decode engine fetches the KV a prefill worker holds for it.

    In-process this is a method call on the prefill engine; across processes it is a
    worker-to-worker stream. Both return the number of bytes moved.
    """

    @abc.abstractmethod
    async def pull(self, handle: KvHandle) -> int:
        """Fetch and release the KV behind *handle*; raise EngineError on failure."""


class Engine(abc.ABC):
    """A model engine in one role. Owns its scheduler task via :meth:`run`."""

    role: Role

    @abc.abstractmethod
    async def run(self, *, task_status: object = ...) -> None:
        """Run the engine's background work until cancelled.

        Start it with ``await nursery.start(engine.run)``; it reports readiness with
        ``task_status.started()``.
        """

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Serve one request. The last chunk carries ``finish_reason``.

        A prefill-role engine yields one chunk carrying a :class:`KvHandle` and no
        tokens; a decode-role engine pulls ``request.kv_handle`` before generating.
        Raises :class:`EngineError` for requests it cannot serve.
        """

    @abc.abstractmethod
    async def release_transfer(self, transfer_id: str) -> int:
        """Prefill role: hand over and free the KV held under *transfer_id*.

        Returns the payload size in bytes; raises EngineError if unknown/expired.
        """

    @abc.abstractmethod
    def statistics(self) -> EngineStats:
        """Current load, cheap enough to call on every routing decision."""
