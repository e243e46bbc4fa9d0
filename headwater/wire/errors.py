"""What the plane's sans-IO layer raises when the peer breaks the protocol.

They live apart from the codec because two modules raise them and neither should
import the other: the codec (bytes that do not decode, fields that do not check) and
the handshake (which works on frame objects, never on bytes). The trio shells in
``headwater.plane`` catch them, send ``Fault(exc.code, exc.message)`` and close::

    ProtocolError      the peer broke the protocol: close the connection
    │                  (code "protocol_error", or "unsupported_version")
    ├── FrameTooLarge  a frame over the size limit ("frame_too_large")
    └── AuthError      the handshake failed: missing, unexpected or wrong proof
                       of the shared secret ("unauthorized")

A field that cannot be *encoded* (a token id out of range, say) is our own bug, not the
peer's, and raises ValueError instead; only an oversized frame raises FrameTooLarge on
both sides, because the peer would refuse it and drop the whole connection.
"""

from __future__ import annotations

#: Longest message a ProtocolError keeps (characters). A message may quote what the
#: peer sent (an unknown kind, a worker's refusal), and it goes back to the peer in a
#: Fault and into the log: a megabyte-long kind must not come back a megabyte long.
MAX_MESSAGE = 512
#: Longest code kept (characters); the codes this side sends are a word each.
_MAX_CODE = 64


class ProtocolError(Exception):
    """The peer broke the protocol; the connection must be closed.

    ``code`` is what an error frame to the peer says: ``protocol_error``,
    ``frame_too_large``, ``unsupported_version`` or ``unauthorized``. Both it and
    ``message`` are cut to a bounded length.
    """

    def __init__(self, message: str, code: str = "protocol_error") -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 1] + "…"
        super().__init__(message)
        self.code = code[:_MAX_CODE]
        self.message = message


class FrameTooLarge(ProtocolError):
    """A frame exceeds the size limit (raised by the decoder and by the encoder)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit", "frame_too_large")


class AuthError(ProtocolError):
    """The handshake failed: missing, unexpected or wrong proof of the shared secret."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "unauthorized")
