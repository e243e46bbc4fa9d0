"""The request plane's frames as bytes and back, without any I/O.

A frame is a 4-byte big-endian body length followed by a msgpack map whose ``"k"``
names the kind; on a connection whose handshake used a secret, a 16-byte tag follows
the map, inside the length (:mod:`headwater.wire.session`: the frame's HMAC under
the session's key for its direction and its place in the stream). :func:`encode` and
:class:`FrameDecoder` turn the frames of ``headwater.wire.frames`` into such bytes and
back; the trio shells
(``headwater.plane.connection``, ``headwater.plane.server``) only move the bytes.

Kinds and their frame types::

    hello      Hello        client → server, first frame: version, role, id, model, nonce
    challenge  Challenge    server → client, only with a secret: server nonce + proof
    auth       Auth         client → server: the client's proof
    hello_ok   HelloOk      server → client: handshake done, who the worker is
    request    GenerateRequest          ack / chunk / end: Ack, Chunk, End
    error      Error (has request_id) or Fault (connection-level, then close)
    cancel     Cancel       ping / pong: Ping, Pong (heartbeat, echo ``seq``)
    kv_pull    KvPull       kv_data: KvData (a transfer's payload, in pieces)
    kv_prompt  KvPrompt     prefill → decode worker, before the payload: the prompt's ids,
                            when the kv_pull asked (its request came without them)
    kv_release KvRelease    client → prefill worker: free a transfer never pulled (no answer)
    get_stats  GetStats     stats: Stats (the worker's counters, flat)
    kv_poll    KvPoll       kv_events: KvEvents (the worker's KV cache events, a batch)
    goaway     GoAway       server → client: no new requests on this connection

**One serializer.** This module is the only place that knows how any frame looks on
the wire: :func:`_body` builds each frame's map and ``_PARSERS`` check each map and
build the frame back, field by field, for the request messages and the control frames
alike; the frames themselves are plain dataclasses. The other way round (every frame
serializing itself, a generic codec) would not save the codec its work: a decoder must
still check each field of hostile input with the helpers below, and the fields that
travel packed (token ids, block hashes, KV params) must still be packed here, so each
field would be handled in two places, as it once was. The in-process transport passes
the objects themselves and never comes here.

The decoder trusts nothing: msgpack is unpacked with ``strict_map_key`` and size
limits, a body over 4 KiB counting its items (at most :data:`MAX_ITEMS`: a frame of
empty lists must not cost 70 bytes of memory per byte received), every field is
type-checked, and anything wrong raises :class:`ProtocolError` (nothing else), after
which the connection is unusable, with one exception: a ``request`` frame that arrived
whole, but whose body does not read, while its request id does, decodes as
:class:`~headwater.wire.frames.Unreadable`, and the receiver fails that request alone
(the frame's length kept the stream in step, and the connection carries other
requests). A field that cannot be encoded raises ValueError; a frame over the size
limit, :class:`FrameTooLarge`; :func:`encode_checked` also refuses, before anything is
sent, a frame the peer's decoder would not read.

What keeps it fast:

* Prompt token ids travel as packed little-endian uint32 bytes, which is what a token
  array (``headwater.wire.tokens``) holds: a 40k-token prompt packs and unpacks as one
  memcpy each (~10 µs), where a msgpack int list took 2.1 and 3.2 + 1.7 ms and needed a
  type check per element. Chunks carry one or a few tokens, so they keep plain int lists.
* A KV handle's block hashes (one per 64 prompt tokens) travel likewise as packed
  little-endian int64 bytes; ``struct`` packs and unpacks 625 of them in ~25 and ~15 µs
  (array: ~40, ~20). A handle without them, as an older peer sends, is still valid.
* A KV handle's ``params`` travel as their own msgpack bytes, so the decoder refuses an
  oversized one from its length alone, before unpacking any of it. A handle without
  params encodes exactly as before they existed.
* Logprobs (:class:`~headwater.wire.TokenLogprobs`, a chunk's and a prompt's) travel
  as packed columns (float64 logprobs, uint32 ranks, counts and ids): a 40k-token
  prompt's top-20 logprobs are 800k numbers, which as msgpack items would exceed
  :data:`MAX_ITEMS`, and as columns are five bin fields. The request's ``logprobs``
  and ``prompt_logprobs`` and the chunk's are left out when not set: such frames
  encode exactly as before they existed.
* Every map is built explicitly, never with ``dataclasses.asdict``, whose deep copy
  costs ~20 µs per request leg.
"""

from __future__ import annotations

import array
import math
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

import msgpack

from headwater.tracing.w3c import TraceParent, valid_tracestate
from headwater.wire.capabilities import Capabilities, from_plain, to_plain
from headwater.wire.errors import FrameTooLarge, ProtocolError
from headwater.wire.frames import (
    DEFAULT_MAX_FRAME,
    NONCE_BYTES,
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
from headwater.wire.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from headwater.wire.messages import (
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
    WorkerLoad,
)
from headwater.wire.session import TAG_BYTES, FrameMac
from headwater.wire.tokens import from_uint32_le, to_uint32_le, token_array

#: Largest encoded ``KvHandle.params`` (bytes). What engines put there (vLLM's
#: ``kv_transfer_params``, SGLang's bootstrap host, port and room) is a few hundred
#: bytes; the bound stops a buggy engine from making every decode request carry
#: megabytes.
MAX_KV_PARAMS_BYTES = 64 * 1024
#: Deepest nesting in ``KvHandle.params``, the mapping itself being level 1.
MAX_KV_PARAMS_DEPTH = 8

_HEADER = struct.Struct(">I")
_MAX_MAP_LEN = 256  # the widest frame (stats) has a few dozen keys
#: Most items one frame body may unpack to: containers plus their elements (a map's
#: keys and values), the largest being a chunk's token list. A frame's weight is in
#: its bin and str fields (packed token ids, KV pieces, packed params), which cost a
#: copy; an item costs an object, ~70 bytes for an empty list that took 1 on the wire.
MAX_ITEMS = 1 << 17
#: Bodies up to this size are unpacked without counting: they cannot hold more items
#: than bytes. Counting costs a Python call per container, so small frames (chunks,
#: acks, pings: the hot path) skip it.
_COUNT_ABOVE = 4096

#: A decoded msgpack map. ``strict_map_key`` also lets bytes keys through, but every
#: lookup here is by str, so a bytes key is never read.
_Map = dict[str, object]

# ---- packed fields ------------------------------------------------------------------


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """Token ids → little-endian uint32 bytes. Raises ValueError outside [0, 2**32)."""
    return to_uint32_le(ids)


def unpack_token_ids(data: bytes) -> array.array[int]:
    """The inverse of :func:`pack_token_ids`, as a token array (no int objects made);
    raises ProtocolError on a ragged length."""
    try:
        return from_uint32_le(data)
    except ValueError as exc:
        raise ProtocolError(f"token_ids: {exc}") from exc


def pack_block_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes → little-endian int64 bytes. Raises ValueError outside int64."""
    try:
        return struct.pack(f"<{len(hashes)}q", *hashes)
    except struct.error as exc:
        raise ValueError(f"block hashes must be ints in int64 range: {exc}") from exc


def unpack_block_hashes(data: bytes) -> tuple[int, ...]:
    """The inverse of :func:`pack_block_hashes`; raises ProtocolError on a ragged length."""
    if len(data) % 8:
        raise ProtocolError(f"block_hashes: {len(data)} bytes is not a whole number of int64")
    return struct.unpack(f"<{len(data) // 8}q", data)


def pack_logprobs(entries: Sequence[TokenLogprobs]) -> _Map:
    """Logprob entries → a map of packed columns: ``lp`` (float64 each), ``rk`` (uint32
    each), ``tn`` (uint32 each: how many top tokens), then every entry's top tokens
    end to end, ``ti`` (uint32) and ``tl`` (float64). Raises ValueError for a rank or
    id outside uint32, or top ids and logprobs of different lengths."""
    n = len(entries)
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    for e in entries:
        if len(e.top_ids) != len(e.top_logprobs):
            raise ValueError("logprobs: top_ids and top_logprobs differ in length")
        top_ids.extend(e.top_ids)
        top_logprobs.extend(e.top_logprobs)
    try:
        return {
            "lp": struct.pack(f"<{n}d", *(e.logprob for e in entries)),
            "rk": to_uint32_le([e.rank for e in entries]),
            "tn": to_uint32_le([len(e.top_ids) for e in entries]),
            "ti": to_uint32_le(top_ids),
            "tl": struct.pack(f"<{len(top_logprobs)}d", *top_logprobs),
        }
    except struct.error as exc:
        raise ValueError(f"logprobs: {exc}") from exc


def unpack_logprobs(d: object, what: str) -> tuple[TokenLogprobs, ...]:
    """The inverse of :func:`pack_logprobs`; raises ProtocolError for anything that is
    not such a map of consistent columns (*what* names the field in errors)."""
    if type(d) is not dict:
        raise ProtocolError(f"{what}: not a map")
    columns = []
    for key in ("lp", "rk", "tn", "ti", "tl"):
        value = d.get(key)
        if type(value) is not bytes:
            raise ProtocolError(f"{what}: column {key!r} missing or not bytes")
        columns.append(value)
    lp, rk, tn, ti, tl = columns
    n, top = len(lp) // 8, len(tl) // 8
    if len(lp) % 8 or len(tl) % 8 or len(rk) != 4 * n or len(tn) != 4 * n or len(ti) != 4 * top:
        raise ProtocolError(f"{what}: columns of inconsistent lengths")
    counts = from_uint32_le(tn)
    if sum(counts) != top:
        raise ProtocolError(f"{what}: top counts do not add up to the top tokens sent")
    logprobs = struct.unpack(f"<{n}d", lp)
    ranks = from_uint32_le(rk)
    ids = tuple(from_uint32_le(ti))
    top_logprobs = struct.unpack(f"<{top}d", tl)
    entries = []
    at = 0
    for i in range(n):
        end = at + counts[i]
        entries.append(TokenLogprobs(logprobs[i], ranks[i], ids[at:end], top_logprobs[at:end]))
        at = end
    return tuple(entries)


def pack_kv_params(params: Mapping[str, Any]) -> bytes:
    """A KV handle's params → msgpack bytes.

    Raises ValueError for a key that is not a str, a value that is not JSON-like (None,
    bool, int, float, str, bytes, lists and str-keyed dicts of those: a tuple would come
    back a list), nesting deeper than :data:`MAX_KV_PARAMS_DEPTH`, or more than
    :data:`MAX_KV_PARAMS_BYTES` once packed.
    """
    plain = params if type(params) is dict else dict(params)
    try:
        _check_json_like(plain, 1)
        data: bytes = msgpack.packb(plain, use_bin_type=True)
    except (OverflowError, ValueError) as exc:  # msgpack: OverflowError for an int > 64 bits
        raise ValueError(f"kv_handle params: {exc}") from exc
    if len(data) > MAX_KV_PARAMS_BYTES:
        raise ValueError(
            f"kv_handle params: {len(data)} bytes exceeds the {MAX_KV_PARAMS_BYTES}-byte limit"
        )
    return data


def unpack_kv_params(data: bytes) -> dict[str, Any]:
    """The inverse of :func:`pack_kv_params`; raises ProtocolError for whatever that
    refuses to pack."""
    if len(data) > MAX_KV_PARAMS_BYTES:
        raise ProtocolError(
            f"kv_handle params: {len(data)} bytes exceeds the {MAX_KV_PARAMS_BYTES}-byte limit"
        )
    try:
        params = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
        if type(params) is not dict:
            raise ValueError(f"a {type(params).__name__}, not a map")
        _check_json_like(params, 1)
    except (ValueError, TypeError) as exc:  # every msgpack unpack error is a ValueError
        raise ProtocolError(f"kv_handle params: {exc}") from exc
    return params


_JSON_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})


def _check_json_like(container: dict[Any, Any] | list[Any], depth: int) -> None:
    """Raise ValueError unless *container* holds only JSON-like values, str-keyed.

    Exact types, as everywhere in this codec: a subclass (an enum, an OrderedDict)
    would not come back as itself. Recursion stops at the depth limit.
    """
    if depth > MAX_KV_PARAMS_DEPTH:
        raise ValueError(f"nested deeper than {MAX_KV_PARAMS_DEPTH} levels")
    if type(container) is dict:
        for key in container:
            if type(key) is not str:
                raise ValueError(f"key {key!r} is not a str")
        values: Iterable[object] = container.values()
    else:
        values = container
    for value in values:
        if type(value) is dict or type(value) is list:
            _check_json_like(value, depth + 1)
        elif type(value) not in _JSON_SCALARS:
            raise ValueError(f"unsupported type {type(value).__name__}")


# ---- encoding -----------------------------------------------------------------------


def encode(frame: Frame, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None) -> bytes:
    """*frame* as length-prefixed bytes, tagged with *mac* (a session's sending side).

    Raises :class:`FrameTooLarge` if the body (and tag) exceed *max_frame* (the peer
    would refuse it and drop the whole connection), ValueError on unencodable fields;
    either way nothing was signed, so the session's count is unchanged.
    """
    return _framed(_pack(frame), max_frame, mac)


def encode_checked(
    frame: Frame, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None
) -> bytes:
    """:func:`encode`, once the peer's decoder has read the body back as this end would:
    the frame is sent only if the peer can read it, with the same bounds (the frame size,
    :data:`MAX_ITEMS`, every field's type and range), checked by the same code.

    For the frames a client builds from what its own clients asked (a request: its stop
    token ids, its sampling parameters), so that no request can make the worker refuse a
    frame, which would close the connection and every request on it. Raises
    :class:`ProtocolError` (what the peer would have said: :class:`FrameTooLarge`, a
    field's fault) or ValueError, with nothing signed. Costs a decode (~10 µs for a
    short request, ~20 µs for a 40k-token one: its ids are one packed copy).
    """
    body = _pack(frame)
    if len(body) > max_frame:
        raise FrameTooLarge(len(body), max_frame)
    decode_body(body, max_frame, lenient=False)
    return _framed(body, max_frame, mac)


def _pack(frame: Frame) -> bytes:
    try:
        body: bytes = msgpack.packb(_body(frame), use_bin_type=True)
    except OverflowError as exc:  # msgpack: an int beyond 64 bits
        raise ValueError(f"cannot encode {type(frame).__name__}: {exc}") from exc
    return body


def _framed(body: bytes, max_frame: int, mac: FrameMac | None) -> bytes:
    size = len(body) + (TAG_BYTES if mac is not None else 0)
    if size > max_frame:
        raise FrameTooLarge(size, max_frame)
    if mac is None:
        return _HEADER.pack(size) + body
    return _HEADER.pack(size) + body + mac.sign(body)


#: A ``kv_data`` piece at least this large is encoded around its payload, not through it.
_SPLICE_ABOVE: Final = 64 * 1024


def encode_parts(
    frame: Frame, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None
) -> list[bytes | memoryview]:
    """*frame* as :func:`encode` has it, in pieces whose concatenation is exactly
    ``encode(frame)``: for a large ``kv_data`` piece, the bytes before its payload, the
    payload's own buffer and the bytes after it; for a large ``kv_prompt``, the bytes
    before its ids and the token array's own buffer (little-endian hosts); one piece for
    any other frame.

    Why: a prompt's simulated KV leaves a prefill worker as ~640 KB pieces (40k tokens at
    16 bytes each), and ``packb`` copied each into its output, then the length prefix's
    concatenation copied it again; sent as its own buffer it is copied only by the
    kernel. The prompt's ids (~160 KB) likewise. Raises what :func:`encode` raises.
    """
    if isinstance(frame, KvPrompt):
        return _prompt_parts(frame, max_frame, mac)
    if not isinstance(frame, KvData) or len(frame.data) < _SPLICE_ABOVE:
        return [encode(frame, max_frame, mac)]
    size = len(frame.data)
    # The map _body builds, field by field in its order, with the bin's header written
    # as msgpack writes it: from 64 KiB on, a bin 32.
    head = b"".join(
        (
            b"\x84",  # fixmap, 4 entries
            msgpack.packb("k"),
            msgpack.packb("kv_data"),
            msgpack.packb("transfer_id"),
            msgpack.packb(frame.transfer_id),
            msgpack.packb("data"),
            b"\xc6",
            _HEADER.pack(size),
        )
    )
    tail = msgpack.packb("last") + msgpack.packb(frame.last)
    payload = memoryview(frame.data).cast("B")
    body_size = len(head) + size + len(tail) + (TAG_BYTES if mac is not None else 0)
    if body_size > max_frame:
        raise FrameTooLarge(body_size, max_frame)
    if mac is not None:
        tail += mac.sign(head, payload, tail)
    return [_HEADER.pack(body_size) + head, payload, tail]


def _prompt_parts(
    frame: KvPrompt, max_frame: int, mac: FrameMac | None
) -> list[bytes | memoryview]:
    ids = frame.token_ids
    size = 4 * len(ids)
    if (
        size < _SPLICE_ABOVE
        or sys.byteorder != "little"
        or not isinstance(ids, array.array)
        or ids.itemsize != 4
    ):
        return [encode(frame, max_frame, mac)]
    # _body's map in its order; the ids' bin 32 last, so the array's buffer ends the body.
    head = b"".join(
        (
            b"\x83",  # fixmap, 3 entries
            msgpack.packb("k"),
            msgpack.packb("kv_prompt"),
            msgpack.packb("transfer_id"),
            msgpack.packb(frame.transfer_id),
            msgpack.packb("token_ids"),
            b"\xc6",
            _HEADER.pack(size),
        )
    )
    payload = memoryview(ids).cast("B")
    body_size = len(head) + size + (TAG_BYTES if mac is not None else 0)
    if body_size > max_frame:
        raise FrameTooLarge(body_size, max_frame)
    parts: list[bytes | memoryview] = [_HEADER.pack(body_size) + head, payload]
    if mac is not None:
        parts.append(mac.sign(head, payload))
    return parts


def _body(frame: Frame) -> _Map:
    # The request messages put "k" last and the control frames first: the order their
    # bytes have always had, so an unchanged frame stays byte-identical on the wire.
    match frame:
        case GenerateRequest():
            body: _Map = {"request_id": frame.request_id, "model": frame.model}
            if not frame.prompt_in_kv:  # else the decode worker pulls the ids with the KV
                body["token_ids"] = pack_token_ids(frame.token_ids)
            body |= {
                "sampling": _sampling_body(frame.sampling),
                "kv_handle": _handle_body(frame.kv_handle),
                "eos_token_ids": list(frame.eos_token_ids),
            }
            if frame.traceparent:  # only when traced: an untraced frame is unchanged
                body["traceparent"] = frame.traceparent
                if frame.tracestate:
                    body["tracestate"] = frame.tracestate
            body["k"] = "request"
            return body
        case Chunk():
            chunk: _Map = {
                "request_id": frame.request_id,
                "token_ids": frame.token_ids,
                "finish_reason": frame.finish_reason.value if frame.finish_reason else None,
                "kv_handle": _handle_body(frame.kv_handle),
                "cached_tokens": frame.cached_tokens,
            }
            if frame.logprobs is not None:
                chunk["logprobs"] = pack_logprobs(frame.logprobs)
            if frame.prompt_logprobs is not None:
                chunk["prompt_logprobs"] = pack_logprobs(frame.prompt_logprobs)
            chunk["k"] = "chunk"
            return chunk
        case Ack():
            return {"request_id": frame.request_id, "k": "ack"}
        case End():
            return {"request_id": frame.request_id, "k": "end"}
        case Error():
            return {
                "request_id": frame.request_id,
                "code": frame.code.value,
                "message": frame.message,
                "k": "error",
            }
        case Cancel():
            return {"request_id": frame.request_id, "k": "cancel"}
        case Fault():
            return {"k": "error", "code": frame.code, "message": frame.message}
        case Hello():
            return {
                "k": "hello",
                "version": frame.version,
                "role": frame.role,
                "peer_id": frame.peer_id,
                "model": frame.model,
                "nonce": frame.nonce,
            }
        case Challenge():
            return {"k": "challenge", "nonce": frame.nonce, "proof": frame.proof}
        case Auth():
            return {"k": "auth", "proof": frame.proof}
        case HelloOk():
            body = {
                "k": "hello_ok",
                "version": frame.version,
                "role": frame.role,
                "worker_id": frame.worker_id,
                "model": frame.model,
            }
            if frame.capabilities is not None:  # left out by an older worker
                body["caps"] = to_plain(frame.capabilities)
            return body
        case Ping():
            return {"k": "ping", "seq": frame.seq}
        case Pong():
            if frame.load is None:
                return {"k": "pong", "seq": frame.seq}
            load = frame.load
            return {
                "k": "pong",
                "seq": frame.seq,
                "load": [load.active, load.waiting, load.kv_usage],
            }
        case GetStats():
            return {"k": "get_stats", "seq": frame.seq}
        case Stats():
            return {"k": "stats", "seq": frame.seq, "values": frame.values}
        case KvPull():
            if frame.prompt:  # only when asked: what an older peer sends and expects
                return {"k": "kv_pull", "transfer_id": frame.transfer_id, "prompt": True}
            return {"k": "kv_pull", "transfer_id": frame.transfer_id}
        case KvPrompt():
            return {
                "k": "kv_prompt",
                "transfer_id": frame.transfer_id,
                "token_ids": pack_token_ids(frame.token_ids),
            }
        case KvRelease():
            return {"k": "kv_release", "transfer_id": frame.transfer_id}
        case KvData():
            return {
                "k": "kv_data",
                "transfer_id": frame.transfer_id,
                "data": frame.data,
                "last": frame.last,
            }
        case KvPoll():
            return {"k": "kv_poll", "seq": frame.seq, "since": frame.since, "limit": frame.limit}
        case KvEvents():
            b = frame.batch
            return {
                "k": "kv_events",
                "seq": frame.seq,
                "start": b.start,
                "end": b.end,
                "dump": b.dump,
                "gap": b.gap,
                "events": [_event_body(e) for e in b.events],
            }
        case GoAway():
            return {"k": "goaway", "reason": frame.reason}
    raise TypeError(f"not a frame: {type(frame).__name__}")


def _sampling_body(sampling: SamplingParams) -> _Map:
    body: _Map = {
        "max_tokens": sampling.max_tokens,
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
    }
    # Left out when not asked: what an older peer sends and expects.
    if sampling.logprobs is not None:
        body["logprobs"] = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        body["prompt_logprobs"] = sampling.prompt_logprobs
    # The declared features' fields travel only when they ask for something: a request
    # without them is byte-identical to what an older peer sends, and such a peer,
    # which would ignore them, never gets them (the frontend routes by declarations).
    s = sampling
    if s.top_k:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        body["logit_bias"] = [[token, bias] for token, bias in s.logit_bias]
    if s.structured is not None:
        body["structured"] = [s.structured.kind.value, s.structured.spec]
    return body


def _handle_body(handle: KvHandle | None) -> _Map | None:
    if handle is None:
        return None
    body: _Map = {
        "worker_id": handle.worker_id,
        "address": handle.address,
        "transfer_id": handle.transfer_id,
        "num_tokens": handle.num_tokens,
    }
    # Optional fields are left out when empty: what an older peer sends and expects.
    if handle.block_hashes:
        body["block_hashes"] = pack_block_hashes(handle.block_hashes)
        body["block_size"] = handle.block_size
    if handle.params:
        body["params"] = pack_kv_params(handle.params)
    if handle.holds_prompt:
        body["prompt"] = True
    return body


# ---- decoding -----------------------------------------------------------------------


class FrameDecoder:
    """Incremental frame decoder: feed it whatever the socket returned.

    Frames may be split across feeds at any byte. After a :class:`ProtocolError`
    the decoder stays failed (every later feed raises again): resynchronising a
    length-prefixed stream is not possible.

    With *mac* (a session's receiving side, set when the handshake completes) every
    frame's tag is checked before its body is unpacked: a frame that fails it raises
    :class:`~headwater.wire.errors.AuthError` and nothing of it is read.

    A large ``kv_data`` piece laid out as :func:`encode_parts` sends it (every peer of
    this version) does not pass through the frame buffer: once its head is read, its
    payload goes from the bytes fed straight into a payload buffer the decoder keeps
    from piece to piece, and the frame is yielded with ``data`` a read-only view of that
    buffer. Why: a prompt's simulated KV (~640 KB) was copied from the socket's bytes
    into the frame buffer, then again into a fresh bytes object by msgpack, for a
    receiver that needs it once. The buffer is reused only when no frame still holds a
    view of it: a consumer may keep ``data``. Any other layout is decoded whole, as
    before.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None) -> None:
        self.max_frame = max_frame
        self.mac = mac
        self._buffer = bytearray()
        self._failure: ProtocolError | None = None
        self._wanted = 0
        self._payload = bytearray()
        self._piece: _Piece | None = None  # the kv_data piece whose payload is arriving

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer) + (self._piece.received if self._piece is not None else 0)

    @property
    def wanted(self) -> int:
        """Bytes still missing from the frame begun in the buffer, as its length prefix
        tells (0 when none is begun, or its prefix is not complete): what a reader may
        ask of its socket at once (:func:`read_size`)."""
        return self._wanted

    def feed(self, data: bytes | bytearray | memoryview, limit: int = 0) -> list[Frame]:
        """Add *data*; return the frames it completed, in order: at most *limit* of them
        when it is set, leaving the rest buffered for the next call (``feed(b"")``).

        A handshake reads one frame at a time, so that the frames after it are read
        only once the session's :attr:`mac` is set.

        Raises ProtocolError (frames completed earlier in the same call are lost,
        as the connection is closed anyway).
        """
        if self._failure is not None:
            raise self._failure
        try:
            if self._piece is not None and data:
                data = self._fill(data)
            buf = self._buffer
            buf += data
            return self._frames(buf, limit)
        except ProtocolError as exc:
            self._failure = exc
            self._buffer.clear()
            self._piece = None
            raise

    def _fill(self, data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        """Copy what *data* holds of the arriving payload into the payload buffer;
        return the rest of *data*."""
        piece = self._piece
        assert piece is not None
        n = min(len(data), piece.size - piece.received)
        if n:
            self._reserve(piece.received + n)
            with memoryview(data) as src, memoryview(self._payload) as dst:
                chunk = src[:n]
                dst[piece.received : piece.received + n] = chunk
                if piece.hash is not None:
                    piece.hash.update(chunk)
                chunk.release()
            piece.received += n
        return data[n:] if n < len(data) else b""

    def _frames(self, buf: bytearray, limit: int) -> list[Frame]:
        frames: list[Frame] = []
        pos = 0
        self._wanted = 0
        mac = self.mac
        tag = TAG_BYTES if mac is not None else 0
        while not limit or len(frames) < limit:
            piece = self._piece
            if piece is not None:
                if piece.received < piece.size:  # the buffer held no more of it
                    self._wanted = piece.size - piece.received + piece.rest
                    break
                if len(buf) - pos < piece.rest:
                    self._wanted = piece.rest - (len(buf) - pos)
                    break
                frames.append(self._finish(buf, pos, piece))
                pos += piece.rest
                continue
            if len(buf) - pos < 4:
                break
            (size,) = _HEADER.unpack_from(buf, pos)
            if size > self.max_frame:
                raise FrameTooLarge(size, self.max_frame)
            if size <= tag:
                raise ProtocolError("empty frame")
            end = pos + 4 + size
            if size >= _SPLICE_ABOVE:
                piece = _piece_head(buf, pos + 4, min(end, len(buf)), size, tag)
                if piece is not None:
                    pos = self._begin(buf, pos + 4, piece)
                    continue
            if len(buf) < end:
                self._wanted = end - len(buf)
                break
            # Both views are released on exit, even when a traceback holds them,
            # so the buffer can be resized afterwards. unpackb copies what it keeps.
            with memoryview(buf) as view, view[pos + 4 : end - tag] as body:
                if mac is not None:
                    mac.verify(body, buf[end - tag : end])  # a copy: no export
                frames.append(decode_body(body, self.max_frame))
            pos = end
        del buf[:pos]
        return frames

    def _begin(self, buf: bytearray, at: int, piece: _Piece) -> int:
        """Start receiving *piece*, whose head begins at *at* in *buf*: hash its head,
        take what the buffer holds of its payload; return where the buffer's unread
        bytes begin."""
        if self.mac is not None:
            piece.hash = self.mac.begin()
            with memoryview(buf) as view:
                piece.hash.update(view[at : at + piece.head])
        if not _unshared(self._payload):
            self._payload = bytearray()  # a frame still holds the last one: never overwrite
        self._piece = piece
        start = at + piece.head
        with memoryview(buf) as view:
            rest = self._fill(view[start : min(len(buf), start + piece.size)])
            assert not rest
        return start + piece.received

    def _reserve(self, size: int) -> None:
        """Make the payload buffer at least *size* bytes. It grows as the payload
        arrives, never ahead of it: a length a peer announced is not trusted for an
        allocation."""
        payload = self._payload
        if len(payload) < size:
            payload += bytes(size - len(payload))

    def _finish(self, buf: bytearray, pos: int, piece: _Piece) -> KvData:
        """The piece whose payload has all arrived, read from its tail at *pos*."""
        tail = bytes(buf[pos : pos + piece.rest])
        body_tail = tail[: len(tail) - (TAG_BYTES if self.mac is not None else 0)]
        if body_tail not in (_TAIL_LAST, _TAIL_MORE):
            raise ProtocolError("kv_data: malformed frame after its payload")
        if self.mac is not None:
            assert piece.hash is not None
            piece.hash.update(body_tail)
            self.mac.finish(piece.hash, tail[len(body_tail) :])
        self._piece = None
        data = memoryview(self._payload)[: piece.size].toreadonly()
        return KvData(piece.transfer_id, data, body_tail == _TAIL_LAST)


@dataclass(slots=True)
class _Piece:
    """A large ``kv_data`` frame being received: its head is read, its payload is
    arriving into the decoder's payload buffer."""

    transfer_id: str
    head: int  # bytes of the body before the payload
    size: int  # payload bytes
    rest: int  # bytes of the frame after the payload: its tail and tag
    received: int = 0
    hash: Any = None  # the session's running hash of the body, with a secret


#: What follows a ``kv_data`` payload in :func:`encode_parts`' layout: ``"last"``, a bool.
_TAIL_LAST: Final = msgpack.packb("last") + msgpack.packb(True)
_TAIL_MORE: Final = msgpack.packb("last") + msgpack.packb(False)
#: The start of its head: a map of 4, ``"k": "kv_data"``, then ``"transfer_id"``.
_PIECE_START: Final = (
    b"\x84" + msgpack.packb("k") + msgpack.packb("kv_data") + msgpack.packb("transfer_id")
)
_DATA_KEY: Final = msgpack.packb("data")
_MAX_PIECE_ID: Final = 255  # a transfer id longer than str 8 holds is decoded whole


def _piece_head(buf: bytearray, at: int, end: int, size: int, tag: int) -> _Piece | None:
    """The head of a ``kv_data`` frame body laid out as :func:`encode_parts` lays it
    (begun at *at* in *buf*, buffered to *end*; *size* bytes with its *tag*), or
    None: another kind, another layout, or not enough of it buffered yet to tell (the
    frame is then decoded whole, which is always correct)."""
    n = len(_PIECE_START)
    if end - at < n + 2 or buf[at : at + n] != _PIECE_START:
        return None
    i = at + n
    marker = buf[i]
    if 0xA1 <= marker <= 0xBF:  # fixstr
        length, i = marker - 0xA0, i + 1
    elif marker == 0xD9:  # str 8
        length, i = buf[i + 1], i + 2
    else:
        return None
    if not 0 < length <= _MAX_PIECE_ID or end - i < length + len(_DATA_KEY) + 5:
        return None
    try:
        transfer_id = bytes(buf[i : i + length]).decode()
    except UnicodeDecodeError:
        return None  # decoded whole, which refuses it
    i += length
    if buf[i : i + len(_DATA_KEY)] != _DATA_KEY or buf[i + len(_DATA_KEY)] != 0xC6:
        return None
    i += len(_DATA_KEY) + 1
    (payload,) = _HEADER.unpack_from(buf, i)
    head = i + 4 - at
    rest = len(_TAIL_LAST) + tag
    if head + payload + rest != size:
        return None
    return _Piece(transfer_id, head, payload, rest)


def _unshared(buffer: bytearray) -> bool:
    """Whether no view of *buffer* is alive: every view holds a reference to it, and
    three are ours (the decoder's attribute, this argument, getrefcount's own)."""
    return sys.getrefcount(buffer) <= 3


#: The most :func:`read_size` asks for in one read.
MAX_READ = 1024 * 1024


def read_size(decoder: FrameDecoder, receive_size: int) -> int:
    """Bytes to ask of the socket in the next read: *receive_size*, or the rest of a
    larger frame already begun (up to :data:`MAX_READ`).

    Why: a 640 KB ``kv_data`` piece (a 40k-token prompt's simulated KV) or a 160 KB
    40k-token request read 64 KiB at a time took 10 or 3 reads, each a trip through
    the event loop and a feed; asked for in one, it mostly arrives in one or two. Small
    frames keep small reads (a read allocates what it asks for before it shrinks to
    what came)."""
    return max(receive_size, min(decoder.wanted, MAX_READ))


class _ItemBudget:
    """Hooks for ``msgpack.unpackb`` that count the items of each container as it is
    built and stop the unpacking beyond :data:`MAX_ITEMS`: a 64 MiB body of empty
    lists would otherwise take ~4 GB and tens of seconds of the event loop to build,
    before any field check could refuse it. (One array is bounded by ``max_array_len``
    before its hook runs.)"""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def list_hook(self, items: list[object]) -> list[object]:
        self.left -= len(items) + 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_ITEMS} items in one frame")
        return items

    def object_hook(self, items: _Map) -> _Map:
        self.left -= 2 * len(items) + 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_ITEMS} items in one frame")
        return items


def decode_body(
    body: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME, *, lenient: bool = True
) -> Frame:
    """One frame body (without its length prefix) → a frame. Raises ProtocolError.

    A ``request`` body that does not read (a field's type or range, too many items,
    bytes that do not unpack) but whose request id does is, with *lenient*, an
    :class:`~headwater.wire.frames.Unreadable` for that id instead: the whole frame
    arrived, so the stream is still in step, and the receiver fails that request alone.
    """
    try:
        return _decode_body(body, max_frame)
    except ProtocolError as exc:
        request_id = _unreadable_request_id(body) if lenient else None
        if request_id is None:
            raise
        return Unreadable(request_id, exc.message)


#: Longest request id read from a request body that does not read otherwise.
_MAX_ID_CHARS = 1024


def _unreadable_request_id(body: bytes | memoryview) -> str | None:
    """The ``request_id`` of a body whose ``k`` is ``request``, read entry by entry with
    every other value skipped (never built), or None. Only for a body that failed to
    decode, so its cost (a copy of the body, a walk over its top-level map) is paid on
    that path alone."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=max(len(body), 1),
        max_ext_len=0,
        max_map_len=_MAX_MAP_LEN,
    )
    try:
        unpacker.feed(body)
        found: dict[str, object] = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("k", "request_id") and key not in found:
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # anything msgpack raises on bytes it cannot walk
        return None
    rid = found.get("request_id")
    if found.get("k") != "request" or type(rid) is not str or not 0 < len(rid) <= _MAX_ID_CHARS:
        return None
    return rid


def _decode_body(body: bytes | memoryview, max_frame: int) -> Frame:
    budget = _ItemBudget() if len(body) > _COUNT_ABOVE else None
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=0,
            max_bin_len=max_frame,
            max_str_len=max_frame,
            max_array_len=MAX_ITEMS,
            list_hook=budget and budget.list_hook,
            object_hook=budget and budget.object_hook,
        )
    except (ValueError, TypeError) as exc:  # every msgpack unpack error is a ValueError
        raise ProtocolError(f"undecodable frame body: {exc!r}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame body is a {type(obj).__name__}, not a map")
    kind = obj.get("k")
    parse = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise ProtocolError(f"unknown frame kind {kind!r}")
    try:
        return parse(obj)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # a constructor refusing a checked value
        raise ProtocolError(f"bad {kind} frame: {exc!r}") from exc


_T = TypeVar("_T")
_D = TypeVar("_D")
_MISSING: Final = object()
_FINISH_REASONS: Final = {r.value: r for r in FinishReason}
_ERROR_CODES: Final = {c.value: c for c in ErrorCode}


@overload
def _field(d: _Map, key: str, kind: type[_T]) -> _T: ...
@overload
def _field(d: _Map, key: str, kind: type[_T], default: _D) -> _T | _D: ...
def _field(d: _Map, key: str, kind: type[object], default: object = _MISSING) -> object:
    """``d[key]`` if its exact type is *kind* (bool is not an int; int passes as float).

    A missing key gives *default*, or a ProtocolError without one; a None value passes
    only when *default* is None.
    """
    value = d.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ProtocolError(f"{d.get('k')}: missing field {key!r}")
        return default
    if type(value) is kind or (kind is float and type(value) is int):
        return value
    if value is None and default is None:
        return None
    raise ProtocolError(f"{d.get('k')}: field {key!r} has type {type(value).__name__}")


def _nonneg(d: _Map, key: str, default: int | None = None) -> int:
    """A non-negative int; required unless *default* is given."""
    value = _field(d, key, int) if default is None else _field(d, key, int, default)
    if value < 0:
        raise ProtocolError(f"{d.get('k')}: field {key!r} is negative")
    return value


def _optional_nonneg(d: _Map, key: str) -> int | None:
    """A non-negative int, or None when absent (or null)."""
    value = _field(d, key, int, None)
    if value is not None and value < 0:
        raise ProtocolError(f"{d.get('k')}: field {key!r} is negative")
    return value


def _int_list(d: _Map, key: str) -> list[int]:
    values: list[object] = _field(d, key, list, [])
    ints = [v for v in values if type(v) is int and v >= 0]
    if len(ints) != len(values):
        raise ProtocolError(f"{d.get('k')}: field {key!r} must hold non-negative ints")
    return ints


def _request_id(d: _Map, key: str = "request_id") -> str:
    value = _field(d, key, str)
    if not value:
        raise ProtocolError(f"{d.get('k')}: empty {key}")
    return value


def _nonce(d: _Map) -> bytes:
    nonce = _field(d, "nonce", bytes)
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"{d.get('k')}: nonce must be {NONCE_BYTES} bytes")
    return nonce


def _kv_handle(d: _Map) -> KvHandle | None:
    handle: _Map | None = _field(d, "kv_handle", dict, None)
    if handle is None:
        return None
    worker_id = _field(handle, "worker_id", str)
    address = _field(handle, "address", str)
    transfer_id = _field(handle, "transfer_id", str)
    num_tokens = _nonneg(handle, "num_tokens")
    hashes = unpack_block_hashes(_field(handle, "block_hashes", bytes, b""))
    block_size = 0
    if hashes:
        block_size = _nonneg(handle, "block_size")
        if block_size < 1 or len(hashes) > num_tokens // block_size:
            raise ProtocolError(
                f"{d.get('k')}: kv_handle has {len(hashes)} block hashes for "
                f"{num_tokens} tokens in blocks of {block_size}"
            )
    packed_params = _field(handle, "params", bytes, None)
    params = {} if packed_params is None else unpack_kv_params(packed_params)
    holds_prompt = _field(handle, "prompt", bool, False)
    return KvHandle(
        worker_id, address, transfer_id, num_tokens, hashes, block_size, params, holds_prompt
    )


def _parse_request(d: _Map) -> GenerateRequest:
    sampling: _Map = _field(d, "sampling", dict)
    checked = SamplingParams(
        max_tokens=_nonneg(sampling, "max_tokens"),
        min_tokens=_nonneg(sampling, "min_tokens", 0),
        ignore_eos=_field(sampling, "ignore_eos", bool, False),
        temperature=float(_field(sampling, "temperature", float, 1.0)),
        top_p=float(_field(sampling, "top_p", float, 1.0)),
        seed=_field(sampling, "seed", int, None),
        stop_token_ids=tuple(_int_list(sampling, "stop_token_ids")),
        logprobs=_optional_nonneg(sampling, "logprobs"),
        prompt_logprobs=_optional_nonneg(sampling, "prompt_logprobs"),
        top_k=_nonneg(sampling, "top_k", 0),
        min_p=_finite(sampling, "min_p", 0.0),
        presence_penalty=_finite(sampling, "presence_penalty", 0.0),
        frequency_penalty=_finite(sampling, "frequency_penalty", 0.0),
        repetition_penalty=_finite(sampling, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(sampling),
        structured=_structured(sampling),
    )
    handle = _kv_handle(d)
    packed = _field(d, "token_ids", bytes, None)
    if packed is None and (handle is None or not handle.holds_prompt):
        raise ProtocolError("request: missing field 'token_ids'")
    return GenerateRequest(
        request_id=_request_id(d),
        model=_field(d, "model", str),
        # Left out of a decode leg whose prompt comes with its KV pull.
        token_ids=token_array() if packed is None else unpack_token_ids(packed),
        sampling=checked,
        kv_handle=handle,
        eos_token_ids=tuple(_int_list(d, "eos_token_ids")),
        **_trace_fields(d),
    )


def _finite(d: _Map, key: str, default: float) -> float:
    """A finite float (an int passes); *default* when absent."""
    value = float(_field(d, key, float, default))
    if not math.isfinite(value):
        raise ProtocolError(f"{d.get('k')}: field {key!r} is not finite")
    return value


def _logit_bias(d: _Map) -> tuple[tuple[int, float], ...]:
    """Sampling's optional ``logit_bias``: [[token id, finite bias], ...]."""
    pairs: list[object] = _field(d, "logit_bias", list, [])
    bias: list[tuple[int, float]] = []
    for pair in pairs:
        if (
            type(pair) is not list
            or len(pair) != 2
            or type(pair[0]) is not int
            or pair[0] < 0
            or type(pair[1]) not in (int, float)
            or not math.isfinite(pair[1])
        ):
            raise ProtocolError("request: logit_bias must hold [token id, finite bias] pairs")
        bias.append((pair[0], float(pair[1])))
    return tuple(bias)


_STRUCTURED_KINDS: Final = {k.value: k for k in StructuredKind}


def _structured(d: _Map) -> StructuredOutput | None:
    """Sampling's optional ``structured``: [kind, spec]."""
    raw: list[object] | None = _field(d, "structured", list, None)
    if raw is None:
        return None
    if len(raw) != 2 or type(raw[0]) is not str or type(raw[1]) is not str:
        raise ProtocolError("request: structured must be [kind, spec]")
    kind = _STRUCTURED_KINDS.get(raw[0])
    if kind is None:
        raise ProtocolError(f"request: unknown structured output kind {raw[0]!r}")
    return StructuredOutput(kind, raw[1])


def _trace_fields(d: _Map) -> dict[str, str]:
    """A request's optional ``traceparent`` and ``tracestate``, W3C-valid and bounded."""
    parent = _field(d, "traceparent", str, "")
    state = _field(d, "tracestate", str, "")
    if parent and TraceParent.parse(parent) is None:
        raise ProtocolError("request: malformed traceparent")
    if state and (not parent or not valid_tracestate(state)):
        raise ProtocolError("request: malformed tracestate")
    return {"traceparent": parent, "tracestate": state} if parent else {}


def _parse_chunk(d: _Map) -> Chunk:
    reason = _field(d, "finish_reason", str, None)
    finish = None if reason is None else _FINISH_REASONS.get(reason)
    if reason is not None and finish is None:
        raise ProtocolError(f"chunk: unknown finish_reason {reason!r}")
    chunk = Chunk(
        request_id=_request_id(d),
        token_ids=_int_list(d, "token_ids"),
        finish_reason=finish,
        kv_handle=_kv_handle(d),
        cached_tokens=_nonneg(d, "cached_tokens", 0),
        logprobs=_logprobs(d, "logprobs"),
        prompt_logprobs=_logprobs(d, "prompt_logprobs"),
    )
    if chunk.logprobs is not None and len(chunk.logprobs) != len(chunk.token_ids):
        raise ProtocolError(
            f"chunk: {len(chunk.logprobs)} logprobs for {len(chunk.token_ids)} tokens"
        )
    return chunk


def _logprobs(d: _Map, key: str) -> tuple[TokenLogprobs, ...] | None:
    value = d.get(key)
    return None if value is None else unpack_logprobs(value, f"{d.get('k')}: {key}")


def _parse_error(d: _Map) -> Error | Fault:
    code = _field(d, "code", str)
    message = _field(d, "message", str, "")
    if "request_id" not in d:
        return Fault(code, message)
    # A code this side does not know (from a newer peer) reads as internal.
    return Error(_request_id(d), _ERROR_CODES.get(code, ErrorCode.INTERNAL), message)


def _load(d: _Map) -> WorkerLoad | None:
    """A pong's optional ``load``: [active, waiting, kv_usage], counts and a share."""
    raw: list[object] | None = _field(d, "load", list, None)
    if raw is None:
        return None
    if (
        len(raw) != 3
        or not all(type(n) is int and n >= 0 for n in raw[:2])
        or type(raw[2]) not in (int, float)
        or not 0.0 <= raw[2] <= 1.0  # type: ignore[operator]
    ):
        raise ProtocolError("pong: load must be [active, waiting, kv_usage in [0, 1]]")
    active, waiting, usage = raw
    return WorkerLoad(active, waiting, float(usage))  # type: ignore[arg-type]


def _capabilities(d: _Map) -> Capabilities | None:
    """A hello_ok's optional ``caps``: the worker's declaration."""
    raw = _field(d, "caps", dict, None)
    if raw is None:
        return None
    try:
        return from_plain(raw)
    except ValueError as exc:
        raise ProtocolError(f"hello_ok: {exc}") from exc


def _event_body(event: KvEvent) -> _Map:
    """One KV event: block ids as packed int64, tokens as packed uint32."""
    match event:
        case BlockStored():
            return {
                "t": "stored",
                "ids": pack_block_hashes(event.block_ids),
                "parent": event.parent,
                "pos": event.position,
                "tokens": pack_token_ids(event.token_ids),
                "bs": event.block_size,
            }
        case BlockRemoved():
            return {"t": "removed", "ids": pack_block_hashes(event.block_ids)}
        case AllCleared():
            return {"t": "cleared"}
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _parse_event(d: _Map) -> KvEvent:
    kind = _field(d, "t", str)
    if kind == "cleared":
        return AllCleared()
    ids = unpack_block_hashes(_field(d, "ids", bytes))
    if kind == "removed":
        return BlockRemoved(ids)
    if kind != "stored":
        raise ProtocolError(f"kv_events: unknown event {kind!r}")
    parent = _field(d, "parent", int, None)
    block_size = _nonneg(d, "bs")
    tokens = unpack_token_ids(_field(d, "tokens", bytes))
    if not ids or block_size < 1 or len(tokens) != len(ids) * block_size:
        raise ProtocolError(
            f"kv_events: {len(ids)} stored blocks of {block_size} with {len(tokens)} tokens"
        )
    return BlockStored(ids, parent, _nonneg(d, "pos"), tokens, block_size)


def _parse_kv_events(d: _Map) -> KvEvents:
    raw: list[object] = _field(d, "events", list)
    if not all(isinstance(e, dict) for e in raw):
        raise ProtocolError("kv_events: every event must be a map")
    events = tuple(_parse_event(e) for e in raw)  # type: ignore[arg-type]
    start, end = _nonneg(d, "start"), _nonneg(d, "end")
    dump, gap = _field(d, "dump", bool, False), _field(d, "gap", bool, False)
    if not dump and not gap and end - start != len(events):
        raise ProtocolError(f"kv_events: {len(events)} events numbered {start} to {end}")
    return KvEvents(_nonneg(d, "seq"), KvEventBatch(start, end, events, dump, gap))


def _parse_kv_poll(d: _Map) -> KvPoll:
    since = _field(d, "since", int)
    return KvPoll(_nonneg(d, "seq"), since, _nonneg(d, "limit"))


def _parse_stats(d: _Map) -> Stats:
    values: dict[str, int | float | str | bool] = _field(d, "values", dict)
    if not all(type(k) is str and type(v) in (int, float, str, bool) for k, v in values.items()):
        raise ProtocolError("stats: values must map names to scalars")
    return Stats(_nonneg(d, "seq"), values)


_PARSERS: dict[str, Callable[[_Map], Frame]] = {
    "hello": lambda d: Hello(
        _nonneg(d, "version"),
        _field(d, "role", str),
        _field(d, "peer_id", str),
        _field(d, "model", str),
        _nonce(d),
    ),
    "challenge": lambda d: Challenge(_nonce(d), _field(d, "proof", bytes)),
    "auth": lambda d: Auth(_field(d, "proof", bytes)),
    "hello_ok": lambda d: HelloOk(
        _nonneg(d, "version"),
        _field(d, "role", str),
        _field(d, "worker_id", str),
        _field(d, "model", str),
        _capabilities(d),
    ),
    "request": _parse_request,
    "ack": lambda d: Ack(_request_id(d)),
    "chunk": _parse_chunk,
    "end": lambda d: End(_request_id(d)),
    "error": _parse_error,
    "cancel": lambda d: Cancel(_request_id(d)),
    "ping": lambda d: Ping(_nonneg(d, "seq")),
    "pong": lambda d: Pong(_nonneg(d, "seq"), _load(d)),
    "kv_pull": lambda d: KvPull(_request_id(d, "transfer_id"), _field(d, "prompt", bool, False)),
    "kv_prompt": lambda d: KvPrompt(
        _request_id(d, "transfer_id"), unpack_token_ids(_field(d, "token_ids", bytes))
    ),
    "kv_release": lambda d: KvRelease(_request_id(d, "transfer_id")),
    "kv_data": lambda d: KvData(
        _request_id(d, "transfer_id"), _field(d, "data", bytes), _field(d, "last", bool)
    ),
    "get_stats": lambda d: GetStats(_nonneg(d, "seq")),
    "stats": _parse_stats,
    "kv_poll": _parse_kv_poll,
    "kv_events": _parse_kv_events,
    "goaway": lambda d: GoAway(_field(d, "reason", str, "")),
}

#: Every frame kind on the wire; kept here, beside the parsers it is read from, since
#: the kind names are a wire detail (the frame types do not know them).
KINDS: frozenset[str] = frozenset(_PARSERS)
