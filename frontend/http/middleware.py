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
  to skip.

All are plain ASGI and know nothing of the server underneath
(:mod:`frontend.http.serving` holds what is specific to hypercorn).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from frontend.http.errors import ApiError, rendered
from headwater.instrumentation import Activity

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
    that gets no answer (its client left first) is not counted either."""

    def __init__(
        self, app: ASGIFramework, count: Callable[[int], object], *, skip: Callable[[str], bool]
    ) -> None:
        self.app = app
        self.count = count
        self.skip = skip

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http" or self.skip(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def counted_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start":
                self.count(message["status"])
            await send(message)

        await self.app(scope, receive, counted_send)


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
        *((name.lower().encode("latin-1"), value.encode("latin-1"))
          for name, value in err.headers.items()),
    ]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
