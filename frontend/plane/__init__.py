"""The request plane: the frontend's side of the frontend ⇄ worker conversation.

:mod:`frontend.plane.base` defines the interface (``WorkerClient``, ``ResponseStream``
and the error tree); :mod:`frontend.plane.memory` is the in-process transport.
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

__all__ = [
    "CannotConnect",
    "Disconnected",
    "MemoryWorkerClient",
    "PlaneError",
    "ResponseStream",
    "WorkerClient",
    "WorkerError",
    "WorkerInstance",
]
