"""Raw-socket clients for the attacker's suite (tests/test_attack_*.py): a client that sends
exactly the bytes it means to, when it means to, and reads what the server answers.

Policy: loopback only; every read has a deadline (``within``), so a server that never
answers fails a test instead of hanging it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import trio

KEY = "attack-suite-key"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


async def open_raw(url: str) -> trio.SocketStream:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def until_closed(stream: trio.abc.Stream, within: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a
    close; what it sent before may then be lost); then *stream* is closed too."""
    seen = b""
    try:
        with trio.fail_after(within):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return seen
                if not data:
                    return seen
                seen += data
    finally:
        await trio.aclose_forcefully(stream)


@dataclass
class Answer:
    status: int
    head: bytes
    body: bytes

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower().encode():
                return value.strip().decode("latin-1")
        return None

    def error(self) -> dict[str, object]:
        """The OpenAI-style error of the body."""
        error: dict[str, object] = orjson.loads(self.body)["error"]
        return error


async def read_answer(
    stream: trio.abc.Stream, buffered: bytearray | None = None, within: float = 5.0
) -> Answer:
    """One HTTP/1.1 response with a Content-Length (informational ones included: a
    ``100 Continue`` is an answer of its own). *buffered* holds bytes read past an earlier
    answer, and keeps those read past this one."""
    data = buffered if buffered is not None else bytearray()
    with trio.fail_after(within):
        while b"\r\n\r\n" not in data:
            more = await stream.receive_some(65536)
            if not more:
                raise EOFError(f"closed before a whole head: {bytes(data)!r}")
            data += more
        end = data.index(b"\r\n\r\n") + 4
        head = bytes(data[:end])
        status = int(head.split(b" ", 2)[1])
        answer = Answer(status, head, b"")
        length = int(answer.header("content-length") or 0) if status >= 200 else 0
        while len(data) < end + length:
            more = await stream.receive_some(65536)
            if not more:
                raise EOFError("closed before a whole body")
            data += more
        answer.body = bytes(data[end : end + length])
        del data[: end + length]
    return answer


def post(path: str, body: bytes, *, headers: bytes = b"", length: int | None = None) -> bytes:
    """A POST head (and *body*) with a JSON content type; *length* overrides the
    Content-Length (a client that announces more than it sends)."""
    size = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n".encode()
        + headers
        + b"\r\n"
        + body
    )


class LoopGaps:
    """The longest the trio loop went without running a ticker that asks to run every
    *period* s: what a stall of the loop (a frontend served in the same loop) costs.
    Use as ``async with LoopGaps() as gaps: ...; gaps.worst``."""

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.worst = 0.0
        self._nursery: trio.Nursery | None = None
        self._manager: object = None

    async def _tick(self) -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(self.period)
            self.worst = max(self.worst, trio.current_time() - start - self.period)

    async def __aenter__(self) -> LoopGaps:
        self._manager = trio.open_nursery()
        self._nursery = await self._manager.__aenter__()
        self._nursery.start_soon(self._tick)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        await self._manager.__aexit__(None, None, None)  # type: ignore[attr-defined]
