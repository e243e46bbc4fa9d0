"""A worker's own metrics endpoint (``--metrics-port``): loop health and load.

``GET /metrics`` answers in the Prometheus text format with the prefix
``headwater_worker_``: the same loop metrics as the frontend (``event_loop_delay_seconds``,
``event_loop_stall_total``, ...), from a :class:`~headwater.instrumentation.LoopMonitor`
watching the worker's event loop, plus the worker's load read from
``worker.runtime.statistics()`` at each scrape (what it reads of a worker is
:class:`MetricsSource`; a :class:`~workers.lifecycle.RunningWorker` is one).
``GET /debug/stalls`` lists the stall records as JSON, like the frontend's, and
``GET /debug/runtime`` what the process holds now (trio tasks by name, open file
descriptors, threads, RSS: :mod:`headwater.instrumentation.runtime`), as the frontend's;
``GET /debug/heap`` Python allocations by site and since a mark, with ``PYTHONTRACEMALLOC``
(:mod:`headwater.instrumentation.heap`).

Why a hand-written responder: a worker process carries no web framework, and this
endpoint answers one kind of request from one kind of client. One request per
connection (``Connection: close``), a request head of at most 8 KiB read within 5 s,
loopback only by default. A broken or slow client costs its own connection, nothing
else: per-connection errors are logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from typing import Final, Protocol
from urllib.parse import parse_qs

import orjson
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from headwater.instrumentation import WORKER_PREFIX, LoopMonitor
from headwater.instrumentation.exposition import TextExposition
from headwater.instrumentation.heap import heap_report
from headwater.instrumentation.plain_http import answer_one
from headwater.instrumentation.runtime import runtime_snapshot
from headwater.tracing import TraceCollector, process_trace_statistics
from headwater.wire import Role
from workers.runtime.runtime import WorkerRuntime

log = logging.getLogger(__name__)

PROMETHEUS_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"


class MetricsSource(Protocol):
    """What the endpoint reads of a worker: who it is, and its runtime's statistics."""

    @property
    def worker_id(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def model(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def runtime(self) -> WorkerRuntime: ...


class WorkerCollector(Collector):
    """Mirrors one worker's ``runtime.statistics()`` at scrape time.

    A custom collector rather than gauges set by a timer: every value is as fresh as
    the scrape, and the totals stay true counters.
    """

    def __init__(self, worker: MetricsSource, prefix: str = WORKER_PREFIX) -> None:
        self._worker = worker
        self._prefix = prefix

    def describe(self) -> list[Metric]:
        """The families :meth:`collect` yields, so that the registry knows their names
        (``/metrics?name[]=...`` finds them)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        w, p = self._worker, self._prefix
        stats = w.runtime.statistics()
        engine = stats.engine
        info = GaugeMetricFamily(
            f"{p}info",
            "This worker's identity (always 1)",
            labels=["worker_id", "role", "model", "address"],
        )
        info.add_metric([w.worker_id, str(w.role), w.model, w.address], 1)
        yield info
        gauges = (
            ("inflight_requests", "Requests being served now", stats.inflight),
            ("active_requests", "Requests the engine is running", engine.active_requests),
            ("waiting_requests", "Requests waiting for the engine", engine.waiting_requests),
            ("kv_blocks_used", "KV cache blocks in use", engine.kv_blocks_used),
            ("kv_blocks_total", "KV cache blocks in all", engine.kv_blocks_total),
            (
                "kv_transfers_held",
                "Prefilled KV held for a decode worker to pull",
                engine.kv_transfers_held,
            ),
            ("draining", "1 while the worker drains (refuses new requests)", int(stats.draining)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{p}{name}", doc, value=value)
        counters = (
            ("requests_served", "Requests served to the end", stats.served_total),
            ("requests_cancelled", "Requests cancelled before their end", stats.cancelled_total),
            ("requests_failed", "Requests that ended in an error", stats.failed_total),
            (
                "kv_released",
                "Prefilled KV freed at the frontend's word, never pulled",
                stats.kv_released_total,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{p}{name}", doc, value=value)
        # The model-server protocol of the Gateway API Inference Extension: its endpoint
        # picker scrapes these names (vLLM's) from every pod of an InferencePool.
        usage = engine.kv_blocks_used / engine.kv_blocks_total if engine.kv_blocks_total else 0.0
        picker: tuple[tuple[str, str, float], ...] = (
            (
                "vllm:num_requests_waiting",
                "Requests waiting (the endpoint picker's queue)",
                engine.waiting_requests,
            ),
            ("vllm:num_requests_running", "Requests running", engine.active_requests),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage, 0 to 1 (the older name)", usage),
        )
        for name, doc, share in picker:
            yield GaugeMetricFamily(name, doc, value=share)
        # The engine's own series (vLLM's, in-process), but for the names above.
        names = {name for name, _, _ in picker}
        for family in w.runtime.engine.metric_families():
            if family.name not in names:
                yield family


async def serve_worker_metrics(
    port: int,
    worker: MetricsSource,
    *,
    host: str = "127.0.0.1",
    monitor: LoopMonitor | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` for *worker* on ``host:port`` until cancelled.

    Args:
      port: TCP port; 0 picks a free one (reported).
      worker: the running worker whose load is exported.
      host: address to bind; loopback by default.
      monitor: the worker's loop monitor, if it runs one; without one, a
        :class:`LoopMonitor` with the prefix
        ``headwater_worker_`` is started here, in this task's nursery; it rests while
        the worker has no request in flight (``worker.runtime.activity``).

    Reports the bound port once listening. Raises ``OSError`` if the port is taken.
    Cancellation: stops listening, drops open connections, stops the monitor it started.
    """
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    if (traced := process_trace_statistics()) is not None:
        registry.register(TraceCollector(WORKER_PREFIX, traced))
    listeners = await trio.open_tcp_listeners(port, host=host)  # OSError before any task
    bound = listeners[0].socket.getsockname()[1]
    try:
        async with trio.open_nursery() as nursery:
            if monitor is None:
                monitor = LoopMonitor(
                    registry, prefix=WORKER_PREFIX, activity=worker.runtime.activity
                )
                await nursery.start(monitor.run)
            registries = [registry]
            if monitor.metrics.registry is not registry:
                registries.append(monitor.metrics.registry)
            respond = partial(_respond, TextExposition(*registries), monitor)
            handler = partial(answer_one, respond=respond, name="worker metrics")
            await nursery.start(partial(trio.serve_listeners, handler, listeners))
            log.info("worker metrics on http://%s:%d/metrics", host, bound)
            task_status.started(bound)
    finally:
        for listener in listeners:  # serve_listeners closes them too; closing twice is fine
            await trio.aclose_forcefully(listener)


async def _respond(
    exposition: TextExposition, monitor: LoopMonitor, head: bytes
) -> tuple[str, str, bytes]:
    """(status line, content type, body) for one request head."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return "400 Bad Request", "text/plain", b"bad request\n"
    method, target, _ = parts
    path = target.split("?", 1)[0]
    if path not in ("/metrics", "/debug/stalls", "/debug/runtime", "/debug/heap"):
        return "404 Not Found", "text/plain", b"not found: try /metrics\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
    if path == "/metrics":
        query = parse_qs(target.partition("?")[2])
        return "200 OK", PROMETHEUS_TEXT, exposition.render(query.get("name[]"))
    if path == "/debug/runtime":
        return "200 OK", "application/json", orjson.dumps(runtime_snapshot().to_dict())
    if path == "/debug/heap":  # opt-in: PYTHONTRACEMALLOC (headwater/instrumentation/heap.py)
        query = parse_qs(target.partition("?")[2], keep_blank_values=True)
        report = heap_report(mark="mark" in query, trim="trim" in query)
        return "200 OK", "application/json", orjson.dumps(report)
    records = [r.to_dict() for r in monitor.records()]
    return "200 OK", "application/json", orjson.dumps(records)
