"""The worker runtime: drives one engine for whichever transport delivers requests.

A transport (memory channels in-process, a TCP server across processes) hands each
decoded request to :meth:`WorkerRuntime.submit` together with a channel for the
replies: the runtime is the plane's :class:`~headwater.plane.base.RequestHandler`.
It owns the request's task in its own nursery, so a request's lifetime is the
worker's business once it is ACKed; the caller ends it early with
:meth:`WorkerRuntime.cancel`, which is what a ``Cancel`` message does.

:func:`open_runtime` runs the engine and hosts the request tasks for as long as its
block lasts::

    async with open_runtime(engine, "decode-0") as runtime:
        server = PlaneServer(runtime, ...)

Per request, in order: ``Ack`` (sent before any engine work, so a busy engine
never looks dead to the frontend), ``Chunk``\\* and exactly one ``End`` or ``Error``.
A request asking for a feature its engine does not declare
(:mod:`headwater.wire.capabilities`) gets only the ``Error`` (``invalid_request``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial

import trio

from headwater.gc_tuning import WORKER_BUSY_LIMIT_S, collect_when_idle
from headwater.instrumentation import Activity
from headwater.logs import request_context
from headwater.plane.base import WorkerError
from headwater.plane.kv import KvSource
from headwater.tracing import NULL_SPAN, SpanKind, TraceContext, trace_context, tracer
from headwater.wire import Ack, Chunk, End, Error, ErrorCode, GenerateRequest, Reply, WorkerLoad
from headwater.wire.capabilities import refusal
from headwater.wire.kv_events import KvEventBatch
from workers.engines.base import Engine, EngineError, EngineStats

log = logging.getLogger(__name__)

NO_SPAN = nullcontext(NULL_SPAN)  # an untraced request's: shared, no object per request


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    inflight: int
    served_total: int
    cancelled_total: int
    failed_total: int
    kv_released_total: int  # transfers freed at the frontend's word, never pulled
    draining: bool
    engine: EngineStats


def load_of(runtime: WorkerRuntime) -> WorkerLoad:
    """What a worker reports of its load: its engine's requests and KV cache use."""
    engine = runtime.engine.statistics()
    total = engine.kv_blocks_total
    return WorkerLoad(
        engine.active_requests,
        engine.waiting_requests,
        engine.kv_blocks_used / total if total else 0.0,
    )


@asynccontextmanager
async def open_runtime(engine: Engine, worker_id: str) -> AsyncIterator[WorkerRuntime]:
    """Run *engine* and serve requests on it until the block ends.

    On exit every request still running is cancelled (its KV freed) and the engine
    stops. Raises whatever the engine's start-up raises.
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        runtime = WorkerRuntime(engine, worker_id, nursery)
        # Cyclic garbage collected when the worker goes idle (headwater/gc_tuning.py).
        nursery.start_soon(
            partial(collect_when_idle, runtime.activity, busy_limit_s=WORKER_BUSY_LIMIT_S)
        )
        yield runtime
        nursery.cancel_scope.cancel()


class WorkerRuntime:
    """Serves requests on one engine; see the module docstring for the contract.

    Made by :func:`open_runtime`, whose nursery runs the engine and hosts the
    requests' tasks.
    """

    def __init__(self, engine: Engine, worker_id: str, nursery: trio.Nursery) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self._nursery = nursery
        self._scopes: dict[str, trio.CancelScope] = {}
        self._idle = trio.Event()
        self._idle.set()
        self.draining = False
        self._served = 0
        self._cancelled = 0
        self._failed = 0
        self._kv_released = 0
        #: Requests in flight, for the process's loop monitor (it rests while none are).
        self.activity = Activity()

    def submit(self, request: GenerateRequest, replies: trio.abc.SendChannel[Reply]) -> None:
        """Start serving *request*; replies go to *replies*, which the runtime closes.

        Never blocks and never raises for a bad request: refusals travel as an Error
        message on *replies* like any other outcome. Raises RuntimeError once the
        runtime's block has ended.
        """
        if self._nursery.cancel_scope.cancel_called:
            raise RuntimeError(f"worker {self.worker_id} has stopped")
        if self.draining or request.request_id in self._scopes:
            # Answer at once (retryable while draining) instead of letting the
            # frontend wait out its ACK timeout.
            code, why = (
                (ErrorCode.SHUTTING_DOWN, "worker is draining")
                if self.draining
                else (ErrorCode.INVALID_REQUEST, "duplicate request id")
            )
            self._nursery.start_soon(_refuse, replies, request, code, why)
            return
        if (unsupported := refusal(self.engine.capabilities, request.sampling)) is not None:
            # The frontend refuses these before dispatch; one that reached us anyway (an
            # older frontend, a client of the plane) is refused, never served without.
            self._nursery.start_soon(
                _refuse, replies, request, ErrorCode.INVALID_REQUEST, unsupported
            )
            return
        scope = trio.CancelScope()
        self._scopes[request.request_id] = scope
        if self._idle.is_set():
            self._idle = trio.Event()
        self._nursery.start_soon(self._serve, request, replies, scope)

    def cancel(self, request_id: str) -> None:
        """Stop *request_id* if it is still running; its KV is freed by the engine."""
        scope = self._scopes.get(request_id)
        if scope is not None:
            scope.cancel()

    def kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        """The engine's KV events from *since* on (a dump when negative); None when
        the engine publishes none. Never blocks (``headwater.wire.kv_events``)."""
        events = self.engine.kv_events
        return None if events is None else events.read(since, limit)

    def release_kv(self, transfer_id: str) -> None:
        """Free the KV held under *transfer_id*, which no decode worker will pull (the
        request ended first); a no-op for an engine that holds none, an unknown id, or
        one already pulled. The release runs as a task here, so this never blocks."""
        if isinstance(self.engine, KvSource) and not self._nursery.cancel_scope.cancel_called:
            self._nursery.start_soon(self._release, self.engine, transfer_id)

    async def _release(self, source: KvSource, transfer_id: str) -> None:
        try:
            await source.release_transfer(transfer_id)
        except WorkerError:
            return  # pulled meanwhile, or expired: nothing held
        self._kv_released += 1

    async def drain(self, grace: float) -> bool:
        """Refuse new requests and wait up to *grace* seconds for in-flight ones to end.

        Returns True when everything finished in time.
        """
        self.draining = True
        with trio.move_on_after(grace):
            await self._idle.wait()
            return True
        return not self._scopes

    def statistics(self) -> RuntimeStats:
        return RuntimeStats(
            inflight=len(self._scopes),
            served_total=self._served,
            cancelled_total=self._cancelled,
            failed_total=self._failed,
            kv_released_total=self._kv_released,
            draining=self.draining,
            engine=self.engine.statistics(),
        )

    async def _serve(
        self,
        request: GenerateRequest,
        replies: trio.abc.SendChannel[Reply],
        scope: trio.CancelScope,
    ) -> None:
        rid = request.request_id
        outcome = "cancelled"
        t = tracer()
        traced = t.enabled and bool(request.traceparent)
        span_cm = (
            t.span(
                "worker.request",
                parent=request.traceparent,
                tracestate=request.tracestate,
                kind=SpanKind.SERVER,
                attributes={
                    "headwater.worker.id": self.worker_id,
                    "headwater.plane.request_id": rid,
                    "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                    "headwater.kv_pull": request.kv_handle is not None,
                },
            )
            if traced
            else NO_SPAN
        )
        try:
            with (
                span_cm as span,
                request_context(rid, span.trace_id),
                trace_context(TraceContext(span)),
                self.activity,
                scope,
            ):
                await replies.send(Ack(rid))
                try:
                    async with aclosing(self.engine.generate(request)) as chunks:
                        async for chunk in chunks:
                            await self._send(replies, chunk)
                except EngineError as exc:
                    outcome = "failed"
                    span.fail(f"{exc.code.value}: {exc.message}")
                    await replies.send(Error(rid, exc.code, exc.message))
                    return
                await replies.send(End(rid))
                outcome = "served"
                log.debug("request %s served", rid)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The caller went away without a Cancel; the engine already stopped
            # (the generator was closed on the way out of `aclosing`).
            outcome = "cancelled"
        except Exception:
            outcome = "failed"
            log.exception("request %s failed in the engine", rid)
            with trio.move_on_after(1, shield=True):
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await replies.send(Error(rid, ErrorCode.INTERNAL, "internal engine error"))
        finally:
            if outcome == "served":
                self._served += 1
            elif outcome == "cancelled":
                self._cancelled += 1
            else:
                self._failed += 1
            del self._scopes[rid]
            if not self._scopes:
                self._idle.set()
            with trio.move_on_after(1, shield=True):
                await replies.aclose()

    async def _send(self, replies: trio.abc.SendChannel[Reply], chunk: Chunk) -> None:
        """Send *chunk*; if it carries a KV handle and cannot go (the caller left, or
        cancelled the request meanwhile), nobody will learn the handle: release it."""
        sent = False
        try:
            await replies.send(chunk)
            sent = True
        finally:
            if not sent and chunk.kv_handle is not None:
                self.release_kv(chunk.kv_handle.transfer_id)


async def _refuse(
    replies: trio.abc.SendChannel[Reply], request: GenerateRequest, code: ErrorCode, msg: str
) -> None:
    with trio.move_on_after(1):
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await replies.send(Error(request.request_id, code, msg))
    await replies.aclose()
