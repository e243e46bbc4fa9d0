"""The route stage: which worker gets a request (``router``), and how a request's stream
survives a worker that cannot take it or breaks (``dispatch``)."""

from frontend.router.dispatch import DispatchConfig, Dispatcher
from frontend.router.router import Policy, Router, WorkerState, WorkerView

__all__ = ["DispatchConfig", "Dispatcher", "Policy", "Router", "WorkerState", "WorkerView"]
