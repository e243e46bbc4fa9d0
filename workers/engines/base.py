"""The engine interface every worker runtime drives.

An engine turns a :class:`~headwater.wire.GenerateRequest` into a stream of
:class:`~headwater.wire.Chunk`. It knows nothing of transports: the runtime
(:mod:`workers.runtime`) ACKs, frames and cancels around it. Engines are built by
name through the registry (:mod:`workers.engines.registry`), each from its own config
and an :class:`EngineContext`.

Cancellation contract: ``generate`` is an async generator consumed inside the
caller's cancel scope. When that scope is cancelled (client gone, ``Cancel``
frame), the generator is closed and the engine must release everything the
request held (KV blocks, batch slot) in its ``finally`` before returning.

KV handover: a prefill engine also implements
:class:`~headwater.plane.kv.KvSource` (``release_transfer``), which the plane calls
when a decode worker pulls; a decode engine pulls through the
:class:`~headwater.plane.kv.KvTransfer` in its context. Engines that never hold KV
for others implement neither.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass

import trio
from prometheus_client.core import Metric

from headwater.plane.base import WorkerError
from headwater.plane.kv import KvTransfer
from headwater.wire import Chunk, ErrorCode, GenerateRequest, Role
from headwater.wire.capabilities import BASELINE, Capabilities
from headwater.wire.kv_events import KvEventLog

# Re-exported: the whole engine contract is importable from here.
from workers.engines.config import EngineConfig as EngineConfig


class EngineError(WorkerError):
    """The engine cannot serve this request (bad input, KV transfer failed, ...).

    A :class:`~headwater.plane.base.WorkerError` raised on the worker's side: the
    runtime sends it to the caller as an Error message with the same ``code``.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(ErrorCode(code), message)


class EngineFailed(Exception):
    """The engine cannot go on at all: its model server would not start, or died for
    good. Raised by :meth:`Engine.run`; the worker hosting the engine exits."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load, read by metrics and by least-loaded routing."""

    active_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_transfers_held: int = 0


@dataclass(frozen=True, slots=True)
class EngineContext:
    """What the worker hosting an engine tells it when it is built."""

    role: Role
    worker_id: str
    #: How a decode (or agg) engine pulls a prefill's KV; None when it cannot.
    kv_transfer: KvTransfer | None = None
    #: Where decode workers reach this worker's held KV (put in its KV handles);
    #: "" means ``memory://<worker_id>``.
    transfer_address: str = ""
    #: The OTLP collector this worker's traces go to ("" : untraced); an engine that
    #: runs a server of its own (vLLM) sends that server's spans there too.
    otlp_endpoint: str = ""
    #: The worker shares its process with the frontend (``headwater serve``'s
    #: in-process workers): an engine keeps its heavy work out of this process, whose
    #: event loop serves HTTP (vLLM is then reached through its own API server).
    beside_frontend: bool = False


class Engine(abc.ABC):
    """A model engine in one role. Owns its scheduler task via :meth:`run`."""

    role: Role
    #: What its prefix cache stores and evicts (``headwater.wire.kv_events``), for
    #: KV-aware routing; None for an engine that publishes no events.
    kv_events: KvEventLog | None = None

    @property
    def capabilities(self) -> Capabilities:
        """What this engine honours beyond the baseline (:mod:`headwater.wire.capabilities`).

        The declaration travels with the worker's registration; the runtime refuses a
        request asking for anything else before the engine sees it. The default is the
        conservative one, what a worker that declares nothing is taken to honour; an
        engine that honours more says so."""
        return BASELINE

    @abc.abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine's background work until cancelled.

        Start it with ``await nursery.start(engine.run)``; it reports readiness with
        ``task_status.started()``. Raises :class:`EngineFailed` when it cannot start
        or can serve no longer.
        """

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        """Serve one request. The last chunk carries ``finish_reason``.

        A prefill-role engine yields one chunk carrying a :class:`KvHandle` and no
        tokens; a decode-role engine pulls ``request.kv_handle`` before generating.
        Raises :class:`EngineError` for requests it cannot serve.
        """

    @abc.abstractmethod
    def statistics(self) -> EngineStats:
        """Current load, cheap enough to call on every routing decision."""

    def metric_families(self) -> Iterable[Metric]:
        """The engine's own Prometheus series, which the worker's metrics endpoint
        exports as they are (vLLM's, when it runs in the worker's process); none by
        default."""
        return ()
