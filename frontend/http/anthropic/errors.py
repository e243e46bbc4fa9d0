"""Anthropic's error shape, for the Messages API's paths (and only those).

Anthropic answers ``{"type": "error", "error": {"type": ..., "message": ...}}`` with its
own statuses and types; its SDK raises a typed exception per status (``BadRequestError``
for 400, ``AuthenticationError`` 401, ``NotFoundError`` 404, ``RateLimitError`` 429,
``InternalServerError`` 5xx, 529 ``overloaded_error`` retried as Anthropic's overload).
Every error headwater answers on these paths, wherever it is decided (admission, API
keys, the app, a stream that already started), takes this shape:
:func:`frontend.http.errors.rendered` asks :func:`is_messages_path`.

Statuses Anthropic does not use are mapped to the nearest it does: 415 (not JSON) is a
400, 502 (a worker failed) a 500, 503 (no capacity, draining) Anthropic's 529.

No I/O; imports nothing of the app at run time (:mod:`frontend.http.errors` imports
this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from frontend.http.errors import ApiError

MESSAGES_PATH = "/v1/messages"

#: headwater's status → Anthropic's, where they differ.
STATUS = {415: 400, 502: 500, 503: 529}

#: Anthropic's error type by (Anthropic's) status.
TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether *path* is one of the Messages API's (``/v1/messages`` and below)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(status: int) -> int:
    return STATUS.get(status, status)


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """The body of *err* in Anthropic's shape (the data of a stream's ``error`` event
    too)."""
    status = anthropic_status(err.status)
    kind = TYPE.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_error(err: ApiError) -> tuple[int, bytes]:
    """*err* as Anthropic answers it: its status and body."""
    return anthropic_status(err.status), orjson.dumps(anthropic_error_body(err))
