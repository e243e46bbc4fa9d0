"""ASGI middleware: every HTTP request counts as work in flight for the loop monitor.

Why: with nothing in flight the loop monitor rests (:mod:`headwater.instrumentation.activity`);
a request, whichever route, wakes it for as long as the request lasts (an SSE stream
included) and a second after. Lifespan events are not requests.
"""

from __future__ import annotations

from typing import Any

from headwater.instrumentation import Activity

ASGIApp = Any


class MarkActivity:
    """Wraps an ASGI app so that each ``http`` call runs inside ``with activity:``."""

    def __init__(self, app: ASGIApp, activity: Activity) -> None:
        self.app = app
        self.activity = activity

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.activity:
            await self.app(scope, receive, send)
