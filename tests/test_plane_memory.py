"""The in-process request plane's own mechanics: schedule points and backpressure.

Its end-to-end behaviour (ACK, errors, cancellation) is the TCP plane's twin and is
tested beside it in test_plane_tcp.py; here a scripted runtime fills the reply channel.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from frontend.plane.memory import BURST, REPLY_BUFFER, MemoryWorkerClient, _ReplyChannel
from headwater.plane.base import WorkerInstance
from headwater.wire import Ack, Chunk, End, GenerateRequest, Reply, Role, SamplingParams


class _ScriptedRuntime:
    """Answers a request with Ack, *n* chunks and End, all queued before the reader runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cancelled: list[str] = []

    def submit(self, request: GenerateRequest, replies: trio.abc.SendChannel[Reply]) -> None:
        send = replies._send  # type: ignore[attr-defined]
        rid = request.request_id
        send.send_nowait(Ack(rid))
        for i in range(self.n):
            send.send_nowait(Chunk(rid, [i]))
        send.send_nowait(End(rid))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def _client(n: int) -> MemoryWorkerClient:
    instance = WorkerInstance("w", Role.AGG, "m", "memory://w")
    return MemoryWorkerClient(instance, _ScriptedRuntime(n))  # type: ignore[arg-type]


def _request() -> GenerateRequest:
    return GenerateRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=8))


async def test_waiting_replies_are_taken_in_bursts_not_one_schedule_point_each() -> None:
    n = 48
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        async with _client(n).stream(_request()) as chunks:
            ticks = 0
            got = [c.token_ids[0] async for c in chunks]
            seen = ticks
        nursery.cancel_scope.cancel()
    assert got == list(range(n))
    # One schedule point per BURST replies: the loop is neither yielded to for every
    # reply (n ticks) nor held for the whole backlog (no tick).
    assert 1 <= seen <= n // BURST + 2


async def test_a_reply_send_waits_only_when_the_buffer_is_full() -> None:
    send, receive = trio.open_memory_channel[Reply](2)
    replies = _ReplyChannel(send)
    await replies.send(Ack("r"))
    await replies.send(End("r"))  # fits: returns at once
    with trio.move_on_after(0.01) as scope:
        await replies.send(End("r"))  # full: waits for the reader
    assert scope.cancelled_caught
    assert receive.receive_nowait() == Ack("r")
    await replies.send(End("r"))  # room again
    assert REPLY_BUFFER > BURST  # a burst never drains more than the buffer holds


async def test_a_reply_send_still_raises_when_cancelled() -> None:
    send, _receive = trio.open_memory_channel[Reply](4)
    replies = _ReplyChannel(send)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await replies.send(Ack("r"))
    assert _receive.statistics().current_buffer_used == 0
