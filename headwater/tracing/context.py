"""The trace a task works for, as a context variable.

Spans are parented explicitly (a parent :class:`~headwater.tracing.spans.Span` or a
``traceparent`` string), never through an ambient "current span" that a span's ``with``
would set: the pipeline's stages are async generators, and a context variable set
inside one leaks to its consumer between two ``yield``\\ s. What is ambient is only the
request's root (frontend) or ``worker.request`` (worker) span, set here by the code
that owns the request's task, which its stages read as their parent.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from headwater.tracing.spans import NULL_SPAN, Span


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The span a request's work hangs under."""

    span: Span


_NO_TRACE = TraceContext(NULL_SPAN)
_current: contextvars.ContextVar[TraceContext] = contextvars.ContextVar(
    "headwater_trace", default=_NO_TRACE
)


def current_trace() -> TraceContext:
    """The current request's trace context (its span is NULL_SPAN when untraced)."""
    return _current.get()


@contextmanager
def trace_context(ctx: TraceContext) -> Iterator[TraceContext]:
    """*ctx* is the current trace context inside the block (and in tasks started there)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
