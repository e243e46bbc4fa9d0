"""Request ids, and the trace of each generation request: the outermost ASGI middleware.

Every HTTP request gets an id: the client's ``X-Request-Id`` when it sent a valid one
(:data:`REQUEST_ID_PATTERN`, at most 128 characters; anything else is refused with 400
``invalid_request_id``, since an id that cannot be logged or echoed safely is no id),
else a generated one (32 hex digits). The id comes back in ``X-Request-Id`` on every
answer, refusals included, and is set as the request's context
(:func:`headwater.logs.request_context`) for everything the request does: log lines
name it, the pipeline builds the plane's request id from it (so a worker's log lines
name it too), and the OpenAI bodies' ``id`` contains it.

A generation request (*traced_paths*) also gets a root span when tracing is on
(:mod:`headwater.tracing`), continuing the client's W3C ``traceparent`` /
``tracestate`` when it sent valid ones; the pipeline's spans are its children, and
it ends when the response's last byte is sent (an SSE stream's included).
docs/observability.md, "Request ids" and "Traces".
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from frontend.http.errors import ApiError
from frontend.http.middleware import discard_body, send_error
from headwater.logs import request_context
from headwater.tracing import SpanKind, TraceContext, trace_context, tracer
from headwater.tracing.w3c import TraceParent, valid_tracestate

if TYPE_CHECKING:
    from hypercorn.typing import (
        ASGIFramework,
        ASGIReceiveCallable,
        ASGISendCallable,
        ASGISendEvent,
        Scope,
    )

HEADER = "X-Request-Id"
#: What a client's request id may be: printable, no spaces or quotes, bounded.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}")
_HEADER = HEADER.lower().encode()


def valid_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


class RequestIds:
    """Wraps an ASGI app: each ``http`` request runs with its id (and, on *traced_paths*,
    its root span) as its context, and every answer says ``X-Request-Id``."""

    def __init__(
        self, app: ASGIFramework, *, traced_paths: Iterable[str] = (), max_body_bytes: int
    ) -> None:
        self.app = app
        self.traced_paths = frozenset(traced_paths)
        self.max_body_bytes = max_body_bytes

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = traceparent = tracestate = None
        for name, value in scope["headers"]:
            if name == _HEADER:
                given = value.decode("latin-1")
            elif name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"tracestate":
                tracestate = value.decode("latin-1")
        if given is not None and not valid_request_id(given):
            if await discard_body(receive, self.max_body_bytes):
                await send_error(
                    send,
                    ApiError(
                        400,
                        f"{HEADER} must be 1 to 128 characters of [A-Za-z0-9._~:/+=@-]",
                        code="invalid_request_id",
                    ),
                    scope["path"],
                )
            return
        request_id = given or uuid.uuid4().hex
        header = (_HEADER, request_id.encode("latin-1"))
        status = 0

        async def with_id(message: ASGISendEvent) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        t = tracer()
        if not t.enabled or scope["path"] not in self.traced_paths:
            with request_context(request_id):
                await self.app(scope, receive, with_id)
            return
        # A client's trace context is continued only when well formed (W3C: a bad
        # traceparent starts a new trace, and tracestate goes with it).
        parent = TraceParent.parse(traceparent) if traceparent else None
        state = (
            tracestate if parent is not None and tracestate and valid_tracestate(tracestate) else ""
        )
        with (
            t.span(
                f"{scope['method']} {scope['path']}",
                parent=parent,
                tracestate=state,
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": scope["method"],
                    "url.path": scope["path"],
                    "headwater.request_id": request_id,
                },
            ) as span,
            request_context(request_id, span.trace_id),
            trace_context(TraceContext(span)),
        ):
            try:
                await self.app(scope, receive, with_id)
            finally:
                span.set("http.response.status_code", status)
                if status >= 500:
                    span.fail(f"status {status}")
