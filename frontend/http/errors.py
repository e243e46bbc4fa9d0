"""OpenAI-style error bodies, and the one place where errors become HTTP statuses.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``
with the right status. HTTP handlers raise :class:`ApiError` for what only HTTP
knows (a wrong content type, an unknown path); the pipeline raises the frontend's
own errors (:mod:`frontend.errors`), which :func:`api_error` maps. Anything else
that escapes becomes a 500 with a sanitized message (the details go to the log only).
"""

from __future__ import annotations

from typing import Any

import orjson

from frontend.errors import (
    FrontendError,
    InvalidRequest,
    NoCapacity,
    UnknownModel,
    WorkerFailed,
)

#: The status of each kind of frontend error (the most specific class listed wins).
STATUS: dict[type[FrontendError], int] = {
    InvalidRequest: 400,
    UnknownModel: 404,
    WorkerFailed: 502,
    NoCapacity: 503,
}


class ApiError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


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
