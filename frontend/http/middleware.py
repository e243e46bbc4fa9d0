"""ASGI middleware around the HTTP app: what every request gets, whichever route.

- :class:`MarkActivity`: each request counts as work in flight for the loop monitor.
  With nothing in flight the monitor rests (:mod:`headwater.instrumentation.activity`);
  a request wakes it for as long as the request lasts (an SSE stream included) and a
  second after. Lifespan events are not requests.
- :class:`ShieldFinalSend`: a response's last body send completes even if the request
  task is cancelled. hypercorn finishes a response inside that send (closes the stream,
  closes the connection after ``Connection: close``, restarts the keep-alive idle timer),
  and quart-trio cancels the request task right there: that work was lost, and the idle
  timeout never fired (docs/architecture.md, "Hypercorn and quart-trio pitfalls handled").
  The shield has a deadline.

- :class:`CountResponses`: every answer's status code is counted, whoever sent it (a
  route, an error handler, the API-key check, admission), but for the paths it is told
  to skip; error answers are also kept, with their request ids, for the dashboard's
  recent errors (:mod:`frontend.http.recent_errors`).

All are plain ASGI and know nothing of the server underneath
(:mod:`frontend.http.serving` holds what is specific to hypercorn).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from frontend.http.errors import ApiError, rendered
from frontend.http.recent_errors import MAX_BODY, ErrorAnswer, RecentErrors, error_fields
from headwater.instrumentation import Activity
from headwater.logs import current_request

if TYPE_CHECKING:
    from hypercorn.typing import (
        ASGIFramework,
        ASGIReceiveCallable,
        ASGISendCallable,
        ASGISendEvent,
        Scope,
    )


class MarkActivity:
    """Wraps an ASGI app so that each ``http`` call runs inside ``with activity:``."""

    def __init__(self, app: ASGIFramework, activity: Activity) -> None:
        self.app = app
        self.activity = activity

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.activity:
            await self.app(scope, receive, send)


class ShieldFinalSend:
    """Wraps an ASGI app so that its last ``http.response.body`` send is shielded from
    cancellation for up to *deadline* seconds (then it is cancelled after all)."""

    def __init__(self, app: ASGIFramework, *, deadline: float) -> None:
        self.app = app
        self.deadline = deadline

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.move_on_after(self.deadline, shield=True):
                    await send(message)
                return
            await send(message)

        await self.app(scope, receive, guarded_send)


class CountResponses:
    """Wraps an ASGI app so that each ``http`` answer's status goes to *count*, once,
    when its head is sent; requests whose path *skip* accepts are not counted. A request
    that gets no answer (its client left first) is not counted either. With *errors*,
    each answer of status 400 or more is added there too, with the request's id (the
    context :class:`~frontend.http.request_ids.RequestIds` set) and the error's type and
    message from the first :data:`~frontend.http.recent_errors.MAX_BODY` bytes of its
    body."""

    def __init__(
        self,
        app: ASGIFramework,
        count: Callable[[int], object],
        *,
        skip: Callable[[str], bool],
        errors: RecentErrors | None = None,
    ) -> None:
        self.app = app
        self.count = count
        self.skip = skip
        self.errors = errors

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http" or self.skip(scope["path"]):
            await self.app(scope, receive, send)
            return
        failed: tuple[float, int] | None = None  # an error answer's time and status
        body = b""

        def record() -> None:
            assert self.errors is not None
            assert failed is not None
            context = current_request()
            kind, message = error_fields(body)
            self.errors.add(
                ErrorAnswer(
                    failed[0],
                    failed[1],
                    scope["method"],
                    scope["path"],
                    context.request_id if context is not None else None,
                    kind,
                    message,
                )
            )

        async def counted_send(message: ASGISendEvent) -> None:
            nonlocal failed, body
            if message["type"] == "http.response.start":
                status = message["status"]
                self.count(status)
                if status >= 400 and self.errors is not None:
                    failed = (time.time(), status)
            elif message["type"] == "http.response.body" and failed is not None:
                body += message.get("body", b"")[: MAX_BODY - len(body)]
                if not message.get("more_body", False) or len(body) >= MAX_BODY:
                    record()
                    failed = None
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            if failed is not None:  # the body never ended: recorded with what came
                record()


async def discard_body(receive: ASGIReceiveCallable, limit: int) -> bool:
    """Read the request's body to its end (or past *limit* bytes) and drop it. False if
    the client went away meanwhile: nobody is left to answer.

    For middleware that answers a request itself (a refusal): hypercorn closes a
    connection whose request body has not all arrived when its response ends, and a
    client still writing that body (httpx writes it all before it reads) gets a reset
    instead of the answer.
    """
    seen = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        if message["type"] != "http.request":
            continue
        seen += len(message.get("body", b""))
        if not message.get("more_body", False) or seen > limit:
            return True


async def send_error(send: ASGISendCallable, err: ApiError, path: str) -> None:
    """Answer with *err* (its status, body and headers, in the shape of the API at
    *path*: :func:`~frontend.http.errors.rendered`), in two sends."""
    status, body = rendered(err, path)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        *(
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in err.headers.items()
        ),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
