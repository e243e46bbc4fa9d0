"""One HTTP/1.1 exchange per connection, for the small loopback endpoints.

A worker's ``/metrics`` and a group supervisor's view of its processes answer a scraper
or a sibling process on loopback: one request, one response, ``Connection: close``. They
need no HTTP server, only a bounded read of a request head and a bounded write of the
answer, so that a silent or stuck peer costs a task for a few seconds and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final

import trio

#: A request head larger than this is not read further (and gets no answer).
MAX_HEAD_BYTES: Final = 16384
#: Seconds a peer gets to send its head, and to take the answer.
READ_TIMEOUT_S: Final = 5.0
WRITE_TIMEOUT_S: Final = 5.0

#: (status line, content type, body) for a request head.
Responder = Callable[[bytes], Awaitable[tuple[str, str, bytes]]]

log = logging.getLogger(__name__)


async def answer_one(stream: trio.abc.Stream, respond: Responder, *, name: str) -> None:
    """Read one request head from *stream*, answer it with *respond*, close.

    Once a request line has arrived, the head read so far is answered (one that stops
    early, or runs past ``MAX_HEAD_BYTES``, is answered as it is: *respond* sees what
    came); without one the connection just closes. A ``HEAD`` request gets the headers
    only. A peer that goes away is no error; any other
    failure is logged under *name* and ends this connection only.
    """
    try:
        async with stream:
            head = b""
            with trio.move_on_after(READ_TIMEOUT_S):
                while b"\r\n\r\n" not in head and len(head) <= MAX_HEAD_BYTES:
                    data = await stream.receive_some(4096)
                    if not data:
                        break
                    head += data
            if b"\r\n" not in head:
                return  # not even a request line: just close
            status, content_type, body = await respond(head)
            method = head.split(b" ", 1)[0]
            response = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + (b"" if method == b"HEAD" else body)
            with trio.move_on_after(WRITE_TIMEOUT_S):
                await stream.send_all(response)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the peer went away
    except Exception:  # one broken request must not take the server down
        log.exception("%s: a connection failed", name)
