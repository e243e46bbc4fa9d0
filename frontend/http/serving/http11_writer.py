"""The server's side of an HTTP/1.1 connection without I/O, for
:class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol`: h11's state machine
for the responses, which hypercorn's ``H11Protocol`` has from h11 and llhttp does not
give.

:class:`ResponseWriter` takes a response's events (a head, body pieces, its end) and
gives back the bytes to write: each head as
:func:`~frontend.http.serving.http11_codec.response_head` writes it, the body framed as
that head says (a length checked, chunks, or bare until a close), a known-length head
held back so that it leaves with its body's first bytes (or its end) in one write. It
keeps what decides the connection's fate: whether it may carry another request after
this response, and whether the client waits for ``100 Continue``.
"""

from __future__ import annotations

import enum

from frontend.http.serving.http11_codec import (
    Framing,
    ResponseHeadError,
    informational_head,
    keep_alive,
    response_head,
    wants_continue,
)


class State(enum.Enum):
    """One side of the connection, in h11's terms."""

    IDLE = enum.auto()  # client: before a head; server: before a request
    WAITING = enum.auto()  # server: a request read, no response started
    BODY = enum.auto()  # a body under way (the request's, or the response's)
    DONE = enum.auto()
    ERROR = enum.auto()


IDLE, WAITING, BODY, DONE, ERROR = State


class ResponseWriter:
    """The responses of one connection, a request at a time, as bytes (h11's server
    side): :meth:`request` when a request head has been read, then :meth:`response`,
    :meth:`body` and :meth:`end` (:meth:`informational` before them), then
    :meth:`recycle` for the next request if :attr:`reusable`.

    An event the state does not allow, or a head or body h11 would not send, raises
    :class:`~frontend.http.serving.http11_codec.ResponseHeadError` and fails the
    writer (``state`` ERROR); once :attr:`client_failed` (the request could not be
    read), it is dropped instead, as hypercorn drops what h11 raises then.
    """

    def __init__(self) -> None:
        self.state = IDLE
        #: The client's side has failed: misuse is dropped, not raised.
        self.client_failed = False
        #: The connection may carry another request after this one.
        self.keep_alive = True
        #: The request's client waits for ``100 Continue`` before its body.
        self.waiting_for_continue = False
        self._method: bytes | None = None
        self._version: bytes | None = None
        # The response under way: its framing, the bytes its length still allows, and
        # its head while held for its body.
        self._framing: Framing = "length"
        self._length_left = 0
        self._held_head: bytes | None = None

    @property
    def reusable(self) -> bool:
        """The response has ended and the connection may carry another request."""
        return self.state is DONE and self.keep_alive

    @property
    def may_answer(self) -> bool:
        """No response has started: the server may answer with one of its own."""
        return self.state is IDLE or self.state is WAITING

    def request(
        self, method: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """A request head has been read (*headers* with lowercased names)."""
        self.state = WAITING
        self._method, self._version = method, http_version
        self.keep_alive = keep_alive(http_version, headers)
        self.waiting_for_continue = wants_continue(http_version, headers)

    def recycle(self) -> None:
        """Ready for the connection's next request."""
        self.state = IDLE
        self._method = self._version = None
        self.waiting_for_continue = False

    def informational(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """A 1xx response's bytes (none if dropped)."""
        if self.state is not WAITING:
            self._misuse("an informational response outside a request")
            return b""
        self.waiting_for_continue = False
        return informational_head(status_code, headers)

    def response(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """A response's head, to write now; none if held for the body's first bytes (or
        its end) when its length is known, so that both leave in one write (or if
        dropped)."""
        if not self.may_answer:
            self._misuse("a second response")
            return b""
        try:
            head = response_head(
                status_code,
                headers,
                method=self._method,
                http_version=self._version,
                keep_alive=self.keep_alive,
            )
        except ResponseHeadError:
            self.state = ERROR
            if self.client_failed:
                return b""
            raise
        self.waiting_for_continue = False
        self.state = BODY
        self._framing, self._length_left = head.framing, head.length
        self.keep_alive = head.keep_alive
        if any(name.lower() == b"content-length" for name, _ in headers):
            # The next event is this response's body (or its end): see the h11 protocol.
            self._held_head = head.data
            return b""
        return head.data

    def body(self, data: bytes) -> bytes:
        """A piece of the response's body, framed (after the held head, if any)."""
        if self.state is not BODY:
            self._misuse("a body outside a response")
            return b""
        framing = self._framing
        if framing == "length":
            if len(data) > self._length_left:
                self.state = ERROR
                raise ResponseHeadError("Too much data for declared Content-Length")
            self._length_left -= len(data)
        elif framing == "chunked" and data:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        return self._with_head(data)

    def end(self) -> bytes:
        """The end of the response's body (after the held head, if any)."""
        if self.state is not BODY:
            self._misuse("the end of a body outside a response")
            return b""
        if self._framing == "length" and self._length_left:
            self.state = ERROR
            raise ResponseHeadError("Too little data for declared Content-Length")
        self.state = DONE
        return self._with_head(b"0\r\n\r\n" if self._framing == "chunked" else b"")

    def _with_head(self, data: bytes) -> bytes:
        held = self._held_head
        if held is None:
            return data
        self._held_head = None
        return held + data

    def _misuse(self, what: str) -> None:
        """An event the response's state does not allow: dropped once the client's
        side has failed (h11 would raise, and hypercorn drop it), raised otherwise."""
        if not self.client_failed:
            self.state = ERROR
            raise ResponseHeadError(f"cannot send {what} now")
