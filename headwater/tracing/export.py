"""Tracing on for a process: :func:`open_tracing`, and its metrics.

``async with open_tracing(endpoint, "headwater-frontend"):`` installs the
OpenTelemetry tracer (:func:`headwater.tracing.set_tracer`) for the block, exporting
over OTLP/HTTP (protobuf) to *endpoint* through a :class:`QueueSpanProcessor` (the
loop never waits on the collector); at the end it exports what is left, from a thread,
for up to the export timeout, and puts the null tracer back.

:class:`TraceCollector` exposes the processor's counts as Prometheus counters
``<prefix>trace_spans_exported_total`` and
``<prefix>trace_spans_dropped_total{reason="queue_full"|"export_failed"}``.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from headwater.tracing.spans import set_tracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from headwater.tracing.queue import TraceStatistics

#: Seconds one export may take, and the final flush at the end.
EXPORT_TIMEOUT_S = 5.0


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: *endpoint* + ``/v1/traces`` unless it
    already names that path (as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` does)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


@asynccontextmanager
async def open_tracing(
    endpoint: str,
    service: str,
    *,
    attributes: Mapping[str, str | int] | None = None,
    exporter: SpanExporter | None = None,
    export_timeout_s: float = EXPORT_TIMEOUT_S,
    sample_ratio: float = 1.0,
) -> AsyncIterator[Callable[[], TraceStatistics]]:
    """Trace this process for the block; yields a function returning the processor's
    :class:`TraceStatistics`. *exporter* replaces the OTLP one (tests: the SDK's
    in-memory exporter). A trace this process starts is recorded with probability
    *sample_ratio* (by its trace id: OpenTelemetry's ``TraceIdRatioBased``); one that
    continues a parent (a client's ``traceparent``, a frontend's leg on a worker)
    follows the parent's sampled flag (``ParentBased``), so every process of a trace
    agrees. Raises ImportError without the ``tracing`` extra."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from headwater.tracing.otel import OtelTracer
    from headwater.tracing.queue import QueueSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=export_timeout_s)
    resource = Resource.create(
        {
            "service.name": service,
            "host.name": socket.gethostname(),
            **(attributes or {}),
        }
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    processor = QueueSpanProcessor(exporter)
    provider.add_span_processor(processor)
    previous = set_tracer(OtelTracer(provider.get_tracer("headwater")))
    global _statistics
    _statistics = processor.statistics
    try:
        yield processor.statistics
    finally:
        set_tracer(previous)
        _statistics = None
        with trio.move_on_after(export_timeout_s * 2, shield=True):
            # Abandoned on a timeout: the thread is a daemon, the spans are lost.
            await trio.to_thread.run_sync(provider.shutdown, abandon_on_cancel=True)


_statistics: Callable[[], TraceStatistics] | None = None


def process_trace_statistics() -> Callable[[], TraceStatistics] | None:
    """The statistics of this process's open tracing, None while it traces nothing."""
    return _statistics


class TraceCollector(Collector):
    """Prometheus counters from a processor's statistics (see the module docstring)."""

    def __init__(self, prefix: str, statistics: Callable[[], TraceStatistics]) -> None:
        self.prefix = prefix
        self.statistics = statistics

    def collect(self) -> Iterable[CounterMetricFamily]:
        s = self.statistics()
        exported = CounterMetricFamily(
            f"{self.prefix}trace_spans_exported_total", "Spans the collector accepted"
        )
        exported.add_metric([], s.exported)
        dropped = CounterMetricFamily(
            f"{self.prefix}trace_spans_dropped_total",
            "Spans lost: the export queue was full, or the collector failed the export",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], s.dropped_queue_full)
        dropped.add_metric(["export_failed"], s.dropped_export_failed)
        yield exported
        yield dropped
