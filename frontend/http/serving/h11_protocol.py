"""Fix 5: a known-length response's head leaves with its body, in one write; and the
limits' own answers say what was refused.

hypercorn writes a response's head as soon as the app starts the response, and its body
in a second write. :class:`HeadWithBodyH11Protocol` holds the head of a response whose
length is known (its body is in hand: a JSON answer) and writes it with the body, in one
``write(2)``, as hyper and nginx do. A streamed response (no Content-Length) still sends
its head at once, before the first event.

hypercorn answers a request it cannot parse with an empty error response; the two the
transport limits cause, 431 (head over ``h11_max_incomplete_size``) and 408 (head not
done within ``header_timeout``), get an OpenAI-style error body naming the limit.
"""

from __future__ import annotations

import json
from itertools import chain

import h11
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import H11SendableEvent

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.limits import HEADER_TIMEOUT, HEADER_TOO_LARGE


class HeadWithBodyH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, holding a known-length head for its body.

    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` puts one in place of
    the H11Protocol hypercorn made for a connection, before the connection's first
    byte is read; built with the same arguments, it adds only :attr:`_held_head`.
    """

    config: ServerConfig
    #: The head of a known-length response, until the body's first bytes (or its end).
    _held_head: bytes | None = None

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        """hypercorn's ``H11Protocol._send_h11_event``, holding a known-length head back
        until the body's first bytes (or its end) go out with it."""
        held = self._held_head
        data: bytes | None
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            data = None
        if held is not None:
            self._held_head = None
            data = held + (data or b"")
        elif type(event) is h11.Response and data and _has_length(event):
            # The next event is this response's body (or its end, for an empty or HEAD
            # response): the app sends its start and body back to back. A connection
            # that closes in between (the app failed) never sends this head, and the
            # client sees a closed connection instead of a truncated body.
            self._held_head = data
            return
        if data is not None:
            await self.send(RawData(data=data))


    async def _send_error_response(self, status_code: int) -> None:
        """hypercorn's ``H11Protocol._send_error_response``, with a JSON error body for
        the statuses of the transport limits (431 is also reported to
        ``config.refused``); others go to it as they are. Each is reported to
        ``config.answered``."""
        if status_code == 431:
            self.config.refused(HEADER_TOO_LARGE)
        self.config.answered(status_code)
        body = _limit_error(status_code, self.config)
        if body is None:
            await super()._send_error_response(status_code)
            return
        head = [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]  # fmt: skip
        await self._send_h11_event(h11.Response(
            status_code=status_code, headers=list(chain(head, self.config.response_headers("h11")))
        ))  # fmt: skip
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def _limit_error(status_code: int, config: ServerConfig) -> bytes | None:
    """The OpenAI-style error body of a limit's status, None for any other."""
    if status_code == 431:
        code = HEADER_TOO_LARGE
        message = (f"The request's head (request line and header fields) is larger than "
                   f"this server's limit of {config.h11_max_incomplete_size} bytes.")
    elif status_code == 408:
        code = HEADER_TIMEOUT
        message = (f"The request's head did not arrive within {config.header_timeout:g} s "
                   f"of its first byte.")
    else:
        return None
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _has_length(response: h11.Response) -> bool:
    return any(name == b"content-length" for name, _ in response.headers)
