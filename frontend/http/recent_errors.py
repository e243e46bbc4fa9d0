"""The last error answers, by request id: what the dashboard's "Recent errors" shows.

An operator who sees the 4xx or 5xx counters rise wants the answers behind them: which
route, which error, and the request id to look the request up by (in the logs, the
traces, and the client's own ``X-Request-Id``). :class:`RecentErrors` keeps the last
:data:`CAPACITY` of them, in memory, per process (a group's dashboard merges its
processes'); :class:`~frontend.http.middleware.CountResponses` feeds it from each
answer's status and the first bytes of its body. Bounded in count and in size: a
message is cut at :data:`MAX_MESSAGE` characters, and at most :data:`MAX_BODY` bytes of
a body are read for it. No I/O; docs/observability.md, "Request ids".
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import orjson

CAPACITY = 50  # answers kept
MAX_BODY = 4096  # bytes of an error body read for its type and message
MAX_MESSAGE = 300  # characters of a message kept


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """One error answer: when (unix time), its status, the request's method, path and
    id, and the error's ``type`` and ``message`` when the body said them."""

    at: float
    status: int
    method: str
    path: str
    request_id: str | None
    type: str | None
    message: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_fields(body: bytes) -> tuple[str | None, str | None]:
    """The ``type`` and ``message`` of an error body in OpenAI's shape
    (``{"error": {"type", "message"}}``) or Anthropic's (``{"type": "error", "error":
    {...}}``, the same inner object); ``(None, None)`` for anything else."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    inner = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(inner, dict):
        return None, None
    kind, message = inner.get("type"), inner.get("message")
    return (
        kind[:MAX_MESSAGE] if isinstance(kind, str) else None,
        message[:MAX_MESSAGE] if isinstance(message, str) else None,
    )


class RecentErrors:
    """A ring of the last *capacity* :class:`ErrorAnswer` records."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._ring: deque[ErrorAnswer] = deque(maxlen=capacity)
        self.total = 0  # every error answer seen, the ring's dropped ones too

    def add(self, answer: ErrorAnswer) -> None:
        self._ring.append(answer)
        self.total += 1

    def records(self) -> list[ErrorAnswer]:
        """Newest first."""
        return list(reversed(self._ring))
