"""The app's ASGI connection: quart-trio's, with less work per request.

One request's connection handles it in a nursery beside a task that reads its messages
(its body, the client's disconnect, which cancels the handler); here that is the
nursery's own task, one spawn fewer per request (:meth:`EndingHTTPConnection.__call__`).

And Quart sends a response as a head, one ``http.response.body`` message per piece of its
body, then an empty one with ``more_body`` false. Each message is a pass through the
ASGI middleware, hypercorn's stream and the protocol, and the empty one adds a socket
write of its own to every streamed response (the chunked body's end). So
:class:`EndingHTTPConnection` ends a response with its last piece instead, in the same
message, when it knows which piece is last:

- a body of known bytes (a JSON answer, an error: Quart's ``DataBody``) is one message;
- a streamed body ends with the piece the app yields as :class:`LastPiece` (the SSE
  stream's last events with ``[DONE]``, :func:`frontend.http.app.create_app`'s
  ``_stream``); nothing is held back to find it, the app says so as it yields it.

Anything else is sent as Quart sends it. The server then writes the last piece and the
body's end together (:class:`frontend.http.serving.stream.EndingHTTPStream`). Plain
ASGI: any server may receive a last body message that carries bytes.
``tests/test_hypercorn_seam.py`` fingerprints the quart-trio and Quart code this
replaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from quart.utils import encode_headers
from quart.wrappers.response import DataBody, IterableBody
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
    from quart.typing import ResponseTypes


class LastPiece(bytes):
    """A streamed body's last piece: the response ends with it (no empty message
    after). Still ``bytes`` for any other server or client."""

    __slots__ = ()


class EndingHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, whose responses end with their last piece (see
    the module docstring), and which reads the request's messages in its own task."""

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        """quart-trio's: the request handled in a nursery beside its messages (the body,
        the client's disconnect, which cancels the handler), but the messages are read
        by the nursery's own task instead of a task spawned for them: one task fewer per
        request, each a spawn and its scheduler passes on the loop."""
        request = self._create_request_from_scope(send)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.handle_request, nursery, request, send)
            await self.handle_messages(nursery, request, receive)

    async def _send_response(self, send: ASGISendCallable, response: ResponseTypes) -> None:
        """Quart's ``ASGIHTTPConnection._send_response``, but a known body is one
        message and a stream's :class:`LastPiece` ends it."""
        body = getattr(response, "response", None)
        if type(body) is not DataBody and type(body) is not IterableBody:
            await super()._send_response(send, response)  # a file, a werkzeug response
            return
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": encode_headers(response.headers),
            }
        )
        if type(body) is DataBody:
            data = body.data[body.begin : body.end]
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return
        async with body as pieces:
            async for piece in pieces:
                last = type(piece) is LastPiece
                await send(
                    {
                        "type": "http.response.body",
                        "body": piece.encode() if isinstance(piece, str) else piece,
                        "more_body": not last,
                    }
                )
                if last:
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def use_ending_connection(app: QuartTrio) -> None:
    """Serve *app*'s HTTP requests through :class:`EndingHTTPConnection`."""
    app.asgi_http_class = EndingHTTPConnection
