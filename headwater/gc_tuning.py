"""How often Python's cyclic GC runs in a headwater process (frontend or worker)."""

from __future__ import annotations

import gc

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
