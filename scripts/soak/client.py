"""The soak's HTTP client: one request, sent and ended exactly as planned, and its verdict.

Why not httpx or aiohttp: the soak must tell *who* ended each exchange. A client
library turns a reset by the server, a response cut short and its own close into the
same exception, retries on a fresh connection when a kept-alive one fails, and cannot
reset a connection on purpose. Here every request is plain h11 over a trio socket:
the client closes a stream after *k* events (a cancel), resets its connection
(``SO_LINGER`` 0: an RST, as a killed client process would) half-way through the
upload, while it waits or mid-stream, and anything the server does to the exchange is
seen as it happened.

Connections are kept alive and reused, as real clients do, but never past
:data:`MAX_IDLE_S` (a fraction of the server's keep-alive timeout, so the server never
closes one we are about to use) and never when the kernel says the server closed it
already; so a reused connection that fails was broken by the server, and counts so.

Verdicts (:class:`Outcome`): ``ok`` (a whole response: unary JSON with choices and
usage, or a stream ending in ``[DONE]`` and the chunked terminator), ``rejected`` (an
invalid request answered with an OpenAI-shaped 4xx), ``error`` (a valid request shed
cleanly under load: a 429 or 503 error JSON, or a ``service_unavailable_error`` event
in a stream), ``cancelled`` and ``disconnected`` (the client's own doing), ``lost``
(anything else: a reset or close by the server before the response ended, a response
that is not what it says, a 5xx without a JSON error, no answer within the deadline)
and ``wrong`` (an answer, but not the right one: an invalid request accepted, a valid
one refused with a 4xx or failed with a 500).
"""

from __future__ import annotations

import contextlib
import enum
import select
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import h11
import orjson
import trio

#: Seconds an idle connection may wait in the pool: under the server's keep-alive
#: timeout (5 s by default), so the server never closes one as it is taken.
MAX_IDLE_S = 2.0
_RECEIVE = 65536
#: Seconds one of the soak's own polls (``/debug/runtime``, ``/metrics``) may take.
POLL_TIMEOUT_S = 5.0
#: Bytes of a response body kept (a unary answer is a few kB; an error less).
_MAX_BODY = 1 << 20
#: Statuses a valid request may be refused with cleanly under load (shedding).
SHED_STATUSES = frozenset({429, 503})
#: Error ``type`` of an in-stream error that sheds load (a 503 raised mid-stream).
SHED_TYPES = frozenset({"service_unavailable_error", "requests"})


class Outcome(enum.StrEnum):
    OK = "ok"
    REJECTED = "rejected"
    ERROR = "error"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"
    LOST = "lost"
    WRONG = "wrong"


#: Outcomes that fail the soak.
FAILING = frozenset({Outcome.LOST, Outcome.WRONG})

#: How the client ends a request: read it to its end, close the connection (FIN) after
#: ``after_events`` SSE events, reset it (RST) after ``after_events`` events, after
#: ``after_s`` seconds of waiting, or once ``upload_fraction`` of the body is sent.
How = Literal["complete", "cancel", "reset_events", "reset_wait", "reset_upload"]


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request of the mix: what to send, what is expected, how the client ends it."""

    kind: str
    method: str
    path: str
    body: bytes
    stream: bool
    #: ``ok``: a valid request; ``client_error``: the server must answer 4xx.
    expect: Literal["ok", "client_error"] = "ok"
    how: How = "complete"
    after_events: int = 0
    after_s: float = 0.0
    upload_fraction: float = 0.5
    content_type: str = "application/json"
    #: Streams ask for usage: the last event before ``[DONE]`` must carry it.
    include_usage: bool = True


@dataclass(frozen=True, slots=True)
class Result:
    """What became of one request. Times in seconds on trio's clock."""

    kind: str
    how: str
    outcome: Outcome
    detail: str
    status: int | None
    started: float
    duration_s: float
    events: int
    reused: bool


# --- sans-IO: reading one response ---------------------------------------------------------


@dataclass(slots=True)
class ResponseReader:
    """Collects one response from h11 events: its status, its body (unary) or its SSE
    events (stream), and whether it ended. No I/O."""

    stream: bool
    status: int | None = None
    content_type: str = ""
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    #: SSE ``data:`` events seen, ``[DONE]`` included.
    events: int = 0
    done: bool = False
    usage: bool = False
    error_event: dict[str, Any] | None = None
    malformed: str | None = None
    _pending: bytes = b""

    @property
    def is_sse(self) -> bool:
        return self.status == 200 and self.content_type.startswith("text/event-stream")

    def feed(self, event: h11.Event) -> None:
        if isinstance(event, h11.Response):
            self.status = event.status_code
            for name, value in event.headers:
                if name == b"content-type":
                    self.content_type = value.decode("latin-1").lower()
        elif isinstance(event, h11.Data):
            if self.is_sse:
                self._sse(bytes(event.data))
            elif len(self.body) < _MAX_BODY:
                self.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            self.ended = True

    def _sse(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            self.events += 1
            if self.done:
                self.malformed = self.malformed or "an event after [DONE]"
            elif payload == b"[DONE]":
                self.done = True
            else:
                self._chunk(payload)

    def _chunk(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.malformed = self.malformed or f"an event that is not JSON: {payload[:120]!r}"
            return
        if not isinstance(obj, dict):
            self.malformed = self.malformed or "an event that is not an object"
        elif "error" in obj:
            self.error_event = obj
        elif obj.get("usage"):
            self.usage = True
        elif not isinstance(obj.get("choices"), list):
            self.malformed = self.malformed or f"an event without choices: {payload[:120]!r}"


def openai_error(body: bytes | dict[str, Any]) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI-shaped error body (message and type strings),
    or None if *body* is not one."""
    try:
        obj = orjson.loads(body) if isinstance(body, bytes | bytearray) else body
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return None
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return None
    return error


def verdict(plan: RequestPlan, reader: ResponseReader) -> tuple[Outcome, str]:
    """What a response that arrived whole (``reader.ended``) means for *plan*."""
    status = reader.status
    assert status is not None
    if status >= 400:
        error = openai_error(bytes(reader.body))
        if error is None or not reader.content_type.startswith("application/json"):
            body = bytes(reader.body[:120])
            return Outcome.LOST, f"HTTP {status} without an OpenAI error body: {body!r}"
        label = f"HTTP {status} {error.get('code') or error['type']}"
        if plan.expect == "client_error":
            return (Outcome.REJECTED, label) if status < 500 else (Outcome.WRONG, label)
        return (Outcome.ERROR, label) if status in SHED_STATUSES else (Outcome.WRONG, label)
    if plan.expect == "client_error":
        return Outcome.WRONG, f"HTTP {status} to an invalid request"
    if status != 200:
        return Outcome.WRONG, f"HTTP {status}"
    if plan.stream:
        return _stream_verdict(plan, reader)
    try:
        obj = orjson.loads(bytes(reader.body))
    except orjson.JSONDecodeError:
        return Outcome.LOST, f"a 200 whose body is not JSON: {reader.body[:120]!r}"
    if not isinstance(obj, dict) or not obj.get("choices") or "usage" not in obj:
        return Outcome.LOST, f"a 200 without choices and usage: {reader.body[:120]!r}"
    return Outcome.OK, "HTTP 200"


def _stream_verdict(plan: RequestPlan, reader: ResponseReader) -> tuple[Outcome, str]:
    if not reader.is_sse:
        return Outcome.LOST, f"a 200 stream of type {reader.content_type!r}"
    if reader.malformed:
        return Outcome.LOST, reader.malformed
    if not reader.done:
        return Outcome.LOST, "a stream that ended without [DONE]"
    if reader.error_event is not None:
        error = openai_error(reader.error_event)
        if error is None:
            return Outcome.LOST, f"an error event of the wrong shape: {reader.error_event}"
        label = f"stream error {error.get('code') or error['type']}"
        return (Outcome.ERROR, label) if error["type"] in SHED_TYPES else (Outcome.WRONG, label)
    if plan.include_usage and not reader.usage:
        return Outcome.LOST, "a stream without its usage event"
    return Outcome.OK, "HTTP 200 stream"


def cut_short(plan: RequestPlan, reader: ResponseReader, what: str) -> tuple[Outcome, str]:
    """The server closed or reset the connection (*what*) before the response ended.

    A stream cut after ``[DONE]`` is still cut: the chunked body never ended, which a
    client sees as a broken response."""
    if reader.status is None:
        return Outcome.LOST, f"{what} before any response"
    return Outcome.LOST, f"{what} after HTTP {reader.status}, {reader.events} events"


# --- connections ----------------------------------------------------------------------------


class Connection:
    """A client connection: a trio socket stream and its h11 state."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = trio.current_time()
        self.uses = 0

    def server_closed(self) -> bool:
        """Whether the server closed this idle connection (or sent something unasked):
        the kernel says its socket is readable."""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0))

    async def reset(self) -> None:
        """Abort with an RST, as a killed client would: no FIN, unread data dropped."""
        with contextlib.suppress(OSError):  # already closed
            self.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        await trio.aclose_forcefully(self.stream)

    async def close(self) -> None:
        await trio.aclose_forcefully(self.stream)


@dataclass(slots=True)
class PoolStatistics:
    opened: int = 0
    reused: int = 0
    #: Idle connections the server had closed within MAX_IDLE_S (it should not).
    closed_by_server_while_idle: int = 0
    connect_failures: int = 0


class ConnectionPool:
    """Idle kept-alive connections to one host, newest first.

    Owns every connection it holds; :meth:`aclose` closes them. A connection taken with
    :meth:`take` belongs to the caller until it is given back with :meth:`give_back`.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[Connection] = []
        self.stats = PoolStatistics()

    async def take(self) -> tuple[Connection, bool]:
        """A connection and whether it is a reused one. Raises OSError if none can be
        opened."""
        while self._idle:
            conn = self._idle.pop()
            if trio.current_time() - conn.idle_since > MAX_IDLE_S:
                await conn.close()
                continue
            if conn.server_closed():
                self.stats.closed_by_server_while_idle += 1
                await conn.close()
                continue
            self.stats.reused += 1
            return conn, True
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError:
            self.stats.connect_failures += 1
            raise
        self.stats.opened += 1
        return Connection(stream), False

    async def give_back(self, conn: Connection) -> None:
        """Keep *conn* for another request if its exchange ended cleanly, else close it."""
        h = conn.h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
        else:
            await conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


# --- one request ------------------------------------------------------------------------------


class InFlight:
    """A request under way, as the disconnect storm sees it: cancelling its scope makes
    the request reset its connection and end as ``disconnected``."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.stormed = False

    def storm(self) -> None:
        self.stormed = True
        self.scope.cancel()


class _Abort(Exception):
    """The plan says the client ends the request here."""


def request_head(plan: RequestPlan, host: str) -> h11.Request:
    headers: list[tuple[str, str]] = [("Host", host), ("Accept", "*/*")]
    if plan.method == "POST":
        headers += [("Content-Type", plan.content_type), ("Content-Length", str(len(plan.body)))]
    return h11.Request(method=plan.method, target=plan.path, headers=headers)


async def perform(
    plan: RequestPlan,
    pool: ConnectionPool,
    *,
    deadline_s: float,
    in_flight: set[InFlight] | None = None,
) -> Result:
    """Send *plan* on a pooled connection, end it as planned, return its :class:`Result`.

    Never raises for anything the server does; a request that gets no whole answer
    within *deadline_s* is ``lost``. While it runs it is in *in_flight*, where the
    disconnect storm can end it (``disconnected``).
    """
    started = trio.current_time()
    reader = ResponseReader(plan.stream)
    me = InFlight()
    try:
        conn, reused = await pool.take()
    except OSError as exc:
        return _result(plan, Outcome.LOST, f"cannot connect: {exc}", reader, started, False)
    if in_flight is not None:
        in_flight.add(me)
    outcome: tuple[Outcome, str] | None = None
    try:
        with me.scope, trio.move_on_after(deadline_s) as deadline:
            outcome = await _exchange(plan, conn, reader, pool.host)
        if outcome is None:
            if me.stormed:
                await conn.reset()
                outcome = Outcome.DISCONNECTED, "reset by the client's disconnect storm"
            elif deadline.cancelled_caught:
                await conn.close()
                outcome = Outcome.LOST, f"no whole answer within {deadline_s:g} s"
    finally:
        if in_flight is not None:
            in_flight.discard(me)
        if outcome is None:  # cancelled from outside (the soak stopping)
            await conn.close()
    assert outcome is not None
    if outcome[0] is Outcome.OK or outcome[0] in (Outcome.ERROR, Outcome.REJECTED):
        await pool.give_back(conn)
    elif outcome[0] is not Outcome.DISCONNECTED:
        await conn.close()
    return _result(plan, *outcome, reader, started, reused)


def _result(
    plan: RequestPlan,
    outcome: Outcome,
    detail: str,
    reader: ResponseReader,
    started: float,
    reused: bool,
) -> Result:
    return Result(
        plan.kind,
        plan.how,
        outcome,
        detail,
        reader.status,
        started,
        trio.current_time() - started,
        reader.events,
        reused,
    )


async def _exchange(
    plan: RequestPlan, conn: Connection, reader: ResponseReader, host: str
) -> tuple[Outcome, str]:
    h = conn.h11
    conn.uses += 1
    head = h.send(request_head(plan, host))
    body = plan.body if plan.method == "POST" else b""
    if plan.how == "reset_upload":
        cut = max(1, int(len(body) * plan.upload_fraction))
        try:
            await conn.stream.send_all(head + h.send(h11.Data(data=body[:cut])))
        except trio.BrokenResourceError:
            return cut_short(plan, reader, "the server reset the connection during the upload")
        await conn.reset()
        return Outcome.DISCONNECTED, f"reset after {cut} of {len(body)} body bytes"
    payload = head + (h.send(h11.Data(data=body)) if body else b"") + h.send(h11.EndOfMessage())
    # The server may have answered early and closed: read what it sent.
    with contextlib.suppress(trio.BrokenResourceError):
        await conn.stream.send_all(payload)
    try:
        if plan.how == "reset_wait":
            with trio.move_on_after(plan.after_s):
                return await _read(plan, conn, reader)
            await conn.reset()
            return Outcome.DISCONNECTED, f"reset after waiting {plan.after_s:.2f} s"
        return await _read(plan, conn, reader)
    except _Abort:
        if plan.how == "cancel":
            await conn.close()
            return Outcome.CANCELLED, f"closed after {reader.events} events"
        await conn.reset()
        return Outcome.DISCONNECTED, f"reset after {reader.events} events"


async def _read(plan: RequestPlan, conn: Connection, reader: ResponseReader) -> tuple[Outcome, str]:
    h = conn.h11
    aborts = plan.how in ("cancel", "reset_events")
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            return cut_short(plan, reader, f"a broken response ({exc})")
        if event is h11.NEED_DATA:
            try:
                data = await conn.stream.receive_some(_RECEIVE)
            except trio.BrokenResourceError as exc:
                return cut_short(plan, reader, f"the server reset the connection ({exc})")
            h.receive_data(data)
            continue
        if isinstance(event, h11.ConnectionClosed):
            return cut_short(plan, reader, "the server closed the connection")
        if event is h11.PAUSED:
            return cut_short(plan, reader, "the server sent more than one response")
        assert isinstance(event, h11.Event)
        if isinstance(event, h11.InformationalResponse):
            continue
        reader.feed(event)
        if reader.ended:
            return verdict(plan, reader)
        if aborts and reader.is_sse and reader.events >= plan.after_events and not reader.done:
            raise _Abort


async def get_json(host: str, port: int, path: str) -> Any:
    """:func:`get` decoded as JSON. Raises as :func:`get`, and ValueError for a body that
    is not JSON."""
    return orjson.loads(await get(host, port, path))


async def tokenizer_cache(host: str, port: int) -> tuple[int, int]:
    """The bytes a frontend's bounded tokenizer cache holds and its budget, from its
    ``/dashboard/data`` ((0, 0) without a cache). Raises as :func:`get_json`, and
    KeyError or TypeError for a page of another shape."""
    data = await get_json(host, port, "/dashboard/data")
    cache = data["pool"].get("segment_cache") or {}
    return int(cache.get("bytes", 0)), int(cache.get("max_bytes", 0))


async def get(host: str, port: int, path: str, limit_s: float = POLL_TIMEOUT_S) -> bytes:
    """The body of ``GET path`` (:func:`fetch`). Raises as :func:`fetch`, and ValueError
    for anything but a whole 200."""
    status, body = await fetch(host, port, path, limit_s)
    if status != 200:
        raise ValueError(f"GET {path}: HTTP {status}")
    return body


async def fetch(
    host: str, port: int, path: str, limit_s: float = POLL_TIMEOUT_S
) -> tuple[int, bytes]:
    """``GET path`` on a connection of its own, closed after the answer: the soak's
    own polls leave nothing open between two of them. Returns the status and the body
    (up to 1 MiB). Raises OSError, ValueError (no whole response) or trio.TooSlowError
    (after *limit_s*: :data:`POLL_TIMEOUT_S` by default)."""
    plan = RequestPlan("poll", "GET", path, b"", stream=False)
    reader = ResponseReader(stream=False)
    with trio.fail_after(limit_s):
        stream = await trio.open_tcp_stream(host, port)
        conn = Connection(stream)
        try:
            h = conn.h11
            head = h11.Request(
                method="GET", target=path, headers=[("Host", host), ("Connection", "close")]
            )
            await stream.send_all(h.send(head) + h.send(h11.EndOfMessage()))
            await _read(plan, conn, reader)  # its verdict is for generation requests
        finally:
            await conn.close()
    if reader.status is None or not reader.ended:
        raise ValueError(f"GET {path}: no whole response (HTTP {reader.status})")
    return reader.status, bytes(reader.body)


def outcome_counts(results: Sequence[Result]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts
