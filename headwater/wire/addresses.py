"""The plane's ``tcp://host:port`` addresses, and which hosts count as loopback.

A worker advertises its address in this form (discovery, KV handles) and a client dials
it; IPv6 hosts are bracketed (``tcp://[::1]:7000``). :func:`is_loopback` decides
whether a worker may listen without a plane secret.
"""

from __future__ import annotations

import ipaddress


def parse_tcp_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (``[v6]:port`` too) → (host, port). Raises ValueError."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme != "tcp":
        raise ValueError(f"not a tcp:// address: {address!r}")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad tcp address {address!r}: expected tcp://host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_tcp_address(host: str, port: int) -> str:
    """(host, port) → ``tcp://host:port``, bracketing an IPv6 host."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def is_loopback(host: str) -> bool:
    """True only for loopback IPs and ``localhost``; wildcards and names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
