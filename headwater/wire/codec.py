"""The request plane's frames as bytes and back, without any I/O.

A frame is a 4-byte big-endian body length followed by a msgpack map whose ``"k"``
names the kind. :func:`encode` and :class:`FrameDecoder` turn the frames of
``headwater.wire.frames`` into such bytes and back; the trio shells
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
    get_stats  GetStats     stats: Stats (the worker's counters, flat)
    goaway     GoAway       server → client: no new requests on this connection

The decoder trusts nothing: msgpack is unpacked with ``strict_map_key`` and size
limits, every field is type-checked, and anything wrong raises
:class:`ProtocolError` (nothing else), after which the connection is unusable.

Prompt token ids travel as packed little-endian uint32 bytes, which is what a token
array (``headwater.wire.tokens``) holds: a 40k-token prompt packs and unpacks as one
memcpy each (~10 µs), where a msgpack int list took 2.1 and 3.2 + 1.7 ms and needed a
type check per element.
Chunks carry one or a few tokens, so they keep plain int lists. A KV handle's block
hashes (one per 64 prompt tokens) travel likewise as packed little-endian int64
bytes; ``struct`` packs and unpacks 625 of them in ~25 and ~15 µs (array: ~40, ~20).
A handle without them, as an older peer sends, is still valid.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

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
    KvPull,
    Ping,
    Pong,
    Stats,
)
from headwater.wire.messages import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    FinishReason,
    GenerateRequest,
    KvHandle,
)
from headwater.wire.tokens import from_uint32_le, to_uint32_le

_HEADER = struct.Struct(">I")
_MAX_MAP_LEN = 256  # the widest frame (stats) has a few dozen keys

# ---- encoding -----------------------------------------------------------------------


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


def _pack_handle(d: dict[str, Any], handle: KvHandle | None) -> None:
    """Swap the hash tuple in ``d["kv_handle"]`` (from ``to_wire``) for packed bytes."""
    if handle is not None and handle.block_hashes:
        d["kv_handle"]["block_hashes"] = pack_block_hashes(handle.block_hashes)


def _body(frame: Frame) -> dict[str, Any]:
    match frame:
        case GenerateRequest():
            d = frame.to_wire()
            d["token_ids"] = pack_token_ids(frame.token_ids)
            _pack_handle(d, frame.kv_handle)
            d["k"] = "request"
            return d
        case Chunk():
            d = frame.to_wire()
            _pack_handle(d, frame.kv_handle)
            d["k"] = "chunk"
            return d
        case Ack() | End() | Error() | Cancel():
            d = frame.to_wire()
            d["k"] = _WIRE_KINDS[type(frame)]
            return d
        case Fault():
            return {"k": "error", "code": frame.code, "message": frame.message}
        case Hello():
            return {"k": "hello", "version": frame.version, "role": frame.role,
                    "peer_id": frame.peer_id, "model": frame.model, "nonce": frame.nonce}
        case Challenge():
            return {"k": "challenge", "nonce": frame.nonce, "proof": frame.proof}
        case Auth():
            return {"k": "auth", "proof": frame.proof}
        case HelloOk():
            return {"k": "hello_ok", "version": frame.version, "role": frame.role,
                    "worker_id": frame.worker_id, "model": frame.model}
        case Ping() | Pong() | GetStats():
            return {"k": _WIRE_KINDS[type(frame)], "seq": frame.seq}
        case Stats():
            return {"k": "stats", "seq": frame.seq, "values": frame.values}
        case KvPull():
            return {"k": "kv_pull", "transfer_id": frame.transfer_id}
        case KvData():
            return {"k": "kv_data", "transfer_id": frame.transfer_id, "data": frame.data,
                    "last": frame.last}
        case GoAway():
            return {"k": "goaway", "reason": frame.reason}
    raise TypeError(f"not a frame: {type(frame).__name__}")


_WIRE_KINDS: dict[type, str] = {
    Ack: "ack", Chunk: "chunk", End: "end", Error: "error", Cancel: "cancel",
    Ping: "ping", Pong: "pong", GetStats: "get_stats",
}


def encode(frame: Frame, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """*frame* as length-prefixed bytes.

    Raises :class:`FrameTooLarge` if the body exceeds *max_frame* (the peer would
    refuse it and drop the whole connection), ValueError on unencodable fields.
    """
    body = msgpack.packb(_body(frame), use_bin_type=True)
    if len(body) > max_frame:
        raise FrameTooLarge(len(body), max_frame)
    return _HEADER.pack(len(body)) + body


# ---- decoding -----------------------------------------------------------------------


class FrameDecoder:
    """Incremental frame decoder: feed it whatever the socket returned.

    Frames may be split across feeds at any byte. After a :class:`ProtocolError`
    the decoder stays failed (every later feed raises again): resynchronising a
    length-prefixed stream is not possible.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._failure: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add *data*; return the frames it completed, in order.

        Raises ProtocolError (frames completed earlier in the same call are lost,
        as the connection is closed anyway).
        """
        if self._failure is not None:
            raise self._failure
        buf = self._buffer
        buf += data
        frames: list[Frame] = []
        pos = 0
        try:
            while len(buf) - pos >= 4:
                (size,) = _HEADER.unpack_from(buf, pos)
                if size > self.max_frame:
                    raise FrameTooLarge(size, self.max_frame)
                if size == 0:
                    raise ProtocolError("empty frame")
                end = pos + 4 + size
                if len(buf) < end:
                    break
                # Both views are released on exit, even when a traceback holds them,
                # so the buffer can be resized afterwards. unpackb copies what it keeps.
                with memoryview(buf) as view, view[pos + 4 : end] as body:
                    frames.append(decode_body(body, self.max_frame))
                pos = end
        except ProtocolError as exc:
            self._failure = exc
            buf.clear()
            raise
        del buf[:pos]
        return frames


def decode_body(body: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> Frame:
    """One frame body (without its length prefix) → a frame. Raises ProtocolError."""
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=0,
            max_bin_len=max_frame,
            max_str_len=max_frame,
            max_array_len=max_frame,
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
    except (KeyError, TypeError, ValueError) as exc:  # from_wire on a checked dict: belt and braces
        raise ProtocolError(f"bad {kind} frame: {exc!r}") from exc


_MISSING: Any = object()
_FINISH_REASONS = frozenset(r.value for r in FinishReason)


def _field(
    d: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = _MISSING
) -> Any:
    """``d[key]`` if its exact type is *kind* (bool is not an int; int passes as float)."""
    value = d.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ProtocolError(f"{d.get('k')}: missing field {key!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) in kinds or (float in kinds and type(value) is int):
        return value
    if value is None and default is None:
        return None
    raise ProtocolError(f"{d.get('k')}: field {key!r} has type {type(value).__name__}")


def _nonneg(d: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    value = _field(d, key, int, default)
    if value is not None and value < 0:
        raise ProtocolError(f"{d.get('k')}: field {key!r} is negative")
    return value


def _int_list(d: dict[str, Any], key: str) -> list[int]:
    values = _field(d, key, list, [])
    if not all(type(v) is int and v >= 0 for v in values):
        raise ProtocolError(f"{d.get('k')}: field {key!r} must hold non-negative ints")
    return values


def _request_id(d: dict[str, Any], key: str = "request_id") -> str:
    value = _field(d, key, str)
    if not value:
        raise ProtocolError(f"{d.get('k')}: empty {key}")
    return value


def _kv_handle(d: dict[str, Any]) -> dict[str, Any] | None:
    handle = _field(d, "kv_handle", dict, None)
    if handle is None:
        return None
    checked = {
        "worker_id": _field(handle, "worker_id", str),
        "address": _field(handle, "address", str),
        "transfer_id": _field(handle, "transfer_id", str),
        "num_tokens": _nonneg(handle, "num_tokens"),
    }
    hashes = unpack_block_hashes(_field(handle, "block_hashes", bytes, b""))
    if hashes:
        block_size = _nonneg(handle, "block_size")
        if block_size < 1 or len(hashes) > checked["num_tokens"] // block_size:
            raise ProtocolError(
                f"{d.get('k')}: kv_handle has {len(hashes)} block hashes for "
                f"{checked['num_tokens']} tokens in blocks of {block_size}"
            )
        checked["block_hashes"] = hashes
        checked["block_size"] = block_size
    return checked


def _parse_request(d: dict[str, Any]) -> GenerateRequest:
    sampling = _field(d, "sampling", dict)
    checked = {
        "max_tokens": _nonneg(sampling, "max_tokens"),
        "min_tokens": _nonneg(sampling, "min_tokens", 0),
        "ignore_eos": _field(sampling, "ignore_eos", bool, False),
        "temperature": float(_field(sampling, "temperature", float, 1.0)),
        "top_p": float(_field(sampling, "top_p", float, 1.0)),
        "seed": _field(sampling, "seed", int, None),
        "stop_token_ids": _int_list(sampling, "stop_token_ids"),
    }
    return GenerateRequest.from_wire({
        "request_id": _request_id(d),
        "model": _field(d, "model", str),
        "token_ids": unpack_token_ids(_field(d, "token_ids", bytes)),
        "sampling": checked,
        "kv_handle": _kv_handle(d),
        "eos_token_ids": _int_list(d, "eos_token_ids"),
    })


def _parse_chunk(d: dict[str, Any]) -> Chunk:
    reason = _field(d, "finish_reason", str, None)
    if reason is not None and reason not in _FINISH_REASONS:
        raise ProtocolError(f"chunk: unknown finish_reason {reason!r}")
    return Chunk.from_wire({
        "request_id": _request_id(d),
        "token_ids": _int_list(d, "token_ids"),
        "finish_reason": reason,
        "kv_handle": _kv_handle(d),
        "cached_tokens": _nonneg(d, "cached_tokens", 0),
    })


def _parse_error(d: dict[str, Any]) -> Error | Fault:
    code = _field(d, "code", str)
    message = _field(d, "message", str, "")
    if "request_id" not in d:
        return Fault(code, message)
    return Error.from_wire({"request_id": _request_id(d), "code": code, "message": message})


def _parse_stats(d: dict[str, Any]) -> Stats:
    values = _field(d, "values", dict)
    if not all(type(k) is str and type(v) in (int, float, str, bool) for k, v in values.items()):
        raise ProtocolError("stats: values must map names to scalars")
    return Stats(_nonneg(d, "seq"), values)


def _nonce(d: dict[str, Any]) -> bytes:
    nonce = _field(d, "nonce", bytes)
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"{d.get('k')}: nonce must be {NONCE_BYTES} bytes")
    return nonce


_PARSERS: dict[str, Callable[[dict[str, Any]], Frame]] = {
    "hello": lambda d: Hello(
        _nonneg(d, "version"), _field(d, "role", str), _field(d, "peer_id", str),
        _field(d, "model", str), _nonce(d),
    ),
    "challenge": lambda d: Challenge(_nonce(d), _field(d, "proof", bytes)),
    "auth": lambda d: Auth(_field(d, "proof", bytes)),
    "hello_ok": lambda d: HelloOk(
        _nonneg(d, "version"), _field(d, "role", str), _field(d, "worker_id", str),
        _field(d, "model", str),
    ),
    "request": _parse_request,
    "ack": lambda d: Ack(_request_id(d)),
    "chunk": _parse_chunk,
    "end": lambda d: End(_request_id(d)),
    "error": _parse_error,
    "cancel": lambda d: Cancel(_request_id(d)),
    "ping": lambda d: Ping(_nonneg(d, "seq")),
    "pong": lambda d: Pong(_nonneg(d, "seq")),
    "kv_pull": lambda d: KvPull(_request_id(d, "transfer_id")),
    "kv_data": lambda d: KvData(
        _request_id(d, "transfer_id"), _field(d, "data", bytes), _field(d, "last", bool)
    ),
    "get_stats": lambda d: GetStats(_nonneg(d, "seq")),
    "stats": _parse_stats,
    "goaway": lambda d: GoAway(_field(d, "reason", str, "")),
}

#: Every frame kind on the wire.
KINDS: frozenset[str] = frozenset(_PARSERS)
