"""W3C Trace Context (https://www.w3.org/TR/trace-context/): ``traceparent`` parsed and
written, ``tracestate`` checked. Pure functions, no OpenTelemetry: the request plane's
codec validates the frame's fields with these whether tracing is on or not."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The longest ``tracestate`` carried (the W3C's 32 members of a few dozen bytes fit).
MAX_TRACESTATE = 512
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_MEMBER = re.compile(
    r"[ \t]*(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*"
)


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A span's place in a trace: the trace's id (32 hex digits), the span's (16), and
    the flags (bit 0: sampled)."""

    trace_id: str
    span_id: str
    flags: int = 1

    @classmethod
    def parse(cls, text: str) -> TraceParent | None:
        """The traceparent in *text*, or None for a malformed one (an unknown version,
        an all-zero id, version 00 with trailing data)."""
        m = _TRACEPARENT.match(text.strip())
        if m is None:
            return None
        version, trace_id, span_id, flags = m.groups()
        rest = text.strip()[m.end() :]
        if version == "ff" or (version == "00" and rest) or (rest and not rest.startswith("-")):
            return None
        if trace_id == "0" * 32 or span_id == "0" * 16:
            return None
        return cls(trace_id, span_id, int(flags, 16))

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def __str__(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def valid_tracestate(text: str) -> bool:
    """*text* is a tracestate headwater carries: at most MAX_TRACESTATE characters of
    comma-separated ``key=value`` members as the W3C defines them (empty members allowed)."""
    if len(text) > MAX_TRACESTATE:
        return False
    members = [m for m in text.split(",") if m.strip(" \t")]
    return len(members) <= 32 and all(_MEMBER.fullmatch(m) for m in members)
