"""The HTTP/1.1 policy both protocols share, whichever parser reads the requests: the
answers the server writes itself, ``100 Continue`` on the app's first ``receive``, and
what :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` asks of a protocol.

:class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol` (h11) and
:class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol` (llhttp) each take
their policy from here and from :mod:`~frontend.http.serving.limits`, so that the two
cannot drift apart: the same refusals, with the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.limits import HEADER_TIMEOUT, HEADER_TOO_LARGE, Fault

if TYPE_CHECKING:
    from hypercorn.typing import (
        AppWrapper,
        ASGIReceiveCallable,
        ASGIReceiveEvent,
        ASGISendCallable,
        Scope,
    )


class Http11(Protocol):
    """What the TCP server reads of its connection's HTTP/1.1 protocol to time slow
    clients, whichever parser it has (h11's states, in h11's terms)."""

    #: Request heads seen on the connection: one more means a head ended.
    keep_alive_requests: int

    @property
    def awaiting_head(self) -> bool:
        """The next bytes received start a request head (h11: the client is IDLE)."""

    @property
    def receiving_body(self) -> bool:
        """A request's body is still to come (h11: the client is in SEND_BODY)."""

    @property
    def between_requests(self) -> bool:
        """No request is under way: an answer of the server's own may be written
        (h11: the server is IDLE)."""

    async def _send_error_response(self, status_code: int) -> None:
        """Answer *status_code* and end the response (the caller closes)."""


def error_body(code: str, message: str) -> bytes:
    """An OpenAI-style error body, as the app's own errors are."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def limit_error(status_code: int, config: ServerConfig) -> tuple[str, str] | None:
    """The error code and message of a limit's status, None for any other."""
    if status_code == 431:
        return HEADER_TOO_LARGE, (
            "The request's head (request line and header fields) is larger than this "
            f"server's limit of {config.h11_max_incomplete_size} bytes."
        )
    if status_code == 408:
        return HEADER_TIMEOUT, (
            f"The request's head did not arrive within {config.header_timeout:g} s of its "
            "first byte."
        )
    return None


def json_error_head(body: bytes) -> list[tuple[bytes, bytes]]:
    """The head fields of an error answer with *body*, closing the connection."""
    return [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]


def refusal(fault: Fault, config: ServerConfig) -> bytes:
    """The whole answer to *fault*, as bytes: its status with the reason phrase, an
    OpenAI-style error body and ``Connection: close``. Written past the parser, which
    has not read the head (or would take the answer for the request's own); reports
    the refusal and the answer to *config*."""
    config.refused(fault.reason)
    config.answered(fault.status)
    body = error_body(fault.reason, fault.message)
    head = [*json_error_head(body), *config.response_headers("h11")]
    phrase = HTTPStatus(fault.status).phrase.encode()
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (fault.status, phrase),
            *(name + b": " + value + b"\r\n" for name, value in head),
            b"\r\n",
            body,
        )
    )


class ContinueOnReceive:
    """An app wrapper whose app's ``receive`` first awaits *on_receive* (which sends
    ``100 Continue`` if the client waits for it): the client sends a body only when the
    app reads it. hypercorn's AppWrapper interface, per request."""

    def __init__(self, app: AppWrapper, on_receive: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self.on_receive = on_receive

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Callable[..., Any],
        call_soon: Callable[..., Any],
    ) -> None:
        on_receive = self.on_receive

        async def receive_inviting() -> ASGIReceiveEvent:
            await on_receive()
            return await receive()

        await self.app(scope, receive_inviting, send, sync_spawn, call_soon)
