"""Start-up checks that fail fast: one clear line before anything slow starts.

A port another server holds, a tokenizer path with no tokenizer, a model directory that
is not there, a vLLM server that does not answer: each is found here in milliseconds,
and the command prints one line naming the option and exits 2, instead of a traceback
after the tokenizer loaded, a group forked or a model server was waited for (300 s).
Each check raises ValueError with that line; the commands print it as they print any
bad option. The bind the server does later still fails cleanly if another process takes
the port in between (a race no check can close).
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engines.config import EngineConfig

__all__ = ["check_engine", "check_port"]


def check_port(host: str, port: int, option: str) -> None:
    """Raise ValueError naming *option* when ``host:port`` cannot be listened on: a
    server holds it, or *host* is not an address of this machine (port 0 checks the
    host alone).

    Binds a socket with ``SO_REUSEADDR``, as the servers do, so a port left in TIME_WAIT
    by a server that just stopped counts as free, and closes it at once.
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({option}): {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "the port is in use (another server listens there; pick another, or 0)"
            else:
                reason = exc.strerror or str(exc)
            raise ValueError(f"cannot listen on {host}:{port} ({option}): {reason}") from exc


def check_engine(engine_config: EngineConfig) -> None:
    """Run the engine config's own fast checks (``preflight()``: the vLLM engine's model
    directory and server address; nothing for the others); ValueError for a failed one."""
    engine_config.preflight()
