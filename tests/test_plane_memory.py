"""The in-process request plane's own mechanics: schedule points, backpressure, and
how a reply stream merges chunks that arrived together.

Its end-to-end behaviour (ACK, errors, cancellation) is the TCP plane's twin and is
tested beside it in test_plane_tcp.py; here a scripted runtime fills the reply channel.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from headwater.plane.base import WorkerError, WorkerInstance
from headwater.plane.memory import (
    BURST,
    REPLY_BUFFER,
    MemoryWorkerClient,
    _MemoryResponseStream,
    _ReplyChannel,
)
from headwater.wire import (
    Ack,
    Chunk,
    End,
    Error,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Reply,
    Role,
    SamplingParams,
)


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
            got = [t async for c in chunks for t in c.token_ids]
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


# -- merging chunks that wait -------------------------------------------------------------


async def test_chunks_are_merged_only_when_they_have_arrived_together() -> None:
    send, receive = trio.open_memory_channel[Reply](REPLY_BUFFER)
    stream = _MemoryResponseStream(receive)
    send.send_nowait(Chunk("r", [1], cached_tokens=64))
    assert await stream.__anext__() == Chunk("r", [1], cached_tokens=64)  # nothing else waited
    for reply in (Chunk("r", [2]), Chunk("r", [3, 4], cached_tokens=64)):
        send.send_nowait(reply)
    # A consumer that fell behind catches up in one step.
    assert await stream.__anext__() == Chunk("r", [2, 3, 4], cached_tokens=64)
    send.send_nowait(Chunk("r", [5], FinishReason.LENGTH))
    send.send_nowait(End("r"))
    assert await stream.__anext__() == Chunk("r", [5], FinishReason.LENGTH)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert stream.finished


async def test_a_merge_stops_at_a_finish_a_kv_handle_and_an_error() -> None:
    handle = KvHandle("p", "memory://p", "t", 3)
    send, receive = trio.open_memory_channel[Reply](REPLY_BUFFER)
    for reply in (
        Chunk("r", [1]),
        Chunk("r", [2]),
        Chunk("r", [], kv_handle=handle),
        Chunk("r", [3]),
        Chunk("r", [4], FinishReason.STOP),
        Chunk("r", [5]),
        Error("r", ErrorCode.INTERNAL, "boom"),
    ):
        send.send_nowait(reply)
    stream = _MemoryResponseStream(receive)
    assert await stream.__anext__() == Chunk("r", [1, 2])
    assert await stream.__anext__() == Chunk("r", [], kv_handle=handle)
    assert await stream.__anext__() == Chunk("r", [3, 4], FinishReason.STOP)
    assert await stream.__anext__() == Chunk("r", [5])  # the Error waits its turn
    with pytest.raises(WorkerError, match="boom"):
        await stream.__anext__()
    assert stream.finished


async def test_a_merge_takes_no_more_than_a_burst() -> None:
    n = 3 * BURST
    async with _client(n).stream(_request()) as chunks:
        sizes = [len(c.token_ids) async for c in chunks]
    assert sum(sizes) == n
    assert max(sizes) <= BURST
