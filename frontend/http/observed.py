"""What the observability routes and the dashboard read of a running frontend.

A narrow record of the live parts, so that neither :mod:`frontend.http.observability`
nor :mod:`frontend.http.dashboard` depends on the object that assembles them
(:class:`frontend.server.Frontend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.http.recent_errors import RecentErrors
from frontend.metrics import FrontendMetrics
from frontend.preprocess.pool import TokenizerPool
from frontend.router import Router
from headwater.instrumentation import LoopMonitor


@dataclass(frozen=True, slots=True)
class Observed:
    """The frontend's parts that its read-only views read; none is written through here."""

    model_name: str
    metrics: FrontendMetrics
    monitor: LoopMonitor
    pool: TokenizerPool
    router: Router
    errors: RecentErrors = field(default_factory=RecentErrors)  # the last error answers
