"""A collector that takes OTLP/HTTP traces and drops them: what tracing's cost is
measured against (docs/observability.md, "What tracing costs").

    python -m scripts.otlp_sink --port 4318 &
    headwater serve --otlp-endpoint http://127.0.0.1:4318

Each POST's body is read whole and answered ``200`` with an empty
``ExportTraceServiceResponse`` (zero bytes of protobuf), so the exporter sees a healthy
collector and does all of its work; the spans and requests received are counted and
printed when the sink stops (Ctrl-C or SIGTERM). Loopback only.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator

import trio

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"


class Counts:
    requests = 0
    body_bytes = 0


async def request_bodies(stream: trio.SocketStream) -> AsyncIterator[bytes]:
    """The body of each request on one keep-alive HTTP/1.1 connection (each with a
    Content-Length), until the client closes it; the caller answers each in turn."""
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some()
            if not data:
                return
            buffer += data
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buffer) < length:
            data = await stream.receive_some()
            if not data:
                return
            buffer += data
        body, buffer = buffer[:length], buffer[length:]
        yield body


async def handle(stream: trio.SocketStream, counts: Counts) -> None:
    """One connection: every request counted and answered."""
    async with stream:
        async for body in request_bodies(stream):
            counts.requests += 1
            counts.body_bytes += len(body)
            await stream.send_all(ANSWER)


async def main(port: int) -> None:
    counts = Counts()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
            nursery.start_soon(trio.serve_listeners, lambda s: handle(s, counts), listeners)
            print(
                f"otlp sink on http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", flush=True
            )
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    print(f"otlp sink: {counts.requests} exports, {counts.body_bytes} bytes", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    trio.run(main, parser.parse_args().port)
    sys.exit(0)
