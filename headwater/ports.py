"""Loopback ports for the processes headwater starts to listen on.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral
range (``net.ipv4.ip_local_port_range``, 32768-60999 by default): the same range every
outgoing connection's local port is drawn from. A child that binds its port late finds
it taken by somebody's client connection now and then. vLLM binds its NIXL side channel
about a minute after it starts, and CI saw it fail with "Address already in use" (the
server then hung without it). So :func:`free_port` picks from below that range, where
only listeners live, and checks the port free at the moment it picks it.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"

#: The lowest port handed out: above the registered services most machines run.
LOWEST_PORT = 20000

#: Ports this process handed out already: two children started together never get the
#: same one (a port handed out is not bound until the child binds it).
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range; Linux's default where it cannot be read."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(part) for part in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether *port* could be listened on now. ``SO_REUSEADDR`` as listeners set it,
    so connections of a dead process in TIME_WAIT do not count; another process
    listening there does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on *host* that was free a moment ago, outside the ephemeral range (the
    caller's child must bind it; another listener may still take it first)."""
    low, _ = ephemeral_range()
    if low - LOWEST_PORT >= 1000:
        for _ in range(200):
            port = random.randrange(LOWEST_PORT, low)
            if port not in _handed_out and port_free(port, host):
                _handed_out.add(port)
                return port
    # A machine whose ephemeral range starts low: the kernel's choice.
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port
