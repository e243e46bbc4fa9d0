"""One process of a group relays the shared port's group views to its supervisor.

With ``headwater serve --processes N``, ``GET /metrics`` and ``GET /dashboard/data``
on the shared port describe the whole group. The process that accepted the
connection does not compute that: it relays the request to the supervisor's group
view (``FrontendConfig.group_url``, loopback), which asks every process on its
private port and merges (``headwater.cluster.group_view``). The same paths on this
process's private port answer for it alone, as a single frontend's do.

The relay is one plain HTTP/1.1 request per call (``Connection: close``), bounded by
:data:`RELAY_TIMEOUT_S`: this loop only waits for the answer and copies its bytes.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import trio

#: Seconds the supervisor has to answer (it gives each process 2 s).
RELAY_TIMEOUT_S: Final = 5.0
MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024


class GroupViewUnavailable(Exception):
    """The supervisor did not answer (it is stopping, or stalled)."""


@dataclass(frozen=True, slots=True)
class Relayed:
    status: int
    content_type: str
    body: bytes


class GroupRelay:
    """Relays to the group view at *group_url* the requests that arrived on the shared
    socket *listen_fd* (those on this process's private port are its own)."""

    def __init__(self, group_url: str, listen_fd: int) -> None:
        parts = urlsplit(group_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"group_url needs a host and a port, got {group_url!r}")
        self.host, self.port = parts.hostname, parts.port
        with socket.socket(fileno=os.dup(listen_fd)) as shared:
            #: The shared socket's port: a request whose server port it is came there.
            self.public_port: int = shared.getsockname()[1]

    def is_shared(self, server: tuple[str, int | None] | None) -> bool:
        """Whether a request with ASGI ``scope["server"]`` *server* came in on the
        shared port."""
        return server is not None and server[1] == self.public_port

    async def get(self, target: str, authorization: str | None) -> Relayed:
        """GET *target* (path and query) from the group view. Raises
        GroupViewUnavailable."""
        headers = {"Authorization": authorization} if authorization else {}
        try:
            with trio.fail_after(RELAY_TIMEOUT_S):
                return await http_get(self.host, self.port, target, headers)
        except trio.TooSlowError as exc:
            raise GroupViewUnavailable(f"no answer within {RELAY_TIMEOUT_S:g} s") from exc


async def http_get(
    host: str,
    port: int,
    target: str,
    headers: Mapping[str, str],
    tls: ssl.SSLContext | None = None,
) -> Relayed:
    """One plain HTTP/1.1 GET on a new connection (``Connection: close``), read to its
    end: what a group's processes and their supervisor ask each other on loopback (no
    pool, no proxy; over *tls* when the processes' private ports serve HTTPS). Bound it
    with a cancel scope. Raises GroupViewUnavailable."""
    head = f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    data = b""
    try:
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        if tls is not None:  # https_compatible: a close without close_notify ends the body
            stream = trio.SSLStream(stream, tls, server_hostname=host, https_compatible=True)
        async with stream:
            await stream.send_all((head + "\r\n").encode("latin-1"))
            while chunk := await stream.receive_some(65536):
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise GroupViewUnavailable(f"{host}:{port}{target}: answer too large")
    except (OSError, trio.BrokenResourceError) as exc:
        raise GroupViewUnavailable(f"{host}:{port}{target} did not answer: {exc!r}") from exc
    return parse_response(data)


def parse_response(data: bytes) -> Relayed:
    """A whole ``Connection: close`` HTTP/1.1 response (pure). Raises
    GroupViewUnavailable for one that is not."""
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise GroupViewUnavailable("the group view's answer is not HTTP")
    content_type = "text/plain"
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-type":
            content_type = value.strip().decode("latin-1")
        elif key == b"content-length":
            length = int(value.strip()) if value.strip().isdigit() else None
    if length is not None and len(body) != length:
        raise GroupViewUnavailable("the group view's answer was cut short")
    try:
        return Relayed(int(parts[1]), content_type, body)
    except ValueError as exc:
        raise GroupViewUnavailable("the group view's answer has no status") from exc
