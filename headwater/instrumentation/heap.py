"""Where a process's Python memory goes, and what it gained since a mark.

A slow rise in a long-running process is either objects kept (a leak in the code) or
pages the allocator keeps after the objects are gone (fragmentation). ``tracemalloc``
tells the first apart: it counts every live Python allocation by the line that made
it. It costs a lot (every allocation records its traceback: ~2x slower), so it is
never on by default: start the process with Python's own switch,
``PYTHONTRACEMALLOC=N`` (N frames per traceback) or ``python -X tracemalloc=N``, and
``GET /debug/heap`` (the frontend's and a worker's metrics endpoint) answers; without
it the route says how to turn it on.

``GET /debug/heap?mark`` takes the baseline; a later ``GET /debug/heap`` lists the
allocation sites that grew most since then (or the largest, before a mark), with the
process's RSS and what ``malloc_trim(0)`` gives back when asked (``?trim``): memory
that tracemalloc's total does not explain and trimming returns is the allocator's, not
a leak of objects. The soak takes a mark at its first idle point and the report at
its last (``scripts/soak --heap``; docs/reliability.md).

A snapshot walks every traced block while holding the GIL (tens of milliseconds for a
worker, more for a frontend): this route stalls the loop it runs on, which is why it is
a debug route of a process started for the purpose.
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

from headwater.malloc_tuning import trim_heap

#: Sites listed per answer.
TOP = 25
_PAGE = os.sysconf("SC_PAGE_SIZE")
_baseline: tracemalloc.Snapshot | None = None


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


def _snapshot() -> tracemalloc.Snapshot:
    # This module's own frames (the snapshot's bookkeeping) are not the process's memory.
    return tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
    )


def heap_report(*, mark: bool = False, trim: bool = False, top: int = TOP) -> dict[str, Any]:
    """The answer of ``GET /debug/heap`` (see the module docstring)."""
    global _baseline
    if not tracemalloc.is_tracing():
        return {
            "tracing": False,
            "how": "start the process with PYTHONTRACEMALLOC=10 (or python -X tracemalloc=10)",
            "rss_bytes": _rss_bytes(),
        }
    report: dict[str, Any] = {"tracing": True, "rss_bytes": _rss_bytes()}
    if trim:
        report["trimmed"] = trim_heap()
        report["rss_bytes_after_trim"] = _rss_bytes()
    snapshot = _snapshot()
    report["traced_bytes"] = sum(s.size for s in snapshot.statistics("filename"))
    if mark:
        _baseline = snapshot
        report["marked"] = True
        return report
    if _baseline is None:
        stats = snapshot.statistics("traceback")[:top]
        report["largest"] = [
            {"size": s.size, "count": s.count, "where": _where(s.traceback)} for s in stats
        ]
        return report
    diffs = sorted(
        snapshot.compare_to(_baseline, "traceback"), key=lambda d: d.size_diff, reverse=True
    )[:top]
    report["since_mark_bytes"] = report["traced_bytes"] - sum(
        s.size for s in _baseline.statistics("filename")
    )
    report["grew"] = [
        {
            "size_diff": d.size_diff,
            "count_diff": d.count_diff,
            "size": d.size,
            "where": _where(d.traceback),
        }
        for d in diffs
    ]
    return report


def _where(traceback: tracemalloc.Traceback) -> list[str]:
    """Innermost frame first, as ``path:line``."""
    return [f"{frame.filename}:{frame.lineno}" for frame in reversed(traceback)]
