"""The request plane, in one place: its interface, its two transports, the KV pull.

* :mod:`headwater.plane.base` — the interface: ``WorkerInstance``, ``WorkerClient``,
  ``ResponseStream``, the ``PlaneError`` tree, and ``RequestHandler`` (what a
  transport delivers a worker's requests to);
* :mod:`headwater.plane.memory` — the in-process transport (``MemoryWorkerClient``),
  the TCP transport's twin in tests and in ``headwater serve``'s default cluster;
* the TCP transport: :mod:`headwater.plane.connection` (one multiplexed, heartbeated
  connection), :mod:`headwater.plane.client` (``TcpWorkerClient``: reconnects and
  backoff), :mod:`headwater.plane.server` (``PlaneServer``, the worker's side);
* :mod:`headwater.plane.kv` — both halves of a worker-to-worker KV pull;
* :mod:`headwater.plane.tls` — mutual TLS under the TCP transport (``TlsConfig``).

The frame codec is :mod:`headwater.wire`. See docs/request-plane.md.
"""

from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    PlaneError,
    RequestHandler,
    ResponseStream,
    WorkerClient,
    WorkerError,
    WorkerInstance,
)
from headwater.plane.connection import (
    AckTimeout,
    Connector,
    ConnectTimeout,
    HandshakeFailed,
    PlaneConfig,
    PlaneConnection,
    dial,
    open_connection,
    tcp_connector,
)
from headwater.plane.tls import TlsConfig

__all__ = [
    "AckTimeout",
    "CannotConnect",
    "ConnectTimeout",
    "Connector",
    "Disconnected",
    "HandshakeFailed",
    "PlaneConfig",
    "PlaneConnection",
    "PlaneError",
    "RequestHandler",
    "ResponseStream",
    "TlsConfig",
    "WorkerClient",
    "WorkerError",
    "WorkerInstance",
    "dial",
    "open_connection",
    "tcp_connector",
]
