"""The GC-pause series: every collection timed, in any thread, only while monitored."""

from __future__ import annotations

import gc
import threading

import pytest
import trio
from prometheus_client import CollectorRegistry

from headwater.instrumentation import LoopMetrics, LoopMonitor
from headwater.instrumentation.gc_pauses import timing_gc

P = "headwater_test_"


def pauses(registry: CollectorRegistry, generation: str) -> tuple[float, float]:
    """(count, sum) of the pause histogram's series for ``generation``."""
    labels = {"generation": generation}
    count = registry.get_sample_value(f"{P}gc_pause_seconds_count", labels)
    total = registry.get_sample_value(f"{P}gc_pause_seconds_sum", labels)
    assert count is not None
    assert total is not None
    return count, total


def make_cycles(n: int) -> None:
    """Leave ``n`` unreachable reference cycles for the collector to find."""
    for _ in range(n):
        a: list[object] = []
        b: list[object] = [a]
        a.append(b)


def test_each_collection_is_timed_by_its_generation_in_any_thread() -> None:
    metrics = LoopMetrics(None, P)
    with timing_gc(metrics):
        gc.collect(0)
        make_cycles(20_000)
        gc.collect(2)
        # A collection another thread triggers stops the loop too: it counts.
        worker = threading.Thread(target=gc.collect, args=(1,))
        worker.start()
        worker.join()
    reg = metrics.registry
    (young, young_s), (middle, middle_s), (full, full_s) = (pauses(reg, g) for g in ("0", "1", "2"))
    assert min(young, middle, full) >= 1
    assert full_s > 0
    longest = reg.get_sample_value(f"{P}gc_max_pause_seconds")
    assert longest is not None
    assert 0 < longest <= young_s + middle_s + full_s


def test_the_hook_is_gone_after_the_block_even_when_it_raises() -> None:
    metrics = LoopMetrics(None, P)
    before = list(gc.callbacks)
    try:
        with timing_gc(metrics):
            assert len(gc.callbacks) == len(before) + 1
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.callbacks == before
    gc.collect(2)
    assert pauses(metrics.registry, "2") == (0, 0)


@pytest.mark.slow
async def test_a_monitor_times_collections_while_it_runs_and_not_after() -> None:
    monitor = LoopMonitor(None, P, enabled=False)
    reg = monitor.metrics.registry
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        seen = pauses(reg, "2")[0]
        gc.collect(2)
        assert pauses(reg, "2")[0] == seen + 1
        nursery.cancel_scope.cancel()
    seen = pauses(reg, "2")[0]
    gc.collect(2)
    assert pauses(reg, "2")[0] == seen
