"""Stall-aware attribution: what counts as our own loop's stall, and what it excuses."""

from __future__ import annotations

import math

import pytest
import trio

from headwater.instrumentation.attribution import StallAttribution, StallLog
from headwater.plane.base import CannotConnect, WorkerInstance
from headwater.plane.memory import MemoryWorkerClient
from headwater.wire import GenerateRequest, Reply, Role, SamplingParams


def test_the_log_sums_the_stalled_time_inside_a_window() -> None:
    log = StallLog()
    log.add(end=2.0, delay=1.0)  # [1, 2]
    log.add(end=5.5, delay=0.5)  # [5, 5.5]
    assert log.stalled(0.0, 10.0) == 1.5
    assert log.stalled(1.5, 5.25) == 0.5 + 0.25  # the parts inside the window
    assert log.stalled(2.0, 5.0) == 0.0  # touching is not overlapping
    assert log.stalled(6.0, 7.0) == 0.0


def test_a_miss_is_excused_from_a_quarter_of_the_window_and_counted() -> None:
    log = StallLog()
    excuses: list[None] = []
    attribution = StallAttribution(log, on_excuse=lambda: excuses.append(None))
    log.add(end=3.0, delay=1.0)  # [2, 3]
    assert attribution.excuses(0.0, 4.0)  # 1 s of 4: a quarter
    assert not attribution.excuses(0.0, 4.1)
    assert not attribution.excuses(3.0, 3.0)  # an empty window excuses nothing
    assert (attribution.excused_total, len(excuses)) == (1, 1)
    off = StallAttribution(log, enabled=False)
    assert not off.excuses(0.0, 4.0)


class _Silent:
    """A worker runtime that takes requests and never ACKs them."""

    worker_id = "w"

    def __init__(self) -> None:
        self.kept: list[trio.abc.SendChannel[Reply]] = []
        self.cancelled: list[str] = []

    def submit(self, request: GenerateRequest, replies: trio.abc.SendChannel[Reply]) -> None:
        self.kept.append(replies)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def release_kv(self, transfer_id: str) -> None:
        pass


@pytest.mark.parametrize(("stall_s", "excused"), [(2.0, True), (0.5, False), (0.0, False)])
async def test_an_in_process_ack_missed_while_the_loop_stalled_is_excused(
    autojump_clock: object, stall_s: float, excused: bool
) -> None:
    log = StallLog()
    runtime = _Silent()
    client = MemoryWorkerClient(
        WorkerInstance("w", Role.AGG, "m", "memory://w"),
        runtime,
        ack_timeout=4.0,
        attribution=StallAttribution(log),
    )
    start = trio.current_time()
    if stall_s:
        log.add(start + 3.0, stall_s)
    request = GenerateRequest("r", "m", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(CannotConnect) as info:
        async with client.stream(request):
            pytest.fail("entered without an ACK")
    assert info.value.excused is excused
    assert runtime.cancelled == ["r"]
    assert math.isclose(trio.current_time() - start, 4.0)
