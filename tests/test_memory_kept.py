"""What a long-running process must not keep (docs/reliability.md, the soak): source
files its stall records named, and cyclic garbage its rarer collections leave waiting."""

from __future__ import annotations

import gc
import linecache
from pathlib import Path

import pytest
import trio
import trio.testing

from headwater.gc_tuning import IdleCollector, collect_when_idle
from headwater.instrumentation.activity import Activity
from headwater.instrumentation.watchdog import _format_frame, _source_line


def _here() -> int:
    return 20  # this line's number is asserted below


def test_a_stalls_source_line_is_read_without_keeping_its_file() -> None:
    linecache.clearcache()
    _source_line.cache_clear()
    code = _here.__code__
    text = _format_frame(code, code.co_firstlineno + 1)
    assert text.endswith("return 20  # this line's number is asserted below")
    assert __file__ not in linecache.cache  # linecache would keep the whole file
    assert _source_line("<string>", 1) == ""
    assert _source_line(str(Path(__file__).with_name("absent.py")), 1) == ""


def test_the_idle_collector_collects_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    collected: list[float] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(now[0]))
    collector = IdleCollector(min_interval_s=60.0, clock=lambda: now[0])
    collector()
    now[0] += 30.0
    collector()  # too soon
    now[0] += 31.0
    collector()
    assert collected == [100.0, 161.0]
    assert collector.collections == 2


class Counting(IdleCollector):
    """Records when it would collect and trim (on trio's clock), and does neither."""

    def __init__(self) -> None:
        super().__init__(clock=trio.current_time)
        self.calls: list[float] = []
        self.trim_calls = 0

    def __call__(self) -> None:
        self.calls.append(trio.current_time())

    async def give_back(self) -> None:  # no thread: virtual time would leap meanwhile
        self._last_trim = trio.current_time()
        self.trim_calls += 1
        await trio.lowlevel.checkpoint()


async def test_a_process_collects_once_each_time_it_goes_idle_after_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = Activity(idle_after_s=1.0)
    activity.use_clock(trio.current_time)
    counting = Counting()
    calls = counting.calls

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: collect_when_idle(activity, collector=counting))
        await trio.sleep(10)
        assert calls == []  # idle from the start: no work, nothing to collect
        with activity:  # a request...
            await trio.sleep(5)  # ...that lasts 5 s: busy, no collection meanwhile
        assert calls == []
        await trio.sleep(3)
        assert len(calls) == 1  # idle for a second after it: collected once
        await trio.sleep(30)
        assert len(calls) == 1  # and not again while nothing happens
        with activity:
            pass
        await trio.sleep(3)
        assert len(calls) == 2
        assert counting.trim_calls == 1  # the free pages given back once a minute at most
        await trio.sleep(60)
        with activity:
            pass
        await trio.sleep(3)
        assert (len(calls), counting.trim_calls) == (3, 2)
        nursery.cancel_scope.cancel()


async def test_an_etcd_clients_responses_wait_for_a_collection() -> None:
    """Why the idle collection: each answer an httpx client (etcd's) gets is cyclic
    garbage, freed by a collection only (the soak's workers held ~4,000 of them between
    their two idle points)."""
    import httpx

    answer = httpx.MockTransport(lambda request: httpx.Response(200, json={"TTL": "10"}))
    async with httpx.AsyncClient(transport=answer) as http:
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                response = await http.post("http://etcd/v3/lease/keepalive", json={"ID": "1"})
                response.json()
                del response
            assert sum(isinstance(o, httpx.Response) for o in gc.get_objects()) >= 50
            gc.collect()
            assert sum(isinstance(o, httpx.Response) for o in gc.get_objects()) == 0
        finally:
            gc.enable()


async def test_a_worker_never_idle_collects_after_its_busy_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = Activity(idle_after_s=1.0)
    activity.use_clock(trio.current_time)
    counting = Counting()
    calls = counting.calls

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: collect_when_idle(activity, busy_limit_s=60.0, collector=counting)
        )
        with activity:  # steady load: one request after another, never idle
            for _ in range(150):
                with activity:
                    await trio.sleep(1)
        assert 2 <= len(calls) <= 3  # about every 60 s of the 150 s, none idle
        assert counting.trim_calls == 0  # busy: pages freed now are taken again soon
        await trio.sleep(3)  # idle at last: trimmed, though it collected a moment ago
        assert counting.trim_calls == 1
        nursery.cancel_scope.cancel()


def test_a_trim_gives_freed_pages_inside_the_heap_back() -> None:
    """What the idle collection's trim does: pages freed in the middle of the heap (not
    only at its top, which glibc trims by itself) go back to the kernel."""
    blocks = [bytearray(64 * 1024) for _ in range(400)]  # 25 MiB below mmap's threshold
    del blocks[:-1]  # all freed but the last, which holds the top of the heap
    collector = IdleCollector()
    collector.trim()
    assert collector.trims == 1
