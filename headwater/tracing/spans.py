"""Spans and tracers, with a null twin for when tracing is off.

Code on the request path writes ``with tracer().span(name, parent=...) as span:`` and
``span.set(...)`` whatever the configuration. With tracing off (the default) the
process's tracer is the null :class:`Tracer`: ``span`` hands back one shared context
manager yielding :data:`NULL_SPAN`, whose methods do nothing, so tracing off costs a
function call and no object per request. :func:`set_tracer` installs the OpenTelemetry
one (:mod:`headwater.tracing.otel`), which :func:`headwater.tracing.open_tracing` does.

Parents are explicit (see :mod:`headwater.tracing.context` for why): a :class:`Span`,
a W3C :class:`~headwater.tracing.w3c.TraceParent` or its string (a remote parent: the
client's, or the frontend's leg for a worker), or None for a new trace. A child of
:data:`NULL_SPAN` is :data:`NULL_SPAN`: work outside any traced request makes no span.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from headwater.tracing.w3c import TraceParent

#: A span attribute's value, as OpenTelemetry takes them.
AttributeValue = str | bool | int | float


class SpanKind(enum.Enum):
    INTERNAL = "internal"
    SERVER = "server"  # the frontend's root span, a worker's request span
    CLIENT = "client"  # a request sent to another process (a plane leg)


class Span:
    """A span being recorded; this base class is the null span, which records nothing."""

    __slots__ = ()

    #: False for the null span: skip work that only feeds attributes.
    recording = False

    @property
    def trace_id(self) -> str:
        """The trace's id (32 hex digits), "" for the null span."""
        return ""

    @property
    def traceparent(self) -> str:
        """This span as a W3C traceparent (a child's remote parent), "" for the null span."""
        return ""

    @property
    def tracestate(self) -> str:
        return ""

    def set(self, key: str, value: AttributeValue) -> None:
        """Set one attribute."""

    def set_many(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Set several attributes."""

    def event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Record a point in time within the span (an ACK, a migration)."""

    def fail(self, message: str) -> None:
        """Mark the span as failed (its status: error, with *message*)."""


#: The span of work that is not traced.
NULL_SPAN = Span()

Parent = Union[Span, "TraceParent", str, None]
_NULL_CM: AbstractContextManager[Span] = nullcontext(NULL_SPAN)


class Tracer:
    """The null tracer: no spans. The base of the real one."""

    enabled = False

    def span(
        self,
        name: str,
        *,
        parent: Parent,
        tracestate: str = "",
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> AbstractContextManager[Span]:
        """A context manager for a span named *name*, child of *parent* (see the
        module docstring); the span ends with the block. An exception leaving the
        block marks the span failed, except GeneratorExit (an async generator closed
        early by its consumer: a normal end) and trio.Cancelled (recorded as the
        ``headwater.cancelled`` attribute: the client left or a deadline passed)."""
        return _NULL_CM


_tracer = Tracer()


def tracer() -> Tracer:
    """This process's tracer: the null one unless tracing was opened."""
    return _tracer


def set_tracer(new: Tracer) -> Tracer:
    """Install *new* as the process's tracer; returns the previous one."""
    global _tracer
    old, _tracer = _tracer, new
    return old
