"""The sans-IO frame codec and handshake: round trips, hostile input, split feeds."""

from __future__ import annotations

import itertools
import re
import struct
from array import array
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.wire import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
    TokenLogprobs,
)
from headwater.wire.addresses import format_tcp_address, is_loopback, parse_tcp_address
from headwater.wire.capabilities import Capabilities
from headwater.wire.codec import (
    KINDS,
    MAX_KV_PARAMS_BYTES,
    MAX_KV_PARAMS_DEPTH,
    MAX_READ,
    FrameDecoder,
    decode_body,
    encode,
    encode_parts,
    pack_block_hashes,
    pack_token_ids,
    read_size,
    unpack_block_hashes,
    unpack_token_ids,
)
from headwater.wire.errors import AuthError, FrameTooLarge, ProtocolError
from headwater.wire.frames import (
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
    KvEvents,
    KvPoll,
    KvPrompt,
    KvPull,
    KvRelease,
    Ping,
    Pong,
    Stats,
    Unreadable,
)
from headwater.wire.handshake import (
    ClientHandshake,
    PlaneSecret,
    ServerHandshake,
    load_secret,
    proof,
)
from headwater.wire.kv_events import AllCleared, BlockRemoved, KvEventBatch
from headwater.wire.session import FrameMac
from headwater.wire.tokens import TOKEN_TYPECODE, token_array

HANDLE = KvHandle("prefill-1", "tcp://10.0.0.5:7000", "t" * 32, 1234)
#: A handle carrying its prompt's block hashes: 1234 tokens are 19 full blocks of 64.
HASHES = (0, 1, -1, 2**63 - 1, -(2**63), hash((0, hash((5, 6)))), *range(-6, 7))
HASHED_HANDLE = KvHandle(
    "prefill-1", "tcp://10.0.0.5:7000", "h" * 32, 1234, block_hashes=HASHES, block_size=64
)
REQUEST = GenerateRequest(
    request_id="req-1",
    model="deepseek-v4",
    token_ids=token_array([0, 1, 127_999, 128_000, 2**32 - 1]),
    sampling=SamplingParams(
        max_tokens=64,
        min_tokens=2,
        ignore_eos=True,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        stop_token_ids=(7, 8),
    ),
    kv_handle=HANDLE,
    eos_token_ids=(1,),
)

#: A handle carrying engine params (an SGLang-style bootstrap, nested and of every type).
PARAMS = {
    "bootstrap_host": "10.0.0.5",
    "bootstrap_port": 8998,
    "bootstrap_room": 2**63 - 1,
    "extra": {"ratio": 0.5, "flags": [True, False, None], "blob": b"\x00\xff", "empty": {}},
    "layers": [[1, 2], {"a": -1}, []],
}
PARAMS_HANDLE = KvHandle("prefill-1", "tcp://10.0.0.5:7000", "p" * 32, 1234, params=PARAMS)

#: A request asking for logprobs, and a chunk carrying them (a prompt's too; -inf is a
#: logprob an engine may report).
LOGPROBS_REQUEST = GenerateRequest(
    "r4", "m", token_array([5, 6]), SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=0)
)
LOGPROBS_CHUNK = Chunk(
    "r4",
    [17, 18],
    logprobs=(
        TokenLogprobs(-0.25, 1, (17, 9), (-0.25, -1.5)),
        TokenLogprobs(float("-inf"), 2**32 - 1, (3, 4), (-0.5, -0.75)),
    ),
    prompt_logprobs=(TokenLogprobs(-3.0, 7),),
)

HASHED_REQUEST = GenerateRequest(
    "r3", "m", token_array([5] * 1234), SamplingParams(max_tokens=1), HASHED_HANDLE
)

#: One of every kind (the error kind twice: per request and per connection).
EXAMPLES: list[Frame] = [
    Hello(PROTOCOL_VERSION, "frontend", "fe-1", "deepseek-v4", b"n" * 32),
    Challenge(b"s" * 32, b"p" * 32),
    Auth(b"q" * 32),
    HelloOk(PROTOCOL_VERSION, "agg", "agg-1", "deepseek-v4"),
    HelloOk(
        PROTOCOL_VERSION,
        "agg",
        "agg-1",
        "deepseek-v4",
        Capabilities("vllm", frozenset({"seed", "top_k", "structured_outputs"})),
    ),
    REQUEST,
    GenerateRequest("r2", "m", token_array([5]), SamplingParams(max_tokens=1)),
    GenerateRequest(
        "r3",
        "m",
        token_array([5, 6]),
        SamplingParams(
            max_tokens=4,
            top_k=3,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias=((5, 1.5), (9, -100.0)),
            structured=StructuredOutput(StructuredKind.JSON, '{"type": "object"}'),
        ),
    ),
    HASHED_REQUEST,
    LOGPROBS_REQUEST,
    # A decode leg whose prompt comes with its KV pull: no token_ids on the wire.
    GenerateRequest(
        "r4",
        "m",
        token_array(),
        SamplingParams(max_tokens=1),
        KvHandle("p-1", "tcp://10.0.0.1:7001", "t" * 32, 1234, holds_prompt=True),
    ),
    Ack("req-1"),
    Chunk("req-1", [17, 18], FinishReason.LENGTH, HANDLE, cached_tokens=64),
    Chunk("req-1"),
    Chunk("req-1", [], FinishReason.LENGTH, HASHED_HANDLE),
    Chunk("req-1", [], FinishReason.LENGTH, PARAMS_HANDLE),
    LOGPROBS_CHUNK,
    End("req-1"),
    Error("req-1", ErrorCode.OVERLOADED, "busy"),
    Fault("frame_too_large", "too big"),
    Cancel("req-1"),
    Ping(3),
    Pong(3),
    KvPull("t" * 32),
    KvPull("t" * 32, prompt=True),
    KvPrompt("t" * 32, token_array([5] * 1234)),
    KvData("t" * 32, b"\x00" * 100, True),
    KvRelease("t" * 32),
    GetStats(9),
    Stats(9, {"inflight": 2, "draining": False, "role": "agg", "load": 0.5}),
    GoAway("draining"),
    KvPoll(4, -1, 256),
    KvEvents(4, KvEventBatch(0, 2, (BlockRemoved((5,)), AllCleared()), dump=True)),
]


def test_examples_cover_every_kind() -> None:
    kinds = {msgpack.unpackb(encode(f)[4:])["k"] for f in EXAMPLES}
    assert kinds == KINDS


_F = TypeVar("_F")


def decode_one(data: bytes, kind: type[_F]) -> _F:
    """The one frame *data* holds, a *kind*."""
    (frame,) = FrameDecoder().feed(data)
    assert isinstance(frame, kind)
    return frame


def handle_of(frame: Frame) -> KvHandle:
    """The KV handle *frame*, a request or a chunk, carries."""
    assert isinstance(frame, (GenerateRequest, Chunk))
    assert frame.kv_handle is not None
    return frame.kv_handle


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: Frame) -> None:
    assert FrameDecoder().feed(encode(frame)) == [frame]


def test_request_tokens_travel_packed() -> None:
    body = msgpack.unpackb(encode(REQUEST)[4:])
    assert body["token_ids"] == pack_token_ids(REQUEST.token_ids)
    assert len(body["token_ids"]) == 4 * len(REQUEST.token_ids)
    assert unpack_token_ids(body["token_ids"]) == REQUEST.token_ids
    # The packed bytes are the token array's own: little-endian uint32, in order.
    assert body["token_ids"][:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    decoded = decode_one(encode(REQUEST), GenerateRequest)
    assert isinstance(decoded.token_ids, array)
    assert decoded.token_ids.typecode == TOKEN_TYPECODE  # unpacked as one array, no int list


def test_requests_built_from_int_lists_travel_the_same() -> None:
    as_list = GenerateRequest("r", "m", [3, 2**32 - 1, 0], SamplingParams(max_tokens=1))
    decoded = decode_one(encode(as_list), GenerateRequest)
    assert decoded.token_ids == token_array([3, 2**32 - 1, 0])


def test_block_hashes_travel_packed_in_requests_and_chunks() -> None:
    for frame in (HASHED_REQUEST, Chunk("r", [], None, HASHED_HANDLE)):
        body = msgpack.unpackb(encode(frame)[4:])
        packed = body["kv_handle"]["block_hashes"]
        assert packed == pack_block_hashes(HASHES)
        assert len(packed) == 8 * len(HASHES)
        assert body["kv_handle"]["block_size"] == 64
        (decoded,) = FrameDecoder().feed(encode(frame))
        assert handle_of(decoded).block_hashes == HASHES
        assert type(handle_of(decoded).block_hashes) is tuple
    assert unpack_block_hashes(pack_block_hashes(HASHES)) == HASHES


def test_handle_without_hashes_keeps_the_old_wire_form() -> None:
    # What an older peer sends and expects: exactly these keys, nothing new.
    old = {"worker_id": "w", "address": "tcp://h:1", "transfer_id": "t", "num_tokens": 9}
    encoded = encode(Chunk("r", [1], None, KvHandle("w", "tcp://h:1", "t", 9)))
    assert msgpack.unpackb(encoded[4:])["kv_handle"] == old
    assert msgpack.packb(old, use_bin_type=True) in encoded  # the very bytes, in order
    (chunk,) = FrameDecoder().feed(_body({**GOOD_CHUNK, "kv_handle": old}))
    assert handle_of(chunk) == KvHandle("w", "tcp://h:1", "t", 9)
    assert (handle_of(chunk).block_hashes, handle_of(chunk).block_size) == ((), 0)


@pytest.mark.slow
def test_logprobs_travel_only_when_asked_and_packed() -> None:
    # Not asked: the request and the chunk encode as before logprobs existed.
    plain = msgpack.unpackb(encode(REQUEST)[4:])
    assert not {"logprobs", "prompt_logprobs"} & set(plain["sampling"])
    assert msgpack.unpackb(encode(Chunk("r", [1]))[4:]).keys() == {
        "request_id",
        "token_ids",
        "finish_reason",
        "kv_handle",
        "cached_tokens",
        "k",
    }
    # Asked: the counts in the request, the numbers as five packed columns per field.
    asked = msgpack.unpackb(encode(LOGPROBS_REQUEST)[4:])["sampling"]
    assert (asked["logprobs"], asked["prompt_logprobs"]) == (20, 0)
    body = msgpack.unpackb(encode(LOGPROBS_CHUNK)[4:])
    assert set(body["logprobs"]) == set(body["prompt_logprobs"]) == {"lp", "rk", "tn", "ti", "tl"}
    assert all(type(v) is bytes for v in body["logprobs"].values())
    # A prompt's top-20 logprobs over 40k tokens: far more numbers than MAX_ITEMS allows
    # as msgpack items, a few bin fields as columns.
    prompt = tuple(TokenLogprobs(-1.0, 2, tuple(range(20)), (-0.5,) * 20) for _ in range(40_000))
    big = Chunk("r", [1], logprobs=(TokenLogprobs(-1.0, 1),), prompt_logprobs=prompt)
    (decoded,) = FrameDecoder().feed(encode(big))
    assert decoded == big


@pytest.mark.parametrize(
    "columns",
    [
        "not a map",
        {"lp": b"", "rk": b"", "tn": b"", "ti": b""},  # a column missing
        {"lp": b"\0" * 8, "rk": b"", "tn": b"", "ti": b"", "tl": b""},  # one logprob, no rank
        {"lp": b"\0" * 7, "rk": b"", "tn": b"", "ti": b"", "tl": b""},  # a ragged float
        # One entry that claims two top tokens but brings one.
        {"lp": b"\0" * 8, "rk": b"\1\0\0\0", "tn": b"\2\0\0\0", "ti": b"\0" * 4, "tl": b"\0" * 8},
        {"lp": [0.5], "rk": b"", "tn": b"", "ti": b"", "tl": b""},  # not bytes
    ],
)
def test_inconsistent_logprobs_are_a_protocol_error(columns: object) -> None:
    with pytest.raises(ProtocolError, match="logprobs"):
        FrameDecoder().feed(_body({**GOOD_CHUNK, "logprobs": columns}))


def test_logprobs_must_match_the_chunks_tokens() -> None:
    two = msgpack.unpackb(encode(LOGPROBS_CHUNK)[4:])["logprobs"]
    with pytest.raises(ProtocolError, match="2 logprobs for 1 tokens"):
        FrameDecoder().feed(_body({**GOOD_CHUNK, "logprobs": two}))
    # A request asking for a negative count fails alone (the frame itself read).
    (refused,) = FrameDecoder().feed(
        _body({**GOOD_REQUEST, "sampling": {**GOOD_REQUEST["sampling"], "logprobs": -1}})
    )
    assert isinstance(refused, Unreadable)
    assert "'logprobs' is negative" in refused.reason


def test_block_hashes_out_of_range_refuse_to_encode() -> None:
    too_big = KvHandle("w", "a", "t", 64, block_hashes=(2**63,), block_size=64)
    with pytest.raises(ValueError, match="int64"):
        encode(Chunk("r", [], None, too_big))


def test_token_ids_out_of_range_refuse_to_encode() -> None:
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([-1])


def test_memoryview_payload_decodes_as_bytes() -> None:
    (frame,) = FrameDecoder().feed(encode(KvData("t", memoryview(b"abc"), False)))
    assert frame == KvData("t", b"abc", False)


@given(
    st.lists(st.sampled_from(EXAMPLES), min_size=1, max_size=8),
    st.lists(st.integers(min_value=0, max_value=5000), max_size=12),
)
def test_split_feeds_decode_identically(frames: list[Frame], cuts: list[int]) -> None:
    data = b"".join(encode(f) for f in frames)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    decoder = FrameDecoder()
    out: list[Frame] = []
    for a, b in itertools.pairwise(points):
        out.extend(decoder.feed(data[a:b]))
    assert out == frames
    assert decoder.buffered == 0


def test_a_reader_asks_for_the_rest_of_a_large_frame_at_once() -> None:
    # A 640 KB kv_data piece read 64 KiB at a time took ten reads; the decoder knows
    # from its length prefix how much is missing, and the reader asks for that.
    piece = encode(KvData("t", b"\x00" * 640_000, True))
    decoder = FrameDecoder()
    assert read_size(decoder, 65536) == 65536  # nothing begun: the usual read
    assert decoder.feed(piece[:3]) == []
    assert decoder.wanted == 0  # the prefix itself is not complete
    assert decoder.feed(piece[3:65536]) == []
    assert decoder.wanted == len(piece) - 65536
    assert read_size(decoder, 65536) == len(piece) - 65536
    assert decoder.feed(piece[65536:-10]) == []
    assert read_size(decoder, 65536) == 65536  # less than a usual read is missing
    assert decoder.feed(piece[-10:] + encode(Ping(1))[:6]) == [KvData("t", b"\x00" * 640_000, True)]
    assert decoder.wanted > 0  # the ping's prefix arrived, its body not yet
    huge = FrameDecoder(max_frame=64 << 20)
    huge.feed(struct.pack(">I", 60 << 20) + b"\x00")
    assert read_size(huge, 65536) == MAX_READ  # bounded, whatever the peer announces


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=0, max_value=300_000),
    st.text(min_size=1, max_size=300),
    st.booleans(),
)
def test_a_kv_piece_in_parts_is_the_same_bytes(size: int, transfer_id: str, last: bool) -> None:
    # A large piece goes out as the bytes around its payload plus the payload's own
    # buffer (not copied); joined, they are exactly what encode writes.
    payload = bytes(size)
    frame = KvData(transfer_id, memoryview(payload)[: size - size // 3], last)
    parts = encode_parts(frame)
    assert b"".join(parts) == encode(frame)
    if len(frame.data) >= 64 * 1024:
        assert len(parts) == 3
        assert isinstance(parts[1], memoryview)
        assert parts[1].obj is payload
    else:
        assert len(parts) == 1
    (decoded,) = FrameDecoder().feed(b"".join(parts))
    assert decoded == KvData(transfer_id, bytes(len(frame.data)), last)


def pieces(*payloads: bytes, last: bool = True) -> bytes:
    return b"".join(b"".join(encode_parts(KvData("t" * 32, p, last))) for p in payloads)


def test_a_large_kv_piece_lands_in_a_reused_payload_buffer() -> None:
    # Its payload goes from the bytes read to the decoder's payload buffer, not through
    # the frame buffer and a bytes object of its own (FrameDecoder).
    decoder = FrameDecoder()
    (first,) = decoder.feed(pieces(b"\x01" * 200_000))
    assert isinstance(first, KvData)
    assert isinstance(first.data, memoryview)
    assert first.data.readonly
    assert first.data == b"\x01" * 200_000
    buffer = id(first.data.obj)  # not a reference: that would hold it
    del first
    (second,) = decoder.feed(pieces(b"\x02" * 100_000))
    assert isinstance(second, KvData)
    assert isinstance(second.data, memoryview)
    assert id(second.data.obj) == buffer  # nothing held the first: reused
    assert second.data == b"\x02" * 100_000
    assert decoder.buffered == 0


def test_a_kv_piece_still_held_is_never_overwritten() -> None:
    decoder = FrameDecoder()
    a, b = decoder.feed(pieces(b"\x01" * 100_000, b"\x02" * 100_000))
    assert isinstance(a, KvData)
    assert isinstance(b, KvData)
    assert isinstance(a.data, memoryview)
    assert isinstance(b.data, memoryview)
    assert a.data.obj is not b.data.obj
    assert a.data == b"\x01" * 100_000
    assert b.data == b"\x02" * 100_000


@pytest.mark.parametrize("cut", [1, 50, 5000, 199_990])
def test_a_kv_piece_is_checked_against_its_tag_in_parts(cut: int) -> None:
    send, receive = (FrameMac(b"k" * 32) for _ in range(2))
    frame = KvData("t" * 32, b"\x04" * 200_000, False)
    data = b"".join(encode_parts(frame, mac=send)) + encode(Ping(2), mac=send)
    decoder = FrameDecoder(mac=receive)
    assert decoder.feed(data[:cut]) + decoder.feed(data[cut:]) == [frame, Ping(2)]
    altered = bytearray(b"".join(encode_parts(frame, mac=FrameMac(b"k" * 32))))
    altered[150_000] ^= 1  # a payload byte
    with pytest.raises(AuthError):
        FrameDecoder(mac=FrameMac(b"k" * 32)).feed(bytes(altered))


def test_a_kv_piece_with_a_malformed_tail_is_a_protocol_error() -> None:
    data = bytearray(pieces(b"\x00" * 100_000))
    data[-1] = 0xC0  # nil where the bool belongs
    with pytest.raises(ProtocolError, match="after its payload"):
        FrameDecoder().feed(bytes(data))


@pytest.mark.parametrize("n", [10, 16_384, 40_000])
@pytest.mark.parametrize("secret", [None, b"k" * 32])
def test_a_prompt_for_a_pull_leaves_as_its_arrays_own_buffer(n: int, secret: bytes | None) -> None:
    def mac() -> FrameMac | None:
        return None if secret is None else FrameMac(secret)

    ids = token_array(range(n))
    frame = KvPrompt("t" * 32, ids)
    parts = encode_parts(frame, mac=mac())
    assert b"".join(parts) == encode(frame, mac=mac())
    if 4 * n >= 64 * 1024:
        assert isinstance(parts[1], memoryview)
        assert parts[1].obj is ids  # not copied
    decoder = FrameDecoder(mac=mac())
    assert decoder.feed(b"".join(parts)) == [frame]


def test_a_kv_piece_in_parts_is_refused_when_too_large() -> None:
    with pytest.raises(FrameTooLarge):
        encode_parts(KvData("t", bytes(100_000), True), max_frame=99_000)


def test_one_byte_at_a_time() -> None:
    data = b"".join(encode(f) for f in EXAMPLES)
    decoder = FrameDecoder()
    out = [frame for i in range(len(data)) for frame in decoder.feed(data[i : i + 1])]
    assert out == EXAMPLES


def test_oversize_header_fails_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame=1000)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(struct.pack(">I", 1001))
    assert info.value.code == "frame_too_large"
    with pytest.raises(ProtocolError):  # the decoder stays failed
        decoder.feed(encode(Ping(1)))


def test_encode_refuses_oversize_frames() -> None:
    with pytest.raises(FrameTooLarge):
        encode(KvData("t", b"x" * 2000, True), max_frame=1000)


def _body(obj: object) -> bytes:
    raw: bytes = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw


GOOD_CHUNK = {"k": "chunk", "request_id": "r", "token_ids": [1]}
GOOD_REQUEST = msgpack.unpackb(encode(REQUEST)[4:])
GOOD_HASHED = msgpack.unpackb(encode(Chunk("r", [], None, HASHED_HANDLE))[4:])["kv_handle"]


def _hashed_chunk(**handle: object) -> dict[str, object]:
    """A chunk whose hashed KV handle has *handle*'s fields changed (None drops one)."""
    fields = {k: v for k, v in {**GOOD_HASHED, **handle}.items() if v is not None}
    return {**GOOD_CHUNK, "kv_handle": fields}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"k": "launch_missiles"}, "unknown frame kind"),
        ({"no_kind": 1}, "unknown frame kind"),
        ([1, 2, 3], "not a map"),
        ({"k": "chunk", "request_id": 5}, "request_id"),
        ({**GOOD_CHUNK, "token_ids": ["a"]}, "token_ids"),
        ({**GOOD_CHUNK, "token_ids": [True]}, "token_ids"),
        ({**GOOD_CHUNK, "token_ids": [-1]}, "token_ids"),
        ({**GOOD_CHUNK, "finish_reason": "exploded"}, "finish_reason"),
        ({**GOOD_CHUNK, "request_id": ""}, "empty"),
        ({**GOOD_REQUEST, "token_ids": b"abc"}, "uint32"),
        ({**GOOD_REQUEST, "token_ids": [1, 2]}, "token_ids"),
        ({**GOOD_REQUEST, "sampling": {"max_tokens": "many"}}, "max_tokens"),
        ({**GOOD_REQUEST, "sampling": {"max_tokens": -3}}, "negative"),
        ({**GOOD_REQUEST, "kv_handle": {"worker_id": "w"}}, "address"),
        (_hashed_chunk(block_hashes=b"\x00" * 7), "int64"),
        (_hashed_chunk(block_hashes=list(HASHES)), "block_hashes"),
        (_hashed_chunk(block_size=None), "block_size"),
        (_hashed_chunk(block_size=0), "block hashes"),
        (_hashed_chunk(block_size=-64), "negative"),
        (_hashed_chunk(block_size=65), "block hashes"),  # 1234 tokens: 18 full blocks of 65
        (_hashed_chunk(num_tokens=64 * 19 - 1), "block hashes"),
        (
            {"k": "hello", "version": 1, "role": "x", "peer_id": "p", "model": "", "nonce": b"1"},
            "nonce",
        ),
        ({"k": "stats", "seq": 1, "values": {"a": [1]}}, "scalars"),
        ({"k": "ping"}, "seq"),
    ],
)
def test_bad_fields_are_protocol_errors(body: object, match: str) -> None:
    if isinstance(body, dict) and body.get("k") == "request":
        # A request whose id reads fails alone (tests/test_attack_plane_frames.py): the
        # decoder yields it as Unreadable, with the reason the strict decode gives.
        (refused,) = FrameDecoder().feed(_body(body))
        assert isinstance(refused, Unreadable)
        assert refused.request_id == body["request_id"]
        assert re.search(match, refused.reason)
        with pytest.raises(ProtocolError, match=match):
            decode_body(_body(body)[4:], lenient=False)
        return
    with pytest.raises(ProtocolError, match=match):
        FrameDecoder().feed(_body(body))


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # reserved msgpack byte
        b"\x92\x01",  # truncated array
        b"\x81\x01\x02",  # int map key (strict_map_key)
        b"\xa2\xff\xfe",  # invalid utf-8 str
        b"\xd6\xff\x00\x00\x00\x01",  # ext type (timestamp)
        b"\x91" * 5000,  # nesting beyond msgpack's stack
        b"\x80\x80",  # trailing data
    ],
)
def test_undecodable_bodies(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(raw)


def test_empty_frame_is_an_error() -> None:
    with pytest.raises(ProtocolError, match="empty"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")


# ---- KV handle params -------------------------------------------------------------------


def _deep(levels: int) -> dict[str, object]:
    """Params nested *levels* deep (the map itself is level 1), alternating lists and maps."""
    value: object = 0
    for i in range(levels - 1):
        value = [value] if i % 2 == 0 else {"v": value}
    return {"v": value}


def test_params_round_trip_nested_in_requests_and_chunks() -> None:
    deepest = _deep(MAX_KV_PARAMS_DEPTH)
    for params in (PARAMS, deepest):
        handle = KvHandle("w", "tcp://h:1", "t", 9, params=params)
        request = GenerateRequest("r", "m", token_array([1]), SamplingParams(max_tokens=1), handle)
        for frame in (request, Chunk("r", [], None, handle)):
            (decoded,) = FrameDecoder().feed(encode(frame))
            assert decoded == frame
            assert handle_of(decoded).params == params
    # Travelling as their own msgpack bytes, beside the handle's other fields.
    body = msgpack.unpackb(encode(Chunk("r", [], None, PARAMS_HANDLE))[4:])
    assert msgpack.unpackb(body["kv_handle"]["params"]) == PARAMS


def test_params_stay_out_of_repr_and_hash() -> None:
    assert "bootstrap" not in repr(PARAMS_HANDLE)
    plain = KvHandle("prefill-1", "tcp://10.0.0.5:7000", "p" * 32, 1234)
    assert hash(PARAMS_HANDLE) == hash(plain)
    assert plain != PARAMS_HANDLE  # but equality compares them


def test_absent_params_are_empty_and_encode_as_before() -> None:
    old = {"worker_id": "w", "address": "tcp://h:1", "transfer_id": "t", "num_tokens": 9}
    (chunk,) = FrameDecoder().feed(_body({**GOOD_CHUNK, "kv_handle": old}))
    assert handle_of(chunk).params == {}
    assert KvHandle("w", "tcp://h:1", "t", 9).params == {}
    # Empty params add nothing to the wire: an older peer sees the handle it knows.
    encoded = encode(Chunk("r", [], None, KvHandle("w", "tcp://h:1", "t", 9, params={})))
    assert msgpack.unpackb(encoded[4:])["kv_handle"] == old


def test_params_at_the_size_limit_travel() -> None:
    # 1 byte of map header, 5 of key, 3 of bin header: packed, exactly the limit.
    params = {"blob": b"x" * (MAX_KV_PARAMS_BYTES - 9)}
    assert len(msgpack.packb(params, use_bin_type=True)) == MAX_KV_PARAMS_BYTES
    handle = KvHandle("w", "a", "t", 1, params=params)
    (decoded,) = FrameDecoder().feed(encode(Chunk("r", [], None, handle)))
    assert handle_of(decoded).params == params


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({1: "x"}, "key 1 is not a str"),
        ({"a": {b"k": 1}}, "is not a str"),
        ({"a": (1, 2)}, "unsupported type tuple"),
        ({"a": [{1, 2}]}, "unsupported type set"),
        ({"a": _Opaque()}, "unsupported type _Opaque"),
        ({"a": ErrorCode.INTERNAL}, "unsupported type ErrorCode"),
        ({"a": 2**64}, "kv_handle params"),
        (_deep(MAX_KV_PARAMS_DEPTH + 1), "deeper than"),
        ({"blob": b"x" * (MAX_KV_PARAMS_BYTES - 8)}, "exceeds"),  # one byte over
    ],
)
def test_bad_params_refuse_to_encode(params: dict[Any, object], match: str) -> None:
    handle = KvHandle("w", "a", "t", 1, params=params)
    with pytest.raises(ValueError, match=match):
        encode(Chunk("r", [], None, handle))


def _packed(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (_packed({b"k": 1}), "is not a str"),
        (_packed({"a": {"b": {b"k": 1}}}), "is not a str"),
        (b"\x81\x01\x02", "params"),  # an int key (strict_map_key)
        (_packed({"a": msgpack.ExtType(1, b"x")}), "params"),  # no ext types
        (_packed([1, 2]), "not a map"),
        (_packed(_deep(MAX_KV_PARAMS_DEPTH + 1)), "deeper than"),
        (_packed({"blob": b"x" * (MAX_KV_PARAMS_BYTES - 8)}), "exceeds"),  # one byte over
        (b"\x81\xa1a", "params"),  # truncated
        (_packed({}) + b"\x00", "params"),  # trailing data
        ({"a": 1}, "params"),  # a map, not its packed bytes
    ],
)
def test_bad_params_are_protocol_errors(params: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        FrameDecoder().feed(_body(_hashed_chunk(params=params)))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048), st.integers(min_value=1, max_value=64))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes, step: int) -> None:
    decoder = FrameDecoder(max_frame=4096)
    try:
        for i in range(0, len(data), step):
            decoder.feed(data[i : i + step])
    except ProtocolError:
        pass


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(EXAMPLES),
    st.integers(min_value=0, max_value=10_000),
    st.binary(min_size=1, max_size=8),
    st.booleans(),
)
@pytest.mark.slow
def test_garbled_and_truncated_frames_only_raise_protocol_error(
    frame: Frame, where: int, junk: bytes, truncate: bool
) -> None:
    data = bytearray(encode(frame))
    at = where % len(data)
    if truncate:
        del data[at:]
    else:
        data[at : at + len(junk)] = junk
    decoder = FrameDecoder()
    try:
        frames = decoder.feed(bytes(data))
    except ProtocolError:
        return
    assert all(type(f) in {type(e) for e in EXAMPLES} | {Unreadable} for f in frames)


# ---- handshake --------------------------------------------------------------------------

IDENTITY = HelloOk(PROTOCOL_VERSION, "agg", "agg-1", "deepseek-v4")


def _run_handshake(client_secret: bytes | None, server_secret: bytes | None) -> HelloOk:
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=client_secret)
    server = ServerHandshake(IDENTITY, secret=server_secret)
    to_server: Frame | None = client.start()
    while client.peer is None:
        assert to_server is not None
        # every frame crosses the codec, as on a socket
        (to_client,) = FrameDecoder().feed(encode(server.receive(to_server)))
        to_server = client.receive(to_client)
        if to_server is not None:
            (to_server,) = FrameDecoder().feed(encode(to_server))
    assert server.peer is not None
    assert server.peer.peer_id == "fe"
    return client.peer


def test_handshake_without_secret() -> None:
    assert _run_handshake(None, None) == IDENTITY


def test_handshake_with_matching_secret() -> None:
    assert _run_handshake(b"s3cret", b"s3cret") == IDENTITY


def test_wrong_secret_fails_on_the_client_first() -> None:
    # The server proves first; a client with another secret rejects that proof.
    with pytest.raises(AuthError, match="does not know"):
        _run_handshake(b"mine", b"theirs")


def test_server_rejects_a_wrong_client_proof() -> None:
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=b"s")
    server = ServerHandshake(IDENTITY, secret=b"s")
    challenge = server.receive(client.start())
    assert isinstance(challenge, Challenge)
    with pytest.raises(AuthError, match="wrong plane secret") as info:
        server.receive(Auth(b"\x00" * 32))
    assert info.value.code == "unauthorized"


def test_replayed_auth_fails_against_a_fresh_nonce() -> None:
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=b"s")
    first = ServerHandshake(IDENTITY, secret=b"s")
    auth = client.receive(first.receive(client.start()))
    assert isinstance(auth, Auth)
    assert first.receive(auth) == IDENTITY
    second = ServerHandshake(IDENTITY, secret=b"s")
    second.receive(client.start())
    with pytest.raises(AuthError):
        second.receive(auth)


def test_client_without_secret_cannot_answer_a_challenge() -> None:
    with pytest.raises(AuthError, match="requires a plane secret"):
        _run_handshake(None, b"s")


def test_client_with_secret_refuses_an_unauthenticated_worker() -> None:
    with pytest.raises(AuthError, match="skipped authentication"):
        _run_handshake(b"s", None)


def test_a_rotation_keeps_every_pair_of_ends_talking() -> None:
    """The three steps of docs/security.md's rotation, in every order ends restart in:
    each pair of ends that share a secret completes the handshake, whichever of them
    holds it as current; ends that share none are refused."""
    old, new = b"old-secret", b"new-secret"
    steps = [
        PlaneSecret(old),  # before
        PlaneSecret(old, [new]),  # 1: the new secret accepted everywhere, old still proves
        PlaneSecret(new, [old]),  # 2: the new secret proves, the old one still accepted
        PlaneSecret(new),  # 3: the old one gone
    ]
    for i, client in enumerate(steps):
        for j, server in enumerate(steps):
            if abs(i - j) <= 1:  # a rolling restart: neighbouring steps meet
                assert _run_handshake(client, server) == IDENTITY
    for client, server in [(steps[0], steps[3]), (steps[3], steps[0])]:
        with pytest.raises(AuthError):
            _run_handshake(client, server)


def test_a_rotation_accepts_no_secret_it_was_not_given() -> None:
    for client, server in [
        (b"other", PlaneSecret(b"new", [b"old"])),
        (PlaneSecret(b"new", [b"old"]), b"other"),
    ]:
        with pytest.raises(AuthError, match="does not know"):
            _run_handshake(client, server)
    # The worker's own check, of a client that answers without having checked it.
    for answer, accepted in [(b"old", True), (b"new", True), (b"other", False)]:
        worker = ServerHandshake(IDENTITY, secret=PlaneSecret(b"new", [b"old"]))
        hello = Hello(PROTOCOL_VERSION, "frontend", "fe", "", b"c" * 32)
        challenge = worker.receive(hello)
        assert isinstance(challenge, Challenge)
        assert challenge.proof == proof(b"new", "server", hello.nonce, challenge.nonce)
        auth = Auth(proof(answer, "client", hello.nonce, challenge.nonce))
        if accepted:
            assert worker.receive(auth) == IDENTITY
        else:
            with pytest.raises(AuthError, match="wrong plane secret"):
                worker.receive(auth)


def test_server_refuses_other_versions_and_frames_before_hello() -> None:
    server = ServerHandshake(IDENTITY, secret=None)
    with pytest.raises(ProtocolError, match="expected hello"):
        server.receive(Ping(1))
    hello = Hello(PROTOCOL_VERSION + 1, "frontend", "fe", "", b"n" * 32)
    with pytest.raises(ProtocolError) as info:
        ServerHandshake(IDENTITY, secret=None).receive(hello)
    assert info.value.code == "unsupported_version"


def test_client_surfaces_the_server_fault_code() -> None:
    client = ClientHandshake(role="frontend", peer_id="fe", model="", secret=None)
    client.start()
    with pytest.raises(ProtocolError) as info:
        client.receive(Fault("unsupported_version", "no"))
    assert info.value.code == "unsupported_version"


# ---- addresses and secrets ----------------------------------------------------------------


def test_addresses() -> None:
    assert parse_tcp_address("tcp://127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_tcp_address("tcp://[::1]:9") == ("::1", 9)
    assert parse_tcp_address(format_tcp_address("::1", 9)) == ("::1", 9)
    for bad in ("memory://x", "tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:99999"):
        with pytest.raises(ValueError):
            parse_tcp_address(bad)
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.1.2.3")
    assert not is_loopback("example.com")


def test_load_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HEADWATER_PLANE_SECRET", raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv("HEADWATER_PLANE_SECRET", " secret-from-env-1 \n")
    assert load_secret(None) == b"secret-from-env-1"
    path = tmp_path / "secret"
    path.write_bytes(b"secret-from-file-1\n")
    assert load_secret(str(path)) == b"secret-from-file-1"  # the file wins
    path.write_bytes(b"  \n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(str(path))
    # A rotation: the first line proves, every line is accepted.
    path.write_bytes(b"the-new-secret-one\n\n  the-old-secret-one \n")
    secret = load_secret(str(path))
    assert secret == b"the-new-secret-one"
    assert secret is not None
    assert secret.accepted == (b"the-new-secret-one", b"the-old-secret-one")
    monkeypatch.setenv("HEADWATER_PLANE_SECRET", "the-new-secret-one\nthe-old-secret-one")
    assert load_secret(None).accepted == (  # type: ignore[union-attr]
        b"the-new-secret-one",
        b"the-old-secret-one",
    )
