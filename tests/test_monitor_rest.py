"""The loop monitor rests while nothing is in flight, and wakes with the first request.

Policy: the counting and waking logic runs on trio's MockClock; the canary and the
watchdog run on the real clock (the canary measures with ``perf_counter`` and the
watchdog is a real thread), with tick counts whose bounds are several times apart:
100 Hz against 10 Hz or less, checked over half a second.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing

from frontend.http.middleware import MarkActivity
from headwater.instrumentation import FRONTEND_PREFIX, Activity, LoopMonitor, StallRecord
from headwater.wire import Ack, End, GenerateRequest, Reply, Role, SamplingParams
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.runtime import open_runtime

from frontend_fixture import serve_frontend

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

WATCHDOG_THREAD = "headwater-stall-watchdog"


def canary_ticks(monitor: LoopMonitor) -> float:
    count = monitor.metrics.registry.get_sample_value(
        f"{FRONTEND_PREFIX}event_loop_delay_seconds_count"
    )
    assert count is not None
    return count


@asynccontextmanager
async def watching(activity: Activity, **kwargs: Any) -> AsyncIterator[LoopMonitor]:
    monitor = LoopMonitor(None, FRONTEND_PREFIX, activity=activity, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        yield monitor
        nursery.cancel_scope.cancel()


# -- Activity ---------------------------------------------------------------------------


def test_activity_is_idle_only_with_nothing_in_flight_for_a_while() -> None:
    patient = Activity(idle_after_s=60)
    assert not patient.idle()  # a process that just started counts as just busy
    eager = Activity(idle_after_s=0)
    assert eager.idle()
    with eager:
        with eager:  # requests overlap: a count, not a flag
            assert eager.inflight == 2
        assert not eager.idle()
    assert eager.inflight == 0
    assert eager.idle()
    with patient:
        pass
    assert not patient.idle()  # work just ended


def resting(activity: Activity) -> bool:
    """``activity.resting``, read anew: mypy would keep an earlier check's answer across
    the awaits that change it."""
    return activity.resting


def test_activity_rejects_a_rest_of_no_length() -> None:
    with pytest.raises(ValueError):
        Activity(rest_interval_s=0)
    with pytest.raises(ValueError):
        Activity(idle_after_s=-1)


async def test_a_rest_lasts_its_interval_unless_work_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = Activity(idle_after_s=0, rest_interval_s=5)
    start = trio.current_time()
    assert await activity.rest() is False
    assert trio.current_time() - start == pytest.approx(5)
    assert not activity.resting

    outcome: list[bool] = []

    async def rest() -> None:
        outcome.append(await activity.rest())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rest)
        await trio.sleep(1)
        assert resting(activity)
        assert not activity.woken.is_set()
        with activity:
            assert not activity.resting
            assert activity.woken.is_set()  # the watchdog thread's wake-up call
    assert outcome == [True]
    assert trio.current_time() - start == pytest.approx(6)  # not the rest's full 5 s


# -- the canary and the watchdog --------------------------------------------------------


@pytest.mark.parametrize("instrumented", [False, True], ids=["canary", "canary+watchdog"])
@pytest.mark.slow
async def test_the_canary_rests_while_idle_and_ticks_again_with_work(instrumented: bool) -> None:
    activity = Activity(idle_after_s=0, rest_interval_s=0.1)
    async with watching(activity, enabled=instrumented) as monitor:
        before = canary_ticks(monitor)
        await trio.sleep(0.5)
        resting = canary_ticks(monitor) - before
        with activity:
            before = canary_ticks(monitor)
            await trio.sleep(0.5)
            working = canary_ticks(monitor) - before
    assert resting <= 7  # 10 Hz: ~5 ticks in 0.5 s
    assert working >= 20  # 100 Hz: ~50, fewer on a loaded machine
    assert working >= 3 * resting


async def test_the_first_request_ends_a_rest_at_once() -> None:
    activity = Activity(idle_after_s=0, rest_interval_s=30)
    async with watching(activity, enabled=False) as monitor:
        with trio.fail_after(5):
            while not activity.resting:
                await trio.sleep(0.01)
        before = canary_ticks(monitor)
        with activity:
            await trio.sleep(0.3)
            assert not resting(activity)
            assert canary_ticks(monitor) - before >= 5  # ticking again, 30 s rest or not


def block_the_loop() -> None:
    time.sleep(0.2)  # deliberately blocking: the stall under test


async def test_a_stall_in_the_first_request_after_a_rest_is_sampled() -> None:
    """The request wakes the watchdog, which would otherwise nap through the stall."""
    send, receive = trio.open_memory_channel[StallRecord](math.inf)
    token = trio.lowlevel.current_trio_token()
    activity = Activity(idle_after_s=0, rest_interval_s=30)

    def on_stall(record: StallRecord) -> None:  # watchdog thread
        token.run_sync_soon(send.send_nowait, record)

    async with watching(activity, on_stall=on_stall):
        with trio.fail_after(5):
            while not activity.resting:
                await trio.sleep(0.01)
        await trio.sleep(0.05)  # the watchdog is in its 30 s nap by now
        with activity:
            block_the_loop()
        with trio.fail_after(5):
            async for record in receive:
                if record.duration_s >= 0.15:
                    break
    assert record.sampled
    assert any("block_the_loop" in line for line in record.stack)


async def test_a_resting_watchdog_stops_with_the_monitor() -> None:
    activity = Activity(idle_after_s=0, rest_interval_s=30)
    async with watching(activity):
        with trio.fail_after(5):
            while not activity.resting:
                await trio.sleep(0.01)
        await trio.sleep(0.05)
    # The monitor gives its watchdog 1 s to join: a 30 s nap would outlast it.
    assert not any(t.name == WATCHDOG_THREAD and t.is_alive() for t in threading.enumerate())


# -- what counts as work ----------------------------------------------------------------


async def test_each_http_call_counts_as_work_but_lifespan_does_not() -> None:
    activity = Activity()
    seen: list[tuple[str, int]] = []

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        seen.append((scope["type"], activity.inflight))

    wrapped = MarkActivity(app, activity)
    # Scopes of a type alone, and no channels: the wrapper reads the type, nothing more.
    await wrapped({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    await wrapped({"type": "http"}, None, None)  # type: ignore[arg-type]
    assert seen == [("lifespan", 0), ("http", 1)]
    assert activity.inflight == 0


@pytest.mark.slow
async def test_the_frontend_counts_a_stream_until_it_ends_then_rests() -> None:
    async with serve_frontend() as (frontend, url):
        body = {"model": "deepseek-v4", "prompt": "hello", "max_tokens": 4, "stream": True}
        async with (
            httpx.AsyncClient(base_url=url) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            assert frontend.activity.inflight == 1
            assert not frontend.activity.resting
            _ = [line async for line in response.aiter_lines()]
        # The client can read the last chunk before the server's app call returns, so
        # wait for the count to drop rather than read it once; a leaked count never does.
        with trio.fail_after(5):
            while frontend.activity.inflight:
                await trio.sleep(0.01)
            # Idle for idle_after_s (1 s): the monitor rests.
            while not frontend.activity.resting:
                await trio.sleep(0.05)


async def test_a_worker_counts_each_request_it_serves() -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=100_000.0), Role.AGG, "w1")
    request = GenerateRequest(
        "r1", "m", list(range(3, 103)), SamplingParams(max_tokens=8, ignore_eos=True, seed=7)
    )
    send, receive = trio.open_memory_channel[Reply](math.inf)
    async with open_runtime(engine, "w1") as runtime:
        runtime.submit(request, send)
        assert isinstance(await receive.receive(), Ack)
        assert runtime.activity.inflight == 1
        async for reply in receive:
            last = reply
    assert isinstance(last, End)
    assert runtime.activity.inflight == 0
