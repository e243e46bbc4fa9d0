"""hypercorn's HTTP stream, with a last body message written with the body's end.

hypercorn's ``HTTPStream`` turns an ``http.response.body`` message that ends the
response into two protocol events, ``Body`` then ``EndBody``, and the protocol writes
each: a streamed (chunked) response's last events and its ``0`` chunk left in two
writes. :class:`EndingHTTPStream` sends one :class:`LastBody` instead, which
:class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol` writes at once:
one ``write(2)``, and one wake-up of the client, fewer per streamed response. The app
ends its responses that way (:mod:`frontend.http.connection`). Everything else is
hypercorn's, whose ``app_send`` ``tests/test_hypercorn_seam.py`` fingerprints.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import time
from typing import TYPE_CHECKING, Any

from hypercorn.protocol.events import Body, StreamClosed
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.utils import suppress_body

if TYPE_CHECKING:
    from hypercorn.typing import ASGISendEvent


@dataclass(frozen=True)
class LastBody(Body):
    """A response's last bytes and its end, to write together."""


#: hypercorn's: an HTTP/1.1 connection has one stream at a time.
STREAM_ID = 1


class EndingHTTPStream(HTTPStream):
    """hypercorn's ``HTTPStream``, which sends a last body message that carries bytes
    as one :class:`LastBody` event."""

    @classmethod
    def of(cls, protocol: Any) -> EndingHTTPStream:
        """The stream of an HTTP/1.1 request on *protocol* (either parser's: both carry
        hypercorn's ``H11Protocol`` attributes), as hypercorn's ``_create_stream`` makes it."""
        return cls(
            protocol.app,
            protocol.config,
            protocol.context,
            protocol.task_group,
            protocol.ssl,
            protocol.client,
            protocol.server,
            protocol.stream_send,
            STREAM_ID,
        )

    async def app_send(self, message: ASGISendEvent | None) -> None:
        """hypercorn's ``app_send``; for a last ``http.response.body`` with bytes (no
        trailers, a body the method and status allow), ``Body`` and ``EndBody`` as one
        :class:`LastBody`, then the rest of its ``_send_closed``."""
        if (
            message is not None
            and message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and self.state is ASGIHTTPState.RESPONSE
            and (data := message.get("body", b""))
            and not self.response.get("trailers", False)
            and not suppress_body(self.scope["method"], int(self.response["status"]))
        ):
            await self.send(LastBody(stream_id=self.stream_id, data=bytes(data)))
            self.state = ASGIHTTPState.CLOSED
            await self.config.log.access(self.scope, self.response, time() - self.start_time)
            await self.send(StreamClosed(stream_id=self.stream_id))
            return
        await super().app_send(message)
