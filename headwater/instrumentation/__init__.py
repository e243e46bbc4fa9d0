"""Watching the event loop: how late it runs, and which task and line stall it.

Shared by the frontend and the workers. Start a :class:`LoopMonitor` in the process's
top-level nursery; its metrics live in their own prometheus registry.
"""

from headwater.instrumentation.activity import Activity
from headwater.instrumentation.attribution import StallAttribution, StallLog
from headwater.instrumentation.canary import DelaySeries, run_canary
from headwater.instrumentation.loop_metrics import (
    DELAY_BUCKETS,
    FRONTEND_PREFIX,
    STALL_CAUSES,
    WORKER_PREFIX,
    LoopMetrics,
    StallCause,
)
from headwater.instrumentation.monitor import LoopMonitor
from headwater.instrumentation.record import StallRecord
from headwater.instrumentation.stalls import StallDetector, StallStatistics
from headwater.instrumentation.tracker import TaskTracker

__all__ = [
    "DELAY_BUCKETS",
    "FRONTEND_PREFIX",
    "STALL_CAUSES",
    "WORKER_PREFIX",
    "Activity",
    "DelaySeries",
    "LoopMetrics",
    "LoopMonitor",
    "StallAttribution",
    "StallCause",
    "StallDetector",
    "StallLog",
    "StallRecord",
    "StallStatistics",
    "TaskTracker",
    "run_canary",
]
