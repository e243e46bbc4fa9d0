"""The route stage: policies and worker health."""

from frontend.router.router import NoWorkers, Policy, Router, WorkerState, WorkerView

__all__ = ["NoWorkers", "Policy", "Router", "WorkerState", "WorkerView"]
