"""How often Python's cyclic GC runs in a headwater process (frontend or worker)."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from headwater.malloc_tuning import trim_heap

if TYPE_CHECKING:
    from headwater.instrumentation.activity import Activity

#: Net container allocations between two young-generation collections (Python: 700).
GEN0_THRESHOLD = 50_000


def tune_gc(gen0_threshold: int = GEN0_THRESHOLD) -> None:
    """Make the cyclic GC's young collections rarer (process-wide).

    Python collects the youngest generation every 700 net container allocations, and
    each collection walks every young container in full: the 40k-item token-id lists of
    the long requests in flight included. Under long-prompt load that ran many times per
    request, on the event loop, as a third of its delay (measured in
    docs/performance.md). Objects freed by reference counting, nearly all of them, are
    unaffected; only cyclic garbage waits longer. The older generations keep their
    ratios (one middle collection per 20 young ones, one full per 10 middle ones). What
    the collections cost, and when: ``*_gc_pause_seconds`` on ``/metrics``
    (:mod:`headwater.instrumentation.gc_pauses`).
    """
    gc.set_threshold(gen0_threshold, 20, 10)


class IdleCollector:
    """A full collection when the process goes idle, at most once per *min_interval_s*.

    With young collections 70x rarer (:func:`tune_gc`), cyclic garbage that outlived a
    young collection (an httpx response of an etcd keep-alive, caught in flight) waits
    in the old generation for a full collection, and Python runs one only after ten
    middle ones, or when the old generation grew by a quarter: under a steady trickle
    of requests that is a slow rise of RSS a soak reads as a leak (docs/reliability.md).
    Collected when nothing waits instead: ~15 ms for a worker's heap, ~45 ms for a
    single frontend's (a group's processes froze their start-up heap in the zygote: a
    few ms).

    :meth:`trim` then gives what malloc holds free back to the kernel
    (``malloc_trim(0)``, in a thread: see :func:`collect_when_idle`). An idle process's
    RSS is what it holds, not the high-water mark of its allocators' free lists: in a
    30-minute soak a frontend's idle RSS rose in steps of ~15 MiB, free memory inside
    its heap, and levelled off only after 10-17 minutes (docs/reliability.md).
    """

    __slots__ = ("_clock", "_last", "_last_trim", "collections", "min_interval_s", "trims")

    def __init__(
        self, *, min_interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last = self._last_trim = -math.inf
        self.collections = 0
        self.trims = 0

    def __call__(self) -> None:
        """Collect unless the last collection was too recent."""
        now = self._clock()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
        gc.collect()
        self.collections += 1

    def trim(self) -> None:
        """Give malloc's free pages back (blocking: :meth:`give_back` runs it in a thread)."""
        if trim_heap():
            self.trims += 1

    def trim_due(self) -> bool:
        """Whether the last trim is *min_interval_s* old. Counted apart from collections:
        a busy worker's collection must not spare its next idle point the trim, or the
        soak's two idle reads would compare a trimmed heap with an untrimmed one."""
        return self._clock() - self._last_trim >= self.min_interval_s

    async def give_back(self) -> None:
        """:meth:`trim` in a thread: a few ms to tens of ms, locking each arena in turn."""
        self._last_trim = self._clock()
        await trio.to_thread.run_sync(self.trim)


#: A worker under steady load collects at least this often (a full collection of its
#: heap takes ~15 ms, under the stall threshold); a frontend only when idle (~45 ms
#: alone, a stall if a request waited on it).
WORKER_BUSY_LIMIT_S = 120.0

#: One per process, shared by every loop's watcher in it (a frontend and its in-process
#: workers go idle together): one full collection per idle spell, at most once a minute.
IDLE_COLLECTOR = IdleCollector()


async def collect_when_idle(
    activity: Activity,
    *,
    poll_s: float = 1.0,
    busy_limit_s: float | None = None,
    collector: IdleCollector = IDLE_COLLECTOR,
) -> None:
    """Run *collector* each time *activity* goes idle after work (checked every
    *poll_s*: a counter read, nothing more), and with *busy_limit_s*, also after that
    long busy without an idle moment: a worker under steady load is never idle, and its
    garbage would wait for Python's own full collection (every ten million allocations
    with :func:`tune_gc`'s thresholds). Gone idle, it also trims the heap, in a thread
    (a few ms to tens of ms, locking each arena in turn: nothing is waiting). Cancellation:
    stops at the sleep, or once a trim under way is done."""
    seen = activity.started
    busy_since: float | None = None
    while True:
        await trio.sleep(poll_s)
        if activity.started == seen:
            continue
        now = trio.current_time()
        if activity.idle():
            seen, busy_since = activity.started, None
            collector()
            if collector.trim_due():
                await collector.give_back()
        elif busy_since is None:
            busy_since = now
        elif busy_limit_s is not None and now - busy_since >= busy_limit_s:
            seen, busy_since = activity.started, None
            collector()
