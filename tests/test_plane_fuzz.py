"""Fuzzing a live worker's request plane, and a decode worker's KV pulls.

Test policy: real sockets on 127.0.0.1 port 0, workers served in-process
(``serve_worker``, the mocker) with short handshake and heartbeat timeouts so that a
stalled peer is dropped within a second; no sleeps to synchronise, only bounded
waits (``trio.fail_after``) on what the worker does. Each hypothesis example starts
its own worker (and trio run), keeps one honest connection streaming requests for
the whole example, throws a batch of fuzzed connections at it, and then checks the
worker: the honest streams' tokens, its counters against what the fuzz cases must
have caused (an oracle built from the same sans-IO codec and handshake), and that no
connection, task, file descriptor or KV block is left over. Example counts are set
per test; under CI hypothesis derandomizes by itself (its ``ci`` profile).
"""

from __future__ import annotations

import struct
from functools import partial

import trio

from headwater.wire.addresses import parse_tcp_address
from headwater.wire.codec import FrameDecoder
from headwater.wire.frames import Fault, Frame
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

SECRET = b"correct horse battery staple"
FAST = 100_000.0


async def start_worker(nursery: trio.Nursery, **kw: object) -> RunningWorker:
    config = WorkerConfig(engine_config=MockerConfig(speedup_ratio=FAST), **kw)  # type: ignore[arg-type]
    return await nursery.start(partial(serve_worker, config))


async def read_until_closed(stream: trio.abc.Stream, limit: float) -> list[Frame]:
    """Every frame until the worker closes (EOF or reset) within *limit* seconds."""
    decoder, frames = FrameDecoder(), []
    with trio.fail_after(limit):
        try:
            while data := await stream.receive_some(65536):
                frames.extend(decoder.feed(data))
        except trio.BrokenResourceError:
            pass
    await stream.aclose()
    return frames


async def test_an_oversize_frame_before_the_handshake_is_refused_from_its_header(
    nursery: trio.Nursery,
) -> None:
    """Found by the live fuzz: before the handshake a worker accepted frames up to
    ``max_frame`` (64 MiB), so a peer that knows no secret could make it buffer 64 MiB
    per connection for the handshake timeout, and unpack them. Handshake frames are a
    few hundred bytes; the limit before the handshake is HANDSHAKE_MAX_FRAME."""
    worker = await start_worker(nursery, secret=SECRET)
    raw = await trio.open_tcp_stream(*parse_tcp_address(worker.address))
    await raw.send_all(struct.pack(">I", 1 << 20) + b"\x80" * 1000)  # 1 MiB announced
    frames = await read_until_closed(raw, 1.0)  # the handshake timeout is 5 s
    assert len(frames) == 1
    assert isinstance(frames[0], Fault)
    assert frames[0].code == "frame_too_large"
    assert worker.server.statistics().protocol_errors_total == 1
