"""The request plane: the frontend's side of the frontend ⇄ worker conversation.

:mod:`frontend.plane.base` defines the interface (``WorkerClient``, ``ResponseStream``
and the error tree); :mod:`frontend.plane.memory` is the in-process transport and
:mod:`frontend.plane.tcp` the TCP one (``connect_worker`` for discovery).
"""

from frontend.plane.base import (
    CannotConnect,
    Disconnected,
    PlaneError,
    ResponseStream,
    WorkerClient,
    WorkerError,
    WorkerInstance,
)
from frontend.plane.memory import MemoryWorkerClient
from frontend.plane.tcp import (
    AckTimeout,
    ConnectTimeout,
    HandshakeFailed,
    PlaneConfig,
    TcpWorkerClient,
    connect_worker,
)

__all__ = [
    "AckTimeout",
    "CannotConnect",
    "ConnectTimeout",
    "Disconnected",
    "HandshakeFailed",
    "MemoryWorkerClient",
    "PlaneConfig",
    "PlaneError",
    "ResponseStream",
    "TcpWorkerClient",
    "WorkerClient",
    "WorkerError",
    "WorkerInstance",
    "connect_worker",
]
