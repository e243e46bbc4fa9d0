"""OpenAI-style error bodies, and the one place where errors become HTTP statuses.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``
with the right status, but on the paths of Anthropic's Messages API, where it takes
Anthropic's shape and statuses (:func:`rendered`). HTTP handlers raise :class:`ApiError`
for what only HTTP knows (a wrong content type, an unknown path); the pipeline raises
the frontend's own errors (:mod:`frontend.errors`), which :func:`api_error` maps.
Anything else that escapes becomes a 500 with a sanitized message (the details go to the log only).

Admission (:mod:`frontend.http.admission`) turns requests away before any of their
work, with :func:`too_many_requests` (429) and :func:`shutting_down` (503). Those are
HTTP-only errors, not part of the frontend's tree: they are decided and answered in
the HTTP layer, before a request exists for the pipeline, and nothing below raises them.

A value from a request that goes into a log (its path, its method) goes through
:func:`loggable` first: a client chooses it, and a line break in it (``%0a`` in a path)
would begin a log line of the client's making.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from frontend.errors import (
    FrontendError,
    InvalidRequest,
    NoCapacity,
    RequestTimeout,
    UnknownModel,
    WorkerFailed,
)
from frontend.http.anthropic.errors import anthropic_error, is_messages_path

# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators, each
# written as its escape: nothing a client sends can break a log line or colour a terminal.
_ESCAPES = {c: ascii(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


def loggable(value: object) -> str:
    """*value* as text fit for a log line: its control characters escaped (``\\n``,
    ``\\x1b``, ...), everything else as it is."""
    return str(value).translate(_ESCAPES)


#: The status of each kind of frontend error (the most specific class listed wins).
STATUS: dict[type[FrontendError], int] = {
    InvalidRequest: 400,
    UnknownModel: 404,
    WorkerFailed: 502,
    NoCapacity: 503,
    RequestTimeout: 504,
}


#: The ``Retry-After`` of a 429 from ``--max-inflight``, in seconds. A slot frees as soon
#: as any one of the requests in flight ends: at the limit, every D/N seconds for N
#: requests of duration D, well under a second for any N worth setting. So the shortest
#: delay RFC 9110's whole seconds can say; not 0, which OpenAI's client ignores (it
#: honours a Retry-After above 0 and up to 60 s, else backs off on its own).
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error the client should see, with its HTTP status (and *headers* to send with it)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())


def rendered(err: ApiError, path: str) -> tuple[int, bytes]:
    """The status and body that answer *err* on *path*: OpenAI's error, but on the
    Messages API's paths, where it is Anthropic's
    (:mod:`frontend.http.anthropic.errors`). Every error answer goes through here."""
    if is_messages_path(path):
        return anthropic_error(err)
    return err.status, err.json()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_many_requests(max_inflight: int) -> ApiError:
    """429 for a generation request over ``--max-inflight``: OpenAI's answer to a request
    over a requests-per-minute limit (type ``requests``, code ``rate_limit_exceeded``),
    with a ``Retry-After`` of :data:`RETRY_AFTER_S` seconds."""
    return ApiError(
        429,
        f"This frontend is serving its limit of {max_inflight} requests at once. "
        f"Please try again in {RETRY_AFTER_S}s.",
        type="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def shutting_down() -> ApiError:
    """503 for a generation request that arrives while this frontend drains for shutdown.
    ``Connection: close`` moves the client's next request to a new connection, which a
    load balancer sends to another instance."""
    return ApiError(
        503,
        "This frontend is shutting down; send the request to another instance",
        code="shutting_down",
        headers={"Connection": "close"},
    )


def api_error(exc: FrontendError) -> ApiError:
    """The HTTP answer to a frontend error: its status by kind, its message and fields."""
    status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 500)
    return ApiError(status, exc.message, param=exc.param, code=exc.code)


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"
