"""An engine's spans for one request: consecutive stages (``engine.kv_pull``,
``engine.prefill``, ``engine.decode``), each ending where the next begins, all children
of the request's ``worker.request`` span (:mod:`workers.runtime.runtime` sets it as the
task's trace context). Made only for a request that is traced (:func:`stage_spans`
gives None otherwise), so an untraced request costs one attribute read."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager

from headwater.tracing import NULL_SPAN, Span, current_trace, tracer
from headwater.tracing.spans import AttributeValue


class StageSpans:
    """The current stage's span, ended by the next :meth:`stage` or :meth:`close`."""

    __slots__ = ("_cm", "_parent", "current", "name")

    def __init__(self, parent: Span) -> None:
        self._parent = parent
        self._cm: AbstractContextManager[Span] | None = None
        self.current: Span = NULL_SPAN
        self.name = ""  # the current stage's

    def stage(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Span:
        """End the current stage's span and start *name*'s."""
        self.close()
        self._cm = tracer().span(name, parent=self._parent, attributes=attributes)
        self.current, self.name = self._cm.__enter__(), name
        return self.current

    def close(self) -> None:
        """End the current stage's span (a normal end: failures go on the request's)."""
        if self._cm is not None:
            cm, self._cm, self.current = self._cm, None, NULL_SPAN
            cm.__exit__(None, None, None)


def stage_spans() -> StageSpans | None:
    """Stage spans for the current request, or None when it is not traced."""
    parent = current_trace().span
    return StageSpans(parent) if parent.recording else None
