"""The route stage: which worker gets a request (``router``), whether a worker is fit to
take one (``health``), and how a request's stream survives a worker that cannot take it
or breaks (``dispatch``)."""

from frontend.router.dispatch import DispatchConfig, Dispatcher
from frontend.router.health import HealthConfig, WorkerState
from frontend.router.router import BusyThresholds, Policy, Router, WorkerView

__all__ = [
    "BusyThresholds",
    "DispatchConfig",
    "Dispatcher",
    "HealthConfig",
    "Policy",
    "Router",
    "WorkerState",
    "WorkerView",
]
