"""Request tracing with OpenTelemetry, off by default (docs/observability.md, "Traces").

The request path uses :func:`tracer` (the null tracer unless :func:`open_tracing` runs)
and :func:`current_trace`; OpenTelemetry itself is imported only by
:func:`open_tracing` (the optional ``tracing`` extra).
"""

from headwater.tracing.context import TraceContext, current_trace, trace_context
from headwater.tracing.export import (
    TraceCollector,
    open_tracing,
    process_trace_statistics,
    traces_url,
)
from headwater.tracing.spans import NULL_SPAN, Span, SpanKind, Tracer, set_tracer, tracer
from headwater.tracing.w3c import MAX_TRACESTATE, TraceParent, valid_tracestate

__all__ = [
    "MAX_TRACESTATE",
    "NULL_SPAN",
    "Span",
    "SpanKind",
    "TraceCollector",
    "TraceContext",
    "TraceParent",
    "Tracer",
    "current_trace",
    "open_tracing",
    "process_trace_statistics",
    "set_tracer",
    "trace_context",
    "tracer",
    "traces_url",
    "valid_tracestate",
]
