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
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from headwater.plane.base import WorkerError, WorkerInstance
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
    KvHandle,
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
from headwater.wire.handshake import ServerHandshake, proof
from headwater.wire.session import TAG_BYTES, FrameMac, Session, derive_session
from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

# Long-running (live workers fed hundreds of generated frames):
# the full suite's, not `make test-fast`'s.
pytestmark = pytest.mark.slow

SECRET = b"correct horse battery staple"
FAST = 100_000.0


async def start_worker(nursery: trio.Nursery, **kw: object) -> RunningWorker:
    config = WorkerConfig(engine_config=MockerConfig(speedup_ratio=FAST), **kw)  # type: ignore[arg-type]
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


def seal(data: bytes, mac: FrameMac | None) -> bytes:
    """*data* as a session's sender would put it: each complete frame it holds gets its
    tag (its length grows by it), and what is left (a partial or oversize frame) goes as
    it is. So the worker, checking tags, reads what it would read of *data* without a
    session: what the oracle predicts."""
    if mac is None:
        return data
    out, pos = bytearray(), 0
    while len(data) - pos >= 4:
        (size,) = struct.unpack_from(">I", data, pos)
        if size > DEFAULT_MAX_FRAME - TAG_BYTES or len(data) - pos - 4 < size:
            break
        body = data[pos + 4 : pos + 4 + size]
        out += struct.pack(">I", size + TAG_BYTES) + body + mac.sign(body)
        pos += 4 + size
    return bytes(out + data[pos:])


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
EXAMPLE_BOUND = 30.0  # s: a whole example (a hang fails it, with its traceback)
NONCE = b"f" * 32  # the fuzzer's own hello nonce: its hello bytes are always the same
MODEL = "deepseek-v4"


def fuzz_request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        rid, MODEL, list(range(3, 40)), SamplingParams(max_tokens=max_tokens, seed=1)
    )


#: What a client may send after the handshake (each valid, some refused by the engine:
#: max_tokens 0; some long-running: max_tokens 10**6, cancelled when the peer goes).
CLIENT_FRAMES: list[Frame] = [
    Ping(1),
    Pong(2),
    GetStats(3),
    Cancel("nobody"),
    Cancel("fz-1"),
    KvRelease("t-none"),
    KvPull("t-none"),
    fuzz_request("fz-1", 3),
    fuzz_request("fz-2", 0),
    fuzz_request("fz-3", 10**6),
]
#: What only a worker sends, and the handshake's frames again: refused after it.
WRONG_WAY: list[Frame] = [
    Hello(PROTOCOL_VERSION, "frontend", "fz", "", NONCE),
    Auth(b"a" * 32),
    Challenge(NONCE, b"p" * 32),
    HelloOk(PROTOCOL_VERSION, "agg", "x", MODEL),
    Ack("fz-1"),
    Chunk("fz-1", [1]),
    End("fz-1"),
    Error("fz-1", ErrorCode.INTERNAL, "x"),
    Fault("protocol_error", "x"),
    KvData("t-none", b"\0" * 64, True),
    Stats(1, {"a": 1}),
    GoAway("x"),
]
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

    def __init__(self, secret: bytes | None, *, split: bool = False) -> None:
        self.secret = secret
        #: How the worker's reads cut the bytes: ``False``, one read per step of the
        #: fuzzer (the frames of a read that ends in undecodable bytes are lost, and the
        #: frame limit is the one in force when the read began); ``True``, a byte per read
        #: (every frame judged as it completes, the limit raised at once). A real read
        #: falls between the two; the outcomes of both are allowed.
        self.split = split
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
        first = True
        pieces = [data[i : i + 1] for i in range(len(data))] if self.split else [data]
        for piece in pieces:
            try:
                frames = self.decoder.feed(piece)
            except ProtocolError as exc:
                raise _Violation({exc.code} | self.since_wait) from None
            for frame in frames:
                code = self._judge(frame, genuine_auth and clean and first)
                first = False
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
    # The junk and the hello are sent back to back: the worker may read them in one
    # read, where a bad header after a complete bad frame fails the read before that
    # frame is judged, or in two, where the frame is judged first.
    outcomes = {
        outcome
        for split in (False, True)
        for merge_pre in (False, True)
        for outcome in _predict(script, secret, split=split, merge_pre=merge_pre)
    }
    if script.cut is not None:  # it may close before it reads what the worker said
        outcomes.add(("gone", ""))
    return outcomes


def _predict(
    script: Script, secret: bytes | None, *, split: bool, merge_pre: bool = False
) -> set[Outcome]:
    oracle = _Oracle(secret, split=split)
    try:
        if merge_pre and script.hello is not None:
            oracle.feed(script.pre + hello_bytes(script.hello))
        else:
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
    #: When the fuzzer had sent the last of its handshake (the hello, then the auth).
    handshake_sent: float | None = None

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
    server_nonce = b""
    session: Session | None = None

    async def read_more() -> bool:
        nonlocal open_, session
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            seen.reset = True
            data = b""
        if not data:
            open_ = False
            return False
        # The worker must send only sound frames (tagged after its hello_ok, with a secret).
        while frames := decoder.feed(data, limit=1):
            data = b""
            seen.frames += frames
            if isinstance(frames[0], HelloOk) and secret is not None:
                hello_ok = frames[0]
                session = derive_session(
                    secret,
                    "client",
                    NONCE,
                    server_nonce,
                    ("frontend", "fuzzer", ""),
                    (hello_ok.role, hello_ok.worker_id, hello_ok.model),
                )
                decoder.mac = session.receive
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
            seen.handshake_sent = trio.current_time()
            if secret is not None:
                challenge = await wait_for(Challenge)
                if isinstance(challenge, Challenge):
                    server_nonce = challenge.nonce
                    await send(script.mid)
                    if script.auth is not None:
                        key = secret if script.auth == "good" else b"a guess"
                        await send(encode(Auth(proof(key, "client", NONCE, challenge.nonce))))
                        seen.handshake_sent = trio.current_time()
            if script.auth is not None or secret is None:
                seen.handshaken = await wait_for(HelloOk) is not None
            if seen.handshaken:
                post = seal(script.post, session.send if session is not None else None)
                if script.cut is not None:
                    await send(post[: script.cut], script.trickle)
                    seen.closed_by_us = True
                    await trio.aclose_forcefully(stream)
                    return seen
                await send(post, script.trickle)
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


FRAME_BYTES = st.builds(mutate, st.sampled_from(CLIENT_FRAMES + WRONG_WAY).map(encode), MUTATIONS)
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


def _subtree(task: trio.lowlevel.Task) -> list[trio.lowlevel.Task]:
    tasks, stack = [], [task]
    while stack:
        task = stack.pop()
        tasks.append(task)
        stack.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return tasks


def task_count() -> int:
    """Tasks alive in the worker's task tree (``serve_worker`` and all it runs)."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    (worker,) = [t for t in _subtree(root) if t.name.endswith("serve_worker")]
    return len(_subtree(worker))


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
    max_examples=LIVE_EXAMPLES,
    deadline=None,
    # Replaying a failure takes seconds per step: report it as found, unshrunk.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
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
        with trio.fail_after(EXAMPLE_BOUND):
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
        instance,
        nursery,
        secret=secret,
        config=PlaneConfig(heartbeat_interval=0.1, heartbeat_timeout=2.0),
    )

    async def one_honest(i: int) -> list[Chunk]:
        req = GenerateRequest(
            f"honest-{i}",
            MODEL,
            list(range(5, 105)),
            SamplingParams(max_tokens=16, ignore_eos=True, seed=11),
        )
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
            worker.server.statistics().connections == 1
            and stats.inflight == 0
            and stats.engine.kv_blocks_used == 0
            and stats.engine.kv_transfers_held == 0
        )

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
                [t for c in got for t in c.token_ids] == [t for c in reference for t in c.token_ids]
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
        # A trickled handshake that a starved scheduler stretched past the worker's
        # handshake timeout is rightly timed out, whatever came after it.
        slow_handshake = (
            got == ("timeout", "")
            and s.handshake_sent is not None
            and s.handshake_sent - s.started >= HANDSHAKE_TIMEOUT - 0.05
        )
        assert got in outcomes or lost_fault or slow_handshake, (script, outcomes, s)
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


# ---- a decode worker pulling KV from a fuzzed prefill worker --------------------------------

PULL_TIMEOUTS = PlaneConfig(connect_timeout=0.5, heartbeat_interval=0.2, heartbeat_timeout=0.5)
PROMPT = 200  # tokens of each decode leg's prompt (the handle covers all of them)

#: What the fake prefill worker answers a kv_pull with, move by move.
Move = tuple[str, int]
MOVES: st.SearchStrategy[Move] = st.one_of(
    st.tuples(st.just("data"), st.integers(min_value=0, max_value=1 << 20)),
    st.tuples(st.just("data_other_id"), st.integers(min_value=0, max_value=4096)),
    st.tuples(st.just("stall"), st.integers(min_value=1, max_value=25)),  # hundredths of a s
    st.tuples(st.sampled_from(["bad_type", "garbage", "oversize", "partial"]), st.just(0)),
)
ENDS: st.SearchStrategy[Move] = st.one_of(
    st.tuples(st.sampled_from(["last", "last_other_id"]), st.integers(0, 1 << 21)),
    st.tuples(st.sampled_from(["error", "fault", "close", "chunk", "ack"]), st.just(0)),
)
#: How the fake greets a decode worker that dials it for a pull.
GREETINGS = st.sampled_from(
    ["ok", "ok", "ok", "ok", "silent", "garbage", "fault", "wrong_worker", "wrong_proof"]
)


def pull_outcome(moves: list[Move]) -> bool:
    """Whether a pull answered with *moves* succeeds: the first move that decides it.
    A transfer that never got its last piece fails: the fake closes after its moves."""
    for move, _ in moves:
        if move == "last":
            return True
        if move not in ("data", "data_other_id", "stall", "last_other_id"):
            return False
    return False


def _bad_kv_data(transfer_id: str) -> bytes:
    return _framed({"k": "kv_data", "transfer_id": transfer_id, "data": "not bytes", "last": 1})


def _framed(body: object) -> bytes:
    raw: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw


class FakePrefill:
    """A test server speaking the plane's handshake, answering each ``kv_pull`` with the
    moves the test gave for its transfer id, and each ping with a pong."""

    def __init__(self, secret: bytes | None, greeting: str = "ok") -> None:
        self.secret = secret
        self.greeting = greeting
        self.identity = HelloOk(PROTOCOL_VERSION, "prefill", "fake-prefill", MODEL)
        self.answers: dict[str, list[Move]] = {}
        self.connections = 0
        self.address = ""

    async def serve(self, *, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.address = f"tcp://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        await trio.serve_listeners(self._handle, listeners, task_status=task_status)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream, trio.open_nursery() as nursery:
            decoder = FrameDecoder()
            handshake = ServerHandshake(self.identity, secret=self.secret)
            send_lock = trio.Lock()
            keys: list[Session] = []  # the session, once the handshake's frames are out

            async def send(data: bytes) -> None:
                async with send_lock:  # signed in the order sent
                    await stream.send_all(seal(data, keys[0].send if keys else None))

            with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while data := await stream.receive_some(65536):
                    while frames := decoder.feed(data, limit=1):
                        data, frame = b"", frames[0]
                        if handshake.peer is None:
                            if not await self._greet(send, handshake, frame):
                                return
                            if handshake.session is not None:
                                keys.append(handshake.session)
                                decoder.mac = handshake.session.receive
                        elif isinstance(frame, Ping):
                            await send(encode(Pong(frame.seq)))
                        elif isinstance(frame, KvPull):
                            moves = self.answers.pop(frame.transfer_id, [("error", 0)])
                            nursery.start_soon(self._answer, send, stream, frame.transfer_id, moves)
            nursery.cancel_scope.cancel()

    async def _greet(
        self, send: Callable[[bytes], Awaitable[None]], handshake: ServerHandshake, frame: Frame
    ) -> bool:
        if self.greeting == "silent":
            await trio.sleep_forever()
        if self.greeting == "garbage":
            await send(b"\x00\x00\x00\x03\xc1\xc1\xc1")
            return False
        if self.greeting == "fault":
            await send(encode(Fault("shutting_down", "go away")))
            return False
        reply = handshake.receive(frame)
        if self.greeting == "wrong_worker" and isinstance(reply, HelloOk):
            reply = HelloOk(PROTOCOL_VERSION, "prefill", "someone-else", MODEL)
        if self.greeting == "wrong_proof" and isinstance(reply, Challenge):
            reply = Challenge(reply.nonce, b"\x00" * 32)
        if self.greeting == "wrong_proof" and self.secret is None:
            reply = Challenge(NONCE, b"\x00" * 32)  # a challenge the client cannot answer
        await send(encode(reply))
        return True

    async def _answer(
        self,
        send: Callable[[bytes], Awaitable[None]],
        stream: trio.SocketStream,
        tid: str,
        moves: list[Move],
    ) -> None:
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._play(send, tid, moves)
        await trio.aclose_forcefully(stream)

    async def _play(
        self, send: Callable[[bytes], Awaitable[None]], tid: str, moves: list[Move]
    ) -> None:
        """Send *moves*; return to keep the connection, raise Closed to close it."""
        for move, n in moves:
            if move in ("data", "last"):
                await send(encode(KvData(tid, b"\0" * n, move == "last")))
            elif move in ("data_other_id", "last_other_id"):
                await send(encode(KvData(tid + "-x", b"\0" * n, move == "last_other_id")))
            elif move == "stall":
                await trio.sleep(n / 100)
            elif move == "bad_type":
                await send(_bad_kv_data(tid))
            elif move == "garbage":
                await send(b"\x00\x00\x00\x04\xc1junk")
            elif move == "oversize":
                await send(struct.pack(">I", DEFAULT_MAX_FRAME + 1))
            elif move == "partial":
                await send(struct.pack(">I", 100) + b"\x80" * 10)  # and never the rest
            elif move == "error":
                await send(encode(Error(tid, ErrorCode.KV_TRANSFER_FAILED, "not here")))
            elif move == "fault":
                await send(encode(Fault("protocol_error", "you again")))
            elif move == "chunk":
                await send(encode(Chunk(tid, [1])))
            elif move == "ack":
                await send(encode(Ack(tid)))
            elif move == "close":
                break
            if move in ("last", "error", "chunk", "ack"):
                await trio.sleep_forever()  # answered: the connection goes on
        raise trio.ClosedResourceError


@settings(
    max_examples=LIVE_EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    pulls=st.lists(st.tuples(st.lists(MOVES, max_size=4), ENDS, GREETINGS), min_size=1, max_size=6),
    secret=st.sampled_from([None, SECRET]),
)
async def test_a_decode_worker_pulling_from_a_fuzzed_prefill_worker(
    pulls: list[tuple[list[Move], Move, str]], secret: bytes | None
) -> None:
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    try:
        with trio.fail_after(EXAMPLE_BOUND):
            async with trio.open_nursery() as nursery:
                await _fuzz_pulls(nursery, pulls, secret)
                nursery.cancel_scope.cancel()
    finally:
        logging.getLogger().removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []


async def _fuzz_pulls(
    nursery: trio.Nursery, pulls: list[tuple[list[Move], Move, str]], secret: bytes | None
) -> None:
    config = WorkerConfig(
        role=Role.DECODE,
        engine_config=MockerConfig(speedup_ratio=FAST),
        secret=secret,
        plane=PULL_TIMEOUTS,
    )
    decode: RunningWorker = await nursery.start(partial(serve_worker, config))
    assert decode.kv_transfer is not None
    fake = FakePrefill(secret)
    await nursery.start(fake.serve)
    instance = WorkerInstance(decode.worker_id, decode.role, decode.model, decode.address)
    client = await connect_worker(instance, nursery, secret=secret)

    def leg(rid: str, handle: KvHandle | None) -> GenerateRequest:
        return GenerateRequest(
            rid,
            MODEL,
            list(range(7, 7 + PROMPT)),
            SamplingParams(max_tokens=4, ignore_eos=True, seed=3),
            handle,
        )

    async def pull_through(rid: str, prefill: FakePrefill, moves: list[Move]) -> bool:
        """A decode leg whose KV the fake answers with *moves*: True if it ran."""
        prefill.answers[rid] = moves
        handle = KvHandle("fake-prefill", prefill.address, rid, PROMPT)
        try:
            async with client.stream(leg(rid, handle)) as chunks:
                tokens = [t async for c in chunks for t in c.token_ids]
        except WorkerError as exc:
            failure: WorkerError | None = exc
        else:
            failure = None
        if failure is not None:  # failed cleanly, as one the frontend migrates
            assert failure.code is ErrorCode.KV_TRANSFER_FAILED, failure
            assert rid in failure.message
            return False
        assert len(tokens) == 4
        return True

    def quiet() -> bool:
        stats = decode.runtime.statistics()
        return (
            stats.inflight == 0
            and stats.engine.kv_blocks_used == 0
            and stats.engine.waiting_requests == 0
        )

    assert await pull_through("warm-up", fake, [("last", 4096)])
    await wait_until(quiet)
    before, tasks, fds = decode.kv_transfer.statistics(), task_count(), open_fds()
    assert before.connections == 1

    plain_runs = 0
    pulls_done = trio.Event()

    async def plain_loop() -> None:  # the decode worker keeps serving other requests
        nonlocal plain_runs
        while not pulls_done.is_set() or plain_runs == 0:
            async with client.stream(leg(f"plain-{plain_runs}", None)) as chunks:
                assert len([t async for c in chunks for t in c.token_ids]) == 4
            plain_runs += 1

    outcomes: list[tuple[bool, bool]] = []  # (expected, got)
    async with trio.open_nursery() as inner:
        inner.start_soon(plain_loop)
        for i, (moves, end, greeting) in enumerate(pulls):
            script = [*moves, end]
            if greeting == "ok":
                with trio.fail_after(CASE_BOUND):
                    got = await pull_through(f"t{i}", fake, script)
                outcomes.append((pull_outcome(script), got))
                continue
            # Another prefill worker, one that never completes the handshake.
            async with trio.open_nursery() as elsewhere:
                unfriendly = FakePrefill(secret, greeting)
                await elsewhere.start(unfriendly.serve)
                with trio.fail_after(CASE_BOUND):
                    got = await pull_through(f"t{i}", unfriendly, script)
                outcomes.append((False, got))
                elsewhere.cancel_scope.cancel()
        # The pool recovered: whatever broke, the next pull works (dialling if it must).
        with trio.fail_after(CASE_BOUND):
            assert await pull_through("after", fake, [("last", 4096)])
        pulls_done.set()

    assert [got for _, got in outcomes] == [expected for expected, _ in outcomes]
    assert plain_runs >= 1
    assert client.statistics().disconnects_total == 0
    await wait_until(quiet)
    after = decode.kv_transfer.statistics()
    successes = sum(got for _, got in outcomes)
    assert after.pulls_total - before.pulls_total == successes + 1
    assert after.pull_failures_total - before.pull_failures_total == len(outcomes) - successes
    # What broke was dropped; at most the one connection to the fake is left, as before.
    await wait_until(lambda: decode.kv_transfer.statistics().connections == 1)  # type: ignore[union-attr]
    assert task_count() == tasks
    assert open_fds() == fds
