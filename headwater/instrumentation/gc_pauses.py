"""Timing Python's cyclic garbage collector: how long each collection held the process.

Why: a collection runs in whichever thread allocated past the threshold, holding the GIL
from start to end, so the event loop stands still for its whole length even when a
tokenizer thread triggered it. A long one shows as a stall at whatever line happened to
be running, the loop's or a thread's; this series says whether the GC was the cause
(docs/observability.md). :mod:`headwater.gc_tuning` sets how often collections run.

The hook is a :data:`gc.callbacks` entry: Python calls it at the start and the end of
every collection, in the collecting thread, with the GIL held throughout, and one
collection never overlaps another, so one start time is enough. Its cost is two calls
and a histogram observation per collection (a young collection every ~50,000 net
allocations: tens per second under load).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headwater.instrumentation.loop_metrics import LoopMetrics


@contextmanager
def timing_gc(metrics: LoopMetrics) -> Iterator[None]:
    """Observe every collection's length into ``metrics`` while the block runs.

    Collections in every thread of the process are timed (they all stop the loop).
    Leaving the block removes the hook, so a finished monitor leaves no callback behind.
    """
    started: float | None = None  # the running collection's start

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        elif started is not None:  # None: the hook arrived during this collection
            metrics.observe_gc_pause(info["generation"], time.perf_counter() - started)
            started = None

    gc.callbacks.append(on_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(on_collection)
