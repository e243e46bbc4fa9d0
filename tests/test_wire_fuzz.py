"""Fuzzing the plane's sans-IO layer: the frame decoder and both handshakes.

Test policy: property tests (hypothesis), no I/O. Whatever bytes or frames a peer
sends, the decoder yields frames or raises ProtocolError (FrameTooLarge, AuthError)
and nothing else: no KeyError, TypeError, MemoryError, RecursionError, no hang; what
it yields re-encodes; what it allocates stays within a bound of the bytes it was fed;
and what it says (an error message, which goes back to the peer in a Fault and into
the worker's log) stays short. The handshakes are checked against a model of who
may be let in. Example counts are set per test (a few hundred each, ~10 s for the
file); under CI hypothesis derandomizes by itself (its ``ci`` profile).
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.wire.codec import KINDS, FrameDecoder, decode_body, encode
from headwater.wire.errors import MAX_MESSAGE, AuthError, ProtocolError
from headwater.wire.frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Fault,
    Frame,
    Hello,
    HelloOk,
    Unreadable,
)
from headwater.wire.handshake import ClientHandshake, ServerHandshake, proof

from test_framing import EXAMPLES

# Long-running (hundreds of examples per property):
# the full suite's, not `make test-fast`'s.
pytestmark = pytest.mark.slow

FRAME_TYPES = {type(f) for f in EXAMPLES}
#: Each EXAMPLES frame as the map its body unpacks to: what the mutations start from.
MAPS: list[dict[Any, Any]] = [msgpack.unpackb(encode(f)[4:], raw=False) for f in EXAMPLES]
MAX_FRAME = 1 << 20  # small enough that "huge" lengths are reachable by the strategies

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- the properties ---------------------------------------------------------------------


def decodes_or_refuses(data: bytes, cuts: list[int] = [], max_frame: int = MAX_FRAME) -> None:  # noqa: B006
    """Feed *data* in pieces cut at *cuts*; only frames or a ProtocolError may come out.

    Anything else propagates and fails the test. A refusal leaves the decoder failed
    and holding nothing; a frame that comes out re-encodes to bytes that decode to it.
    """
    decoder = FrameDecoder(max_frame)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    frames: list[Frame] = []
    try:
        for a, b in itertools.pairwise(points):
            frames += decoder.feed(data[a:b])
            assert decoder.buffered <= len(data)
    except ProtocolError as exc:
        refusal: ProtocolError | None = exc
    else:
        refusal = None
    for frame in frames:
        if isinstance(frame, Unreadable):  # a request that fails alone: only its id read
            assert 0 < len(frame.request_id) <= 1024
            assert len(frame.reason) <= MAX_MESSAGE
            continue
        assert type(frame) in FRAME_TYPES
        again = encode(frame, max_frame)  # what a peer decodes, it can send on
        assert encode(FrameDecoder(max_frame).feed(again)[0], max_frame) == again
    if refusal is not None:
        assert len(refusal.message) <= MAX_MESSAGE, refusal.message[:200]
        assert decoder.buffered == 0
        with pytest.raises(ProtocolError):
            decoder.feed(b"")


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# ---- strategies -------------------------------------------------------------------------

#: Integers at the edges a field check must get right: negatives, bool-like, uint32,
#: int64 and uint64 bounds.
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1])
SCALARS = (
    st.none()
    | st.booleans()
    | EDGE_INTS
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()  # nan and infinities included
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from([b"n" * (NONCE_BYTES - 1), b"n" * NONCE_BYTES, b"\x00" * 7, ""])
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
)
#: Map keys of every msgpack type a hostile peer might use, most of them refused.
KEYS = (
    st.text(max_size=10)
    | st.binary(max_size=4)
    | st.integers(-5, 5)
    | st.sampled_from(
        ["k", "request_id", "token_ids", "transfer_id", "seq", "data", "nonce", "proof"]
    )
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(KEYS, inner, max_size=6),
    max_leaves=24,
)


@st.composite
def mutated_map(draw: st.DrawFn, base: dict[Any, Any], depth: int = 0) -> dict[Any, Any]:
    """*base* with fields dropped, retyped, added (any key type), its nested maps
    mutated the same way, or its kind swapped for another (so every field is missing
    or extra)."""
    m = dict(base)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["drop", "retype", "add", "nested", "kind"]))
        keys = list(m)
        nested = [k for k, v in m.items() if isinstance(v, dict)]
        if op == "drop" and keys:
            del m[draw(st.sampled_from(keys))]
        elif op == "retype" and keys:
            m[draw(st.sampled_from(keys))] = draw(VALUES)
        elif op == "add":
            m[draw(KEYS)] = draw(VALUES)
        elif op == "nested" and nested and depth < 3:
            key = draw(st.sampled_from(nested))
            m[key] = draw(mutated_map(m[key], depth + 1))
        elif op == "kind":
            m["k"] = draw(st.sampled_from(sorted(KINDS)) | st.text(max_size=12) | VALUES)
    return m


def packed(obj: object) -> bytes:
    raw: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=False)
    return raw


# ---- bytes ------------------------------------------------------------------------------


@_SETTINGS
@given(st.binary(max_size=4096), st.lists(st.integers(min_value=0), max_size=8))
def test_random_bytes(data: bytes, cuts: list[int]) -> None:
    decodes_or_refuses(data, cuts)


@_SETTINGS
@given(
    st.lists(st.sampled_from(EXAMPLES), min_size=1, max_size=4),
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "truncate", "extend", "insert", "delete", "length"]),
            st.integers(min_value=0),
            st.binary(min_size=1, max_size=16),
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.integers(min_value=0), max_size=4),
)
def test_mutated_encodings_of_every_kind(
    frames: list[Frame], mutations: list[tuple[str, int, bytes]], cuts: list[int]
) -> None:
    data = bytearray(b"".join(encode(f) for f in frames))
    for op, where, junk in mutations:
        at = where % (len(data) + 1)
        if op == "flip" and data:
            data[at % len(data)] ^= 1 << (where % 8)
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += junk
        elif op == "insert":
            data[at:at] = junk
        elif op == "delete":
            del data[at : at + len(junk)]
        elif op == "length" and len(data) >= 4:  # the first frame's header, rewritten
            data[:4] = struct.pack(">I", int.from_bytes(junk[:4].ljust(4, b"\0")))
    decodes_or_refuses(bytes(data), cuts)


@_SETTINGS
@given(st.sampled_from(MAPS).flatmap(mutated_map))
def test_maps_with_wrong_missing_and_extra_fields(body: dict[Any, Any]) -> None:
    try:
        raw = packed(body)
    except (TypeError, ValueError, OverflowError):
        return  # msgpack itself cannot pack it (a key type it refuses): nothing to send
    decodes_or_refuses(framed(raw))


@_SETTINGS
@given(VALUES)
def test_any_msgpack_value_as_a_body(value: object) -> None:
    decodes_or_refuses(framed(packed(value)))


@_SETTINGS
@given(st.integers(min_value=0, max_value=2**32 - 1), st.binary(max_size=64))
def test_huge_lengths_allocate_nothing_ahead(length: int, partial: bytes) -> None:
    """A length prefix is never trusted for an allocation: the decoder holds what it
    was fed and no more, and a length over the limit is refused from the header."""
    data = struct.pack(">I", length) + partial
    decoder = FrameDecoder(MAX_FRAME)
    tracemalloc.start()
    try:
        decoder.feed(data)
    except ProtocolError:
        assert length == 0 or length > MAX_FRAME or length <= len(partial)
    else:
        assert decoder.buffered <= len(data)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * 1024


# ---- big frames: memory and time stay bounded -------------------------------------------

UNITS = st.sampled_from(
    [b"\x90", b"\x80", b"\xc0", b"\x01", b"\xa2ab", b"\xc4\x01x", b"\x91\x90", b"\x81\xa1a\x90"]
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    UNITS,
    st.integers(min_value=1, max_value=400_000),
    st.sampled_from(["chunk", "stats", "x"]),
    st.booleans(),
)
def test_a_big_frame_of_small_items_stays_within_a_memory_bound(
    unit: bytes, count: int, kind: str, as_map: bool
) -> None:
    """*count* copies of a tiny msgpack item (an empty list, a 2-byte str, ...) in one
    array, or one map per item, inside a frame: a few bytes each on the wire, tens of
    bytes each as Python objects. The decoder must refuse such a frame before it
    builds them all, or a 64 MiB frame takes gigabytes and tens of seconds of the
    event loop."""
    items = b"\x81\xa1a" + unit if as_map else unit  # as_map: [{"a": unit}, {"a": unit}, ...]
    body = b"\x82\xa1k" + packed(kind) + b"\xa1v\xdd" + struct.pack(">I", count) + items * count
    tracemalloc.start()
    try:
        decodes_or_refuses(framed(body), max_frame=64 * 1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(body) + 16 * 1024 * 1024, f"{peak / len(body):.0f} bytes per byte"


def test_a_frame_of_a_million_empty_lists_is_refused_early() -> None:
    """The regression the property above found: 1 MiB of ``[[], [], ...]`` unpacked
    into a million list objects (~70 MB; a 64 MiB frame: 4.2 GB and 45 s of the loop)
    before the chunk parser saw that token_ids were not ints."""
    n = 1 << 17  # each list within max_array_len, so only counting all of them stops it
    lists = (b"\xdd" + struct.pack(">I", n) + b"\x90" * n) * 8
    body = b"\x82\xa1k\xa5chunk\xa9token_ids\x98" + lists
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="items"):
            decode_body(body, max_frame=64 * 1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024


def test_legit_big_frames_still_decode() -> None:
    """What a bound on items must not refuse: a 1M-token prompt, a 4 MiB KV piece, a
    chunk carrying 60k tokens, the widest stats frame."""
    from headwater.wire import Chunk, GenerateRequest, SamplingParams
    from headwater.wire.frames import KvData, Stats

    frames: list[Frame] = [
        GenerateRequest("r", "m", list(range(1_000_000)), SamplingParams(max_tokens=1)),
        KvData("t", b"\0" * (4 << 20), True),
        Chunk("r", list(range(100_000, 160_000))),
        Stats(1, {f"counter_{i}": i for i in range(256)}),
    ]
    for frame in frames:
        (decoded,) = FrameDecoder().feed(encode(frame))
        assert encode(decoded) == encode(frame)


# ---- what errors say --------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"k": "x" * 1_000_000},
        {"k": "chunk", "request_id": "r", "finish_reason": "y" * 1_000_000},
        {"k": "error", "code": "c" * 1_000_000, "message": "m" * 1_000_000},
    ],
    ids=["kind", "finish-reason", "fault"],
)
def test_error_messages_stay_short_whatever_the_peer_sent(body: dict[str, str]) -> None:
    """An error message goes back to the peer in a Fault and into the log: a peer's
    megabyte-long kind must not come back a megabyte long (it did, repr'd whole)."""

    def decode_and_hear() -> None:
        client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=None)
        for frame in FrameDecoder(4 << 20).feed(framed(packed(body))):
            client.receive(frame)  # the fault: what the worker said, quoted

    with pytest.raises(ProtocolError) as info:
        decode_and_hear()
    assert len(info.value.message) <= MAX_MESSAGE
    assert len(str(info.value)) <= MAX_MESSAGE


# ---- the handshakes against a model ----------------------------------------------------

SECRET = b"correct horse"
IDENTITY = HelloOk(PROTOCOL_VERSION, "agg", "agg-1", "deepseek-v4")
#: Every example frame that is not part of a handshake.
OTHER_FRAMES = st.sampled_from(
    [f for f in EXAMPLES if not isinstance(f, Hello | Challenge | Auth | HelloOk | Fault)]
)
#: What a client may send: a hello of any version, a correct or a wrong proof, any frame.
CLIENT_MOVES = st.lists(
    st.one_of(
        st.tuples(st.just("hello"), st.sampled_from([PROTOCOL_VERSION, 0, 2, 2**64 - 1])),
        st.tuples(st.just("auth"), st.sampled_from(["right", "wrong", "empty", "reflected"])),
        st.tuples(st.just("frame"), OTHER_FRAMES),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(CLIENT_MOVES, st.sampled_from([None, SECRET]))
def test_server_handshake_lets_in_only_a_client_that_proves_the_secret(
    moves: list[tuple[str, Any]], secret: bytes | None
) -> None:
    server = ServerHandshake(IDENTITY, secret=secret)
    client_nonce = b"c" * NONCE_BYTES
    challenge: Challenge | None = None
    accepted: list[str] = []  # the moves that the model says must pass, in order
    for i, (move, arg) in enumerate(moves):
        frame: Frame
        if move == "hello":
            frame = Hello(arg, "frontend", "fe", "", client_nonce)
        elif move == "auth":
            server_nonce = challenge.nonce if challenge is not None else b"s" * NONCE_BYTES
            frame = Auth(
                {
                    "right": proof(SECRET, "client", client_nonce, server_nonce),
                    "wrong": proof(b"guess", "client", client_nonce, server_nonce),
                    "empty": b"",
                    "reflected": challenge.proof if challenge is not None else b"r" * 32,
                }[arg]
            )
        else:
            frame = arg
        # The model: hello(v1) first; with a secret, then the right proof; nothing after.
        expected_ok = (i == 0 and move == "hello" and arg == PROTOCOL_VERSION) or (
            i == 1
            and secret is not None
            and accepted == ["hello"]
            and move == "auth"
            and arg == "right"
        )
        refusal: ProtocolError | None
        try:
            reply = server.receive(frame)
        except ProtocolError as exc:
            refusal = exc
        else:
            refusal = None
        if refusal is not None:
            assert not expected_ok, f"refused {move} {arg!r}: {refusal}"
            assert refusal.code in {"protocol_error", "unsupported_version", "unauthorized"}
            assert (refusal.code == "unauthorized") == isinstance(refusal, AuthError)
            break
        assert expected_ok, f"accepted {move} {arg!r} after {accepted}"
        accepted.append(move)
        encode(reply)  # whatever it answers can be sent
        if isinstance(reply, Challenge):
            assert secret is not None
            challenge = reply
        else:
            assert reply == IDENTITY
    let_in = accepted == (["hello"] if secret is None else ["hello", "auth"])
    assert (server.peer is not None) == let_in


#: What a worker may send: a challenge (good proof or not), hello_ok of any version, a
#: fault, any other frame.
WORKER_MOVES = st.lists(
    st.one_of(
        st.tuples(st.just("challenge"), st.sampled_from(["right", "wrong", "short"])),
        st.tuples(st.just("hello_ok"), st.sampled_from([PROTOCOL_VERSION, 0, 2])),
        st.tuples(st.just("fault"), st.sampled_from(["unauthorized", "protocol_error", "x"])),
        st.tuples(st.just("frame"), OTHER_FRAMES),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(WORKER_MOVES, st.sampled_from([None, SECRET]))
def test_client_handshake_trusts_only_a_worker_that_proves_the_secret(
    moves: list[tuple[str, Any]], secret: bytes | None
) -> None:
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=secret)
    hello = client.start()
    accepted: list[str] = []
    for move, arg in moves:
        server_nonce = b"s" * NONCE_BYTES
        frame: Frame
        if move == "challenge":
            key = SECRET if arg == "right" else b"guess"
            p = proof(key, "server", hello.nonce, server_nonce)
            frame = Challenge(server_nonce, p[:8] if arg == "short" else p)
        elif move == "hello_ok":
            frame = HelloOk(arg, "agg", "agg-1", "m")
        elif move == "fault":
            frame = Fault(arg, "no")
        else:
            frame = arg
        if secret is None:
            expected_ok = not accepted and move == "hello_ok" and arg == PROTOCOL_VERSION
        else:
            expected_ok = (not accepted and move == "challenge" and arg == "right") or (
                accepted == ["challenge"] and move == "hello_ok" and arg == PROTOCOL_VERSION
            )
        refusal: ProtocolError | None
        try:
            reply = client.receive(frame)
        except ProtocolError as exc:
            refusal = exc
        else:
            refusal = None
        if refusal is not None:
            assert not expected_ok, f"refused {move} {arg!r}: {refusal}"
            if move == "fault" and not accepted:
                assert refusal.code == arg  # the worker's own code, passed on
            break
        assert expected_ok, f"accepted {move} {arg!r} after {accepted}"
        accepted.append(move)
        if reply is not None:
            assert isinstance(reply, Auth)
            assert reply.proof == proof(SECRET, "client", hello.nonce, server_nonce)
            encode(reply)
    trusted = accepted == (["hello_ok"] if secret is None else ["challenge", "hello_ok"])
    assert (client.peer is not None) == trusted


@_SETTINGS
@given(st.sampled_from([None, SECRET]), st.lists(st.binary(max_size=200), max_size=4))
def test_handshake_bytes_through_the_decoder(secret: bytes | None, chunks: list[bytes]) -> None:
    """Random and mutated bytes where a handshake frame should be: both sides end in a
    peer or a ProtocolError, nothing else, as the trio shells expect."""
    hello = bytearray(encode(Hello(PROTOCOL_VERSION, "frontend", "fe", "", b"n" * 32)))
    for chunk in chunks:
        if chunk:
            hello[chunk[0] % len(hello)] ^= chunk[-1] or 1
    for data in (bytes(hello), *chunks):
        server = ServerHandshake(IDENTITY, secret=secret)
        client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=secret)
        client.start()
        for side in (server, client):
            try:
                for frame in FrameDecoder().feed(data):
                    side.receive(frame)
            except ProtocolError:
                continue
