"""The request plane: the frontend's side of the frontend ⇄ worker conversation.

:mod:`frontend.plane.base` defines the client interface (``WorkerClient``);
:mod:`frontend.plane.memory` is the in-process transport and :mod:`frontend.plane.tcp`
the TCP one (``connect_worker`` for discovery). The types shared with the workers —
``WorkerInstance``, ``ResponseStream``, the error tree, ``PlaneConfig`` — come from
:mod:`headwater.plane` and are re-exported here as part of this package's API.
"""

from frontend.plane.base import WorkerClient
from frontend.plane.memory import MemoryWorkerClient
from frontend.plane.tcp import TcpWorkerClient, connect_worker
from headwater.plane import (
    AckTimeout,
    CannotConnect,
    ConnectTimeout,
    Disconnected,
    HandshakeFailed,
    PlaneConfig,
    PlaneError,
    ResponseStream,
    WorkerError,
    WorkerInstance,
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
