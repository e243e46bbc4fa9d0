"""The request plane's shared layer: worker identity, errors and the TCP connection.

:mod:`headwater.plane.base` holds the types both ends agree on (``WorkerInstance``,
``ResponseStream``, the ``PlaneError`` tree); :mod:`headwater.plane.connection` the
multiplexed, heartbeated connection used by the frontend's clients and by decode
workers pulling KV. The frame codec is :mod:`headwater.wire.framing`. See
docs/request-plane.md.
"""

from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    PlaneError,
    ResponseStream,
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
    "ResponseStream",
    "WorkerError",
    "WorkerInstance",
    "dial",
    "open_connection",
    "tcp_connector",
]
