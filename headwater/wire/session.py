"""Every frame after the handshake authenticated: the session a handshake agrees on.

The handshake (:mod:`headwater.wire.handshake`) proves that both ends hold the secret,
but by itself it says nothing of the frames that follow: a relay on the path could
forward a real handshake and then add frames of its own. So, when the handshake used a
secret, both ends derive a session from it, and every later frame carries a tag::

    master  = HMAC-SHA256(secret, "headwater-plane/2|session|" + nonce_c + nonce_s
                                  + hello's role, id, model + hello_ok's role, id, model)
    key_x   = HMAC-SHA256(master, x)            x = "client" or "server": who sends
    tag     = HMAC-SHA256(key_x, seq + body)[:16]

``seq`` is the number of frames that end sent before this one (8 bytes, little endian),
counted by both ends and never sent. A frame injected, replayed, reordered, dropped
before another or altered fails its tag; so does one reflected back to its sender (the
keys differ by direction), or carried over from another connection (the nonces differ),
or a handshake whose hello or hello_ok a relay rewrote (the ends derive different keys).
A failed tag is an :class:`AuthError`: the connection is closed.

On the wire the tag follows the body, inside the frame's length (``headwater.wire.codec``).
Cost: ~2.5 µs per small frame, ~1 ms per MiB (SHA-256 in hardware); measured by
``scripts/measure/frame_mac.py`` (docs/request-plane.md). Without a secret (loopback only)
there is no session and frames carry no tag.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from headwater.wire.errors import AuthError

#: Bytes of the tag after every frame body of a session (128 bits of HMAC-SHA256).
TAG_BYTES = 16
_LABEL = b"headwater-plane/2|session|"
_SEQ = struct.Struct("<Q")
_BLOCK = 64  # SHA-256's block size, HMAC's key pad


class FrameMac:
    """One direction's key and frame counter: :meth:`sign` the frames sent in order, or
    :meth:`verify` those received in order. Each call moves the counter on.

    HMAC's inner and outer hashes of the key are computed once and copied per frame
    (~2.5 µs per small frame against ~4 µs for ``hmac.new``).
    """

    __slots__ = ("_inner", "_outer", "seq")

    def __init__(self, key: bytes) -> None:
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))
        self.seq = 0

    def _tag(self, parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
        inner = self._inner.copy()
        inner.update(_SEQ.pack(self.seq))
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        self.seq += 1
        return outer.digest()[:TAG_BYTES]

    def sign(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The tag of the next frame sent, whose body is *parts* joined."""
        return self._tag(parts)

    def verify(self, body: bytes | bytearray | memoryview, tag: bytes | bytearray) -> None:
        """Check the next frame received; raises :class:`AuthError` if its tag is wrong."""
        self._check(self._tag((body,)), tag)

    def begin(self) -> Any:
        """The next frame's hash, to :meth:`finish` once fed its body in parts as they
        arrive: a large ``kv_data`` piece is checked without being gathered in one
        buffer (``headwater.wire.codec``). Nothing else may be verified in between."""
        inner = self._inner.copy()
        inner.update(_SEQ.pack(self.seq))
        return inner

    def finish(self, inner: Any, tag: bytes | bytearray) -> None:
        """Check the frame :meth:`begin` started, fed its whole body; raises
        :class:`AuthError` if *tag* is wrong."""
        outer = self._outer.copy()
        outer.update(inner.digest())
        self.seq += 1
        self._check(outer.digest()[:TAG_BYTES], tag)

    def _check(self, expected: bytes, tag: bytes | bytearray) -> None:
        if not hmac.compare_digest(expected, bytes(tag)):
            raise AuthError(
                f"frame {self.seq - 1} failed authentication (injected, replayed, "
                "reordered or altered on the way)"
            )


@dataclass(frozen=True, slots=True)
class Session:
    """This end's two :class:`FrameMac`: the frames it sends, the frames it receives."""

    send: FrameMac
    receive: FrameMac


def derive_session(
    secret: bytes,
    side: str,
    client_nonce: bytes,
    server_nonce: bytes,
    hello: tuple[str, str, str],
    hello_ok: tuple[str, str, str],
) -> Session:
    """The session of *side* (``"client"`` or ``"server"``) after a handshake with
    *secret* (the one both ends proved), both nonces, the hello's (role, peer id, model)
    and the hello_ok's (role, worker id, model)."""
    transcript = b"".join(_field(text) for text in (*hello, *hello_ok))
    master = hmac.digest(secret, _LABEL + client_nonce + server_nonce + transcript, "sha256")
    client = FrameMac(hmac.digest(master, b"client", "sha256"))
    server = FrameMac(hmac.digest(master, b"server", "sha256"))
    return Session(client, server) if side == "client" else Session(server, client)


def _field(text: str) -> bytes:
    """*text* length-prefixed, so that no two transcripts run together alike."""
    data = text.encode()
    return _SEQ.pack(len(data)) + data
