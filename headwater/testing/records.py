"""What happened to each request, as the frontend saw it: for a test's asserts.

:class:`Recorder`, the outermost ASGI middleware of the in-process server, opens a
:class:`RequestRecord` for every HTTP request (whichever way it came: the in-process
transport or the optional socket) and fills it in from both ends: what passes through the
app (the body it read, the status and response it sent) and, from the request plane below
the frontend, a :class:`Leg` per try on a worker (its tokens, its end, any fault
injected). The plane finds the record through a context variable, which the request's
tasks inherit from the task the app is called in.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio

#: The record of the HTTP request whose task this is, if any.
current_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "headwater_testing_record", default=None
)

#: What is appended to a request's plane id: ``.c<n>`` for its n-th choice (``n`` > 1,
#: frontend/pipeline.py), ``.m<n>`` per migration, ``.r<n>`` per retry on another worker
#: (frontend/router/dispatch.py). The id itself (the HTTP request id and 8 hex digits)
#: may hold dots, never at its end.
_SUFFIXES = re.compile(r"(?:\.[cmr]\d+)*$")
_MIGRATION = re.compile(r"\.m(\d+)")


def plane_request(request_id: str) -> tuple[str, int]:
    """A leg's plane id read: the request's own id, and the migration it belongs to."""
    suffixes = _SUFFIXES.search(request_id)
    assert suffixes is not None  # the pattern matches the empty string at the end
    found = _MIGRATION.findall(suffixes.group())
    return request_id[: suffixes.start()], int(found[-1]) if found else 0


@dataclass(slots=True)
class Leg:
    """One try of a request on one worker, as the request plane saw it.

    ``request_id`` is the plane's: the request's own id, ``<id>.c<n>`` for its n-th
    choice (``n`` > 1), ``<id>.r<n>`` for its n-th retry on another worker,
    ``<id>.m<n>`` after its n-th migration. ``outcome``:
    ``running``, ``finished`` (the worker ended it), ``error`` (the worker answered an
    Error: ``error_code`` says which), ``cancelled`` (the frontend left it: the client
    went away, a stop string, or the request moved on), ``unreachable`` (the worker had
    stopped), or the injected fault that ended it: ``refused``, ``broken``,
    ``malformed``, ``killed``.
    """

    worker_id: str
    role: str  # prefill | decode | agg
    request_id: str
    started: float  # trio time the frontend sent it
    ended: float | None = None
    tokens: int = 0  # output tokens the worker sent
    outcome: str = "running"
    error_code: str | None = None
    finish_reason: str | None = None  # the engine's: stop | length
    faults: list[str] = field(default_factory=list)  # injected into this leg, by name
    #: Set once the worker is done with the leg (its replies closed).
    finished: trio.Event = field(default_factory=trio.Event, repr=False, compare=False)

    @property
    def migration(self) -> int:
        """Which attempt of the request this leg belongs to, from 0 (before any
        migration)."""
        return plane_request(self.request_id)[1]


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request as the frontend saw it: filled in by :class:`Recorder` as the app
    reads and answers it. Times are trio's clock."""

    method: str
    path: str
    headers: dict[str, str]  # the request's, names lower-cased
    started: float
    #: When the app's call returned (None while it runs).
    ended: float | None = None
    #: The status the app answered (None before its head, and for good when the client
    #: left first; an app that failed first sent none: see ``error``).
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    legs: list[Leg] = field(default_factory=list)
    #: Faults that hit this request, by name (admission's ``reject`` included).
    faults: list[str] = field(default_factory=list)
    #: What the app raised, if it did (the client got a 500 or a cut body).
    error: Exception | None = None
    #: Set once the app's call returned.
    finished: trio.Event = field(default_factory=trio.Event, repr=False, compare=False)
    _body: list[bytes] = field(default_factory=list, repr=False)
    _response: list[bytes] = field(default_factory=list, repr=False)

    @property
    def body(self) -> Any:
        """The request's body as the app read it (all of it, but for a request refused
        before): decoded from JSON; the raw bytes if it is not JSON; None if empty."""
        data = b"".join(self._body)
        if not data:
            return None
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return data

    @property
    def response(self) -> bytes:
        """The response body, as far as the app sent it."""
        return b"".join(self._response)

    @property
    def request_id(self) -> str | None:
        """The frontend's id for it (its ``X-Request-Id`` answer header): what its log
        lines name, and the start of its legs' plane ids."""
        return self.response_headers.get("x-request-id")

    @property
    def generated(self) -> list[Leg]:
        """The legs that generate (decode or aggregated; not the prefill's)."""
        return [leg for leg in self.legs if leg.role != "prefill"]

    @property
    def migrations(self) -> int:
        """Times the request moved to other workers after its stream broke."""
        return max((leg.migration for leg in self.legs), default=0)

    @property
    def attempt(self) -> int:
        """Attempts the request took: 1, plus one per migration."""
        return self.migrations + 1

    @property
    def workers(self) -> list[str]:
        """The workers of its legs, in order (the routing)."""
        return [leg.worker_id for leg in self.legs]

    @property
    def tokens(self) -> int:
        """Output tokens the workers sent for it, every attempt together."""
        return sum(leg.tokens for leg in self.generated)

    @property
    def finish_reason(self) -> str | None:
        """The engine's finish reason (stop, length), from the leg that finished."""
        return next(
            (
                leg.finish_reason
                for leg in reversed(self.generated)
                if leg.finish_reason is not None
            ),
            None,
        )

    async def settled(self) -> None:
        """Return once the request is over on every side: the app's call returned and
        each worker is done with its leg (a cancellation reached it). What the frontend
        books after the client has its answer (``ended``, a leg's ``outcome``) is final
        then. Waits for events only: no time passes on trio's clock."""
        await self.finished.wait()
        for leg in self.legs:
            await leg.finished.wait()

    def json(self) -> Any:
        """The response body, decoded (a unary answer or an error)."""
        return orjson.loads(self.response)

    def events(self) -> list[Any]:
        """A streamed response's SSE events, decoded; ``[DONE]`` is the string ``"DONE"``."""
        events: list[Any] = []
        for line in self.response.decode().splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append("DONE" if data == "[DONE]" else orjson.loads(data))
        return events


class Recorder:
    """ASGI middleware, outermost: a :class:`RequestRecord` per HTTP request, appended to
    *records*, set as :data:`current_record` for the request's tasks (they inherit it
    from the task this runs in), and filled in from what passes through."""

    def __init__(self, app: Any, records: list[RequestRecord]) -> None:
        self.app = app
        self.records = records

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(
            scope["method"], scope["path"], _headers(scope["headers"]), trio.current_time()
        )
        self.records.append(record)
        current_record.set(record)

        async def receive_recorded() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                record._body.append(bytes(message.get("body", b"")))
            return message

        async def send_recorded(message: Any) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                record.response_headers = _headers(message.get("headers", []))
            elif message["type"] == "http.response.body":
                record._response.append(bytes(message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, receive_recorded, send_recorded)
        except Exception as exc:
            record.error = exc
            raise
        finally:
            record.ended = trio.current_time()
            record.finished.set()


def _headers(raw: Any) -> dict[str, str]:
    return {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1") for k, v in raw}
