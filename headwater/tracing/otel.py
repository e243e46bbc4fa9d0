"""The OpenTelemetry tracer behind :class:`~headwater.tracing.spans.Tracer`.

Imported only when tracing is on (``opentelemetry-sdk`` is the optional ``tracing``
extra). Spans are started with an explicit parent context and never attached to
OpenTelemetry's own ambient context (see :mod:`headwater.tracing.context`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

import trio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from headwater.tracing.spans import NULL_SPAN, AttributeValue, Parent, Span, SpanKind, Tracer
from headwater.tracing.w3c import TraceParent

_KINDS = {
    SpanKind.INTERNAL: trace.SpanKind.INTERNAL,
    SpanKind.SERVER: trace.SpanKind.SERVER,
    SpanKind.CLIENT: trace.SpanKind.CLIENT,
}


class OtelSpan(Span):
    """A recording OpenTelemetry span."""

    __slots__ = ("otel",)
    recording = True

    def __init__(self, otel: trace.Span) -> None:
        self.otel = otel

    @property
    def trace_id(self) -> str:
        return f"{self.otel.get_span_context().trace_id:032x}"

    @property
    def traceparent(self) -> str:
        ctx = self.otel.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    @property
    def tracestate(self) -> str:
        return self.otel.get_span_context().trace_state.to_header()

    def set(self, key: str, value: AttributeValue) -> None:
        self.otel.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.otel.set_attributes(attributes)

    def event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.otel.add_event(name, attributes)

    def fail(self, message: str) -> None:
        self.otel.set_status(Status(StatusCode.ERROR, message))


class OtelTracer(Tracer):
    """Spans through an OpenTelemetry tracer (from the process's TracerProvider)."""

    enabled = True

    def __init__(self, otel: trace.Tracer) -> None:
        self._otel = otel

    def span(
        self,
        name: str,
        *,
        parent: Parent,
        tracestate: str = "",
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> AbstractContextManager[Span]:
        if parent is NULL_SPAN or (isinstance(parent, Span) and not parent.recording):
            return super().span(name, parent=parent)
        return self._span(name, _context(parent, tracestate), _KINDS[kind], attributes)

    @contextmanager
    def _span(
        self,
        name: str,
        context: Context,
        kind: trace.SpanKind,
        attributes: Mapping[str, AttributeValue] | None,
    ) -> Iterator[Span]:
        otel = self._otel.start_span(name, context=context, kind=kind, attributes=attributes)
        if not otel.is_recording():  # sampled out: the null span, so children are none
            yield NULL_SPAN
            return
        try:
            yield OtelSpan(otel)
        except GeneratorExit:
            raise  # the consumer closed the generator the span is in: a normal end
        except trio.Cancelled:
            otel.set_attribute("headwater.cancelled", True)
            raise
        except BaseException as exc:
            otel.record_exception(exc)
            otel.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            otel.end()


def _context(parent: Parent, tracestate: str) -> Context:
    """An OpenTelemetry context holding *parent* (an empty one: a new trace)."""
    if isinstance(parent, OtelSpan):
        return trace.set_span_in_context(parent.otel, Context())
    if isinstance(parent, str):
        parent = TraceParent.parse(parent)
    if not isinstance(parent, TraceParent):
        return Context()
    remote = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(parent.flags & 0xFF),
        trace_state=TraceState.from_header([tracestate]) if tracestate else None,
    )
    return trace.set_span_in_context(NonRecordingSpan(remote), Context())
