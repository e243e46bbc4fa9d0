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

import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.connection import PlaneConfig
from headwater.plane.server import ServerConfig
from headwater.wire import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    ErrorCode,
    GenerateRequest,
    Role,
    SamplingParams,
)
from headwater.wire.addresses import parse_tcp_address
from headwater.wire.codec import FrameDecoder, encode
from headwater.wire.errors import ProtocolError
from headwater.wire.frames import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Fault,
    Frame,
    GetStats,
    GoAway,
    Hello,
    HelloOk,
    KvData,
    KvPull,
    KvRelease,
    Ping,
    Pong,
    Stats,
)
from headwater.wire.handshake import proof
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


# ---- a live worker under fuzz -------------------------------------------------------------

HANDSHAKE_TIMEOUT = 0.4  # s: a stalled handshake is dropped after this (the worker's)
HEARTBEAT_TIMEOUT = 1.5  # s: a silent peer is dropped after this (the worker's)
CASE_BOUND = 5.0  # s: every fuzzed connection must have ended by then
NONCE = b"f" * 32  # the fuzzer's own hello nonce: its hello bytes are always the same
MODEL = "deepseek-v4"


def fuzz_request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        rid, MODEL, list(range(3, 40)), SamplingParams(max_tokens=max_tokens, seed=1)
    )


#: What a client may send after the handshake (each valid, some refused by the engine:
#: max_tokens 0; some long-running: max_tokens 10**6, cancelled when the peer goes).
CLIENT_FRAMES: list[Frame] = [
    Ping(1), Pong(2), GetStats(3), Cancel("nobody"), Cancel("fz-1"), KvRelease("t-none"),
    KvPull("t-none"), fuzz_request("fz-1", 3), fuzz_request("fz-2", 0),
    fuzz_request("fz-3", 10**6),
]  # fmt: skip
#: What only a worker sends, and the handshake's frames again: refused after it.
WRONG_WAY: list[Frame] = [
    Hello(PROTOCOL_VERSION, "frontend", "fz", "", NONCE), Auth(b"a" * 32),
    Challenge(NONCE, b"p" * 32), HelloOk(PROTOCOL_VERSION, "agg", "x", MODEL), Ack("fz-1"),
    Chunk("fz-1", [1]), End("fz-1"), Error("fz-1", ErrorCode.INTERNAL, "x"),
    Fault("protocol_error", "x"), KvData("t-none", b"\0" * 64, True), Stats(1, {"a": 1}),
    GoAway("x"),
]  # fmt: skip
ACCEPTED_AFTER_HANDSHAKE = (GenerateRequest, Cancel, Ping, Pong, KvPull, KvRelease, GetStats)
FROM_A_WORKER = (HelloOk, Challenge, Fault, Ack, Chunk, End, Error, Pong, Stats, KvData, GoAway)


def hello_bytes(version: int) -> bytes:
    return encode(Hello(version, "frontend", "fuzzer", "", NONCE))


@dataclass(frozen=True)
class Script:
    """What one fuzzed connection sends, in order; each step waits as a client would.

    ``pre`` goes first; then, unless ``hello`` is None, a hello of that version; with
    a secret the fuzzer then waits for the challenge, sends ``mid`` and, unless
    ``auth`` is None, an auth (``good``: the right proof); once hello_ok came it sends
    ``post``, or only ``post[:cut]`` before closing abruptly when ``cut`` is set.
    ``trickle``: the hello and ``post`` go out a few bytes at a time.
    """

    pre: bytes = b""
    hello: int | None = PROTOCOL_VERSION
    mid: bytes = b""
    auth: str | None = "good"
    post: bytes = b""
    cut: int | None = None
    trickle: bool = False


#: Outcomes: ("violation", code): the worker counts a protocol error, sends a Fault
#: (it may be lost to a reset) and closes; ("timeout", ""): the handshake never
#: completes and the worker closes after HANDSHAKE_TIMEOUT; ("silent", ""): the
#: handshake completed, every frame was fine, and the worker drops the connection
#: HEARTBEAT_TIMEOUT after the last byte; ("gone", ""): the fuzzer closed first.
Outcome = tuple[str, str]


class _Violation(Exception):
    def __init__(self, codes: set[str]) -> None:
        self.codes = codes


class _Oracle:
    """The worker's reading of a byte stream, from the same sans-IO parts it uses: the
    frame decoder with the worker's limits, and the handshake's and dispatch's rules."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self.decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self.state = "hello"  # then "auth" (with a secret), then "done"
        #: Violations in frames decoded since the last point where the fuzzer waited:
        #: a read that ends in undecodable bytes loses them, so either code may come.
        self.since_wait: set[str] = set()

    def waited(self) -> None:
        self.since_wait = set()

    def feed(self, data: bytes, genuine_auth: bool = False) -> None:
        """Raises _Violation with the codes the worker may answer."""
        clean = self.decoder.buffered == 0
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as exc:
            raise _Violation({exc.code} | self.since_wait) from None
        for i, frame in enumerate(frames):
            code = self._judge(frame, genuine_auth and clean and i == 0)
            if code is not None:
                raise _Violation({code})

    def _judge(self, frame: Frame, genuine_auth: bool) -> str | None:
        if self.state == "hello":
            if not isinstance(frame, Hello):
                return "protocol_error"
            if frame.version != PROTOCOL_VERSION:
                return "unsupported_version"
            self.state = "auth" if self.secret is not None else "done"
        elif self.state == "auth":
            if not isinstance(frame, Auth):
                return "protocol_error"
            if not genuine_auth:
                return "unauthorized"
            self.state = "done"
        elif not isinstance(frame, ACCEPTED_AFTER_HANDSHAKE):
            return "protocol_error"
        if self.state == "done":
            self.decoder.max_frame = DEFAULT_MAX_FRAME
        return None


def predict(script: Script, secret: bytes | None) -> set[Outcome]:
    """The outcomes the worker may give *script* (one, unless a read can split it two
    ways or the fuzzer closes first)."""
    outcomes = _predict(script, secret)
    if script.cut is not None:  # it may close before it reads what the worker said
        outcomes.add(("gone", ""))
    return outcomes


def _predict(script: Script, secret: bytes | None) -> set[Outcome]:
    oracle = _Oracle(secret)
    try:
        oracle.feed(script.pre)
        if script.hello is None:  # nothing more is sent: did the junk make a hello?
            return {("silent", "")} if oracle.state == "done" else {("timeout", "")}
        oracle.feed(hello_bytes(script.hello))
        if secret is not None:
            if oracle.state != "auth":
                return {("timeout", "")}  # no challenge: the fuzzer waits for it in vain
            oracle.waited()
            oracle.feed(script.mid)
            if script.auth is None:
                return {("timeout", "")}
            oracle.feed(encode(Auth(b"\0" * 32)), genuine_auth=script.auth == "good")
        if oracle.state != "done":
            return {("timeout", "")}
        oracle.waited()
        if script.cut is not None:
            oracle.feed(script.post[: script.cut])  # read before our close, or lost to it
            return {("gone", "")}
        oracle.feed(script.post)
    except _Violation as v:
        return {("violation", c) for c in v.codes}
    return {("silent", "")}


@dataclass
class Seen:
    """What the fuzzer saw of the worker on one connection."""

    frames: list[Frame] = field(default_factory=list)
    handshaken: bool = False
    closed_by_us: bool = False
    reset: bool = False
    started: float = 0.0
    last_sent: float = 0.0
    ended: float = 0.0

    def outcome(self) -> Outcome:
        if self.closed_by_us:
            return ("gone", "")
        faults = [f for f in self.frames if isinstance(f, Fault)]
        if faults:
            return ("violation", faults[-1].code)
        if self.reset:
            return ("reset", "")
        welcomed = any(isinstance(f, HelloOk) for f in self.frames)
        return ("silent", "") if welcomed else ("timeout", "")


async def run_script(address: str, secret: bytes | None, script: Script) -> Seen:
    """Play *script* against the worker on a fresh connection; read until it closes."""
    seen = Seen()
    stream = await trio.open_tcp_stream(*parse_tcp_address(address))
    decoder = FrameDecoder()
    open_ = True

    async def read_more() -> bool:
        nonlocal open_
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            seen.reset = True
            data = b""
        if not data:
            open_ = False
            return False
        seen.frames.extend(decoder.feed(data))  # the worker must send only sound frames
        return True

    async def wait_for(kind: type[Frame]) -> Frame | None:
        while open_:
            for frame in seen.frames:
                if isinstance(frame, kind):
                    return frame
            await read_more()
        return None

    async def send(data: bytes, trickle: bool = False) -> None:
        step = 7 if trickle else len(data) or 1
        for i in range(0, len(data), step):
            await stream.send_all(data[i : i + step])
            seen.last_sent = trio.current_time()
            if trickle:
                await trio.sleep(0.01)

    seen.started = seen.last_sent = trio.current_time()
    try:
        await send(script.pre)
        if script.hello is not None:
            await send(hello_bytes(script.hello), script.trickle)
            if secret is not None:
                challenge = await wait_for(Challenge)
                if isinstance(challenge, Challenge):
                    await send(script.mid)
                    if script.auth is not None:
                        key = secret if script.auth == "good" else b"a guess"
                        await send(encode(Auth(proof(key, "client", NONCE, challenge.nonce))))
            if script.auth is not None or secret is None:
                seen.handshaken = await wait_for(HelloOk) is not None
            if seen.handshaken:
                if script.cut is not None:
                    await send(script.post[: script.cut], script.trickle)
                    seen.closed_by_us = True
                    await trio.aclose_forcefully(stream)
                    return seen
                await send(script.post, script.trickle)
    except trio.BrokenResourceError:
        pass  # the worker closed while we sent: see what it said
    while open_:
        await read_more()
    seen.ended = trio.current_time()
    await stream.aclose()
    return seen


# The pieces scripts are made of. Mutations work on the bytes of valid frames.
MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "extend", "insert", "delete", "length"]),
        st.integers(min_value=0, max_value=2**16),
        st.binary(min_size=1, max_size=8),
    ),
    max_size=2,
)


def mutate(data: bytes, mutations: list[tuple[str, int, bytes]]) -> bytes:
    buf = bytearray(data)
    for op, where, junk in mutations:
        at = where % (len(buf) + 1)
        if op == "flip" and buf:
            buf[at % len(buf)] ^= 1 << (where % 8)
        elif op == "truncate":
            del buf[at:]
        elif op == "extend":
            buf += junk
        elif op == "insert":
            buf[at:at] = junk
        elif op == "delete":
            del buf[at : at + len(junk)]
        elif op == "length" and len(buf) >= 4:
            buf[:4] = struct.pack(">I", int.from_bytes(junk[:4].ljust(4, b"\0")))
    return bytes(buf)


def oversize(limit: int) -> st.SearchStrategy[bytes]:
    return st.integers(min_value=limit + 1, max_value=2**32 - 1).map(
        lambda n: struct.pack(">I", n) + b"\x80" * 16
    )


FRAME_BYTES = st.builds(
    mutate, st.sampled_from(CLIENT_FRAMES + WRONG_WAY).map(encode), MUTATIONS
)
JUNK = st.one_of(
    st.binary(min_size=1, max_size=64),
    FRAME_BYTES,
    oversize(HANDSHAKE_MAX_FRAME),
    st.just(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
)
POST = st.lists(
    st.one_of(
        st.sampled_from(CLIENT_FRAMES).map(encode),  # valid, so the rest is read too
        FRAME_BYTES,
        st.binary(min_size=1, max_size=32),
        oversize(DEFAULT_MAX_FRAME),
    ),
    max_size=5,
).map(b"".join)
SCRIPTS = st.builds(
    Script,
    pre=st.just(b"") | JUNK | st.builds(mutate, st.just(hello_bytes(PROTOCOL_VERSION)), MUTATIONS),
    hello=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, None]),
    mid=st.just(b"") | JUNK,
    auth=st.sampled_from(["good", "good", "good", "bad", None]),
    post=POST,
    cut=st.none() | st.none() | st.integers(min_value=0, max_value=200),
    trickle=st.booleans(),
)


def task_count() -> int:
    """Tasks alive in this trio run, the worker's and the test's."""
    count, stack = 0, [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += 1
        stack.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return count


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Errors(logging.Handler):
    """Collects the ERROR records (a crashed connection task, an engine failure)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def wait_until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    with trio.fail_after(limit):
        while not condition():
            await trio.sleep(0.01)
    await trio.testing.wait_all_tasks_blocked(0.01)


#: Examples of the live fuzz (each a worker and up to 6 fuzzed connections, ~0.5-2 s);
#: HEADWATER_FUZZ_EXAMPLES=500 runs a longer campaign.
LIVE_EXAMPLES = int(os.environ.get("HEADWATER_FUZZ_EXAMPLES", "15"))


@settings(
    max_examples=LIVE_EXAMPLES, deadline=None,
    # Replaying a failure takes seconds per step: report it as found, unshrunk.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
@given(
    scripts=st.lists(SCRIPTS, min_size=1, max_size=6),
    secret=st.sampled_from([None, SECRET]),
    role=st.sampled_from([Role.AGG, Role.PREFILL]),
)
async def test_a_live_worker_under_fuzz(
    scripts: list[Script], secret: bytes | None, role: Role
) -> None:
    expected = [predict(s, secret) for s in scripts]
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    try:
        async with trio.open_nursery() as nursery:
            await _fuzz_one_worker(nursery, scripts, expected, secret, role)
            nursery.cancel_scope.cancel()
    finally:
        logging.getLogger().removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []


async def _fuzz_one_worker(
    nursery: trio.Nursery,
    scripts: list[Script],
    expected: list[set[Outcome]],
    secret: bytes | None,
    role: Role,
) -> None:
    engine_config = MockerConfig(speedup_ratio=FAST, kv_transfer_timeout=0.5)
    server_config = ServerConfig(
        handshake_timeout=HANDSHAKE_TIMEOUT, heartbeat_timeout=HEARTBEAT_TIMEOUT
    )
    config = WorkerConfig(
        role=role, engine_config=engine_config, secret=secret, server=server_config
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    instance = WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)
    honest = await connect_worker(
        instance, nursery, secret=secret,
        config=PlaneConfig(heartbeat_interval=0.1, heartbeat_timeout=2.0),
    )  # fmt: skip

    async def one_honest(i: int) -> list[Chunk]:
        req = GenerateRequest(
            f"honest-{i}", MODEL, list(range(5, 105)),
            SamplingParams(max_tokens=16, ignore_eos=True, seed=11),
        )  # fmt: skip
        async with honest.stream(req) as chunks:
            got = [c async for c in chunks]
        handle = got[-1].kv_handle
        if handle is not None:
            honest.release_kv(handle)  # a prefill worker would hold it for a decode leg
        return got

    reference = await one_honest(0)
    if role is Role.PREFILL:
        assert len(reference) == 1
        assert reference[0].kv_handle is not None
        assert reference[0].kv_handle.num_tokens == 100
    else:
        assert len([t for c in reference for t in c.token_ids]) == 16

    def quiet() -> bool:
        stats = worker.runtime.statistics()
        return (
            worker.server.statistics().connections == 1 and stats.inflight == 0
            and stats.engine.kv_blocks_used == 0 and stats.engine.kv_transfers_held == 0
        )  # fmt: skip

    await wait_until(quiet)
    before, tasks, fds = worker.server.statistics(), task_count(), open_fds()

    seen: list[Seen | None] = [None] * len(scripts)
    honest_runs = 0
    fuzz_done = trio.Event()

    async def honest_loop() -> None:
        nonlocal honest_runs
        while not fuzz_done.is_set() or honest_runs == 0:
            got = await one_honest(honest_runs + 1)
            honest_runs += 1
            # The same prompt and seed: the same tokens, however busy the worker is.
            assert [c.token_ids for c in got] == [c.token_ids for c in reference] or (
                [t for c in got for t in c.token_ids]
                == [t for c in reference for t in c.token_ids]
            )
            assert got[-1].finish_reason == reference[-1].finish_reason

    async def fuzz(i: int) -> None:
        with trio.fail_after(CASE_BOUND):
            seen[i] = await run_script(worker.address, secret, scripts[i])

    async with trio.open_nursery() as inner:
        inner.start_soon(honest_loop)
        async with trio.open_nursery() as fuzzers:
            for i in range(len(scripts)):
                fuzzers.start_soon(fuzz, i)
        fuzz_done.set()

    # Each connection ended as the oracle said, and in time.
    for script, outcomes, s in zip(scripts, expected, seen, strict=True):
        assert s is not None
        got = s.outcome()
        lost_fault = got == ("reset", "") and any(o[0] == "violation" for o in outcomes)
        assert got in outcomes or lost_fault, (script, outcomes, s)
        assert all(isinstance(f, FROM_A_WORKER) for f in s.frames), s.frames
        if got == ("timeout", ""):
            assert s.ended - s.started >= HANDSHAKE_TIMEOUT - 0.05  # from the connect
        elif got == ("silent", ""):
            assert s.ended - s.last_sent >= HEARTBEAT_TIMEOUT - 0.05

    # The honest connection never broke, and the worker is as it was.
    assert honest_runs >= 1
    assert honest.statistics().disconnects_total == 0
    assert honest.statistics().connects_total == 1
    await wait_until(quiet)
    after = worker.server.statistics()

    def bounds(kind: str, code: str | None = None) -> tuple[int, int]:
        def hit(o: Outcome) -> bool:
            return o[0] == kind and (code is None or o[1] == code)

        low = sum(all(hit(o) for o in outs) for outs in expected)
        high = sum(any(hit(o) for o in outs) for outs in expected)
        return low, high

    def within(value: int, bound: tuple[int, int]) -> bool:
        return bound[0] <= value <= bound[1]

    assert after.connections_total - before.connections_total == len(scripts)
    assert within(after.protocol_errors_total - before.protocol_errors_total, bounds("violation"))
    assert within(
        after.auth_failures_total - before.auth_failures_total,
        bounds("violation", "unauthorized"),
    )
    assert within(after.peer_timeouts_total - before.peer_timeouts_total, bounds("silent"))
    assert after.write_timeouts_total == before.write_timeouts_total
    assert task_count() == tasks
    assert open_fds() == fds
