"""The plane's handshake, without any I/O, and where the shared secret comes from.

The trio shells feed each frame the peer sent to :class:`ClientHandshake` or
:class:`ServerHandshake` and send whatever it returns; the handshake works on frame
objects (``headwater.wire.frames``), never on bytes, so it is tested without a socket::

    client                         server
    hello(version, nonce_c) ──────▶
                            ◀────── challenge(nonce_s, proof_s)   only with a secret
    auth(proof_c)          ──────▶                                only with a secret
                            ◀────── hello_ok(worker identity)  or  error(code) + close

``proof_x = HMAC-SHA256(secret, "headwater-plane/1|x|" + nonce_c + nonce_s)``, x being
``server`` or ``client``: each side proves the secret over a nonce the other chose, so a
recorded exchange never replays, and the labels stop one side's proof from being
reflected back as the other's. The server proves first; the secret is never sent.

With a secret, the handshake ends in a :class:`~headwater.wire.session.Session` on both
sides (:attr:`ClientHandshake.session`, :attr:`ServerHandshake.session`): keys derived
from the secret both proved, both nonces, the hello and the hello_ok, with which every
later frame is authenticated, so that a relay that forwarded the handshake cannot add,
replay or alter a frame (:mod:`headwater.wire.session`).

Rotation: a secret may carry earlier ones it still accepts (:class:`PlaneSecret`, from a
secret file of several lines). The server proves with its current secret; the client
accepts a proof made with any of its secrets and answers with the one that matched; the
server accepts an answer made with any of its own. So a cluster moves to a new secret
in rolling restarts, every pair of ends sharing at least one secret throughout
(docs/security.md, "Rotating keys and plane secrets").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable

from headwater.wire.errors import AuthError, ProtocolError
from headwater.wire.frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Fault,
    Frame,
    Hello,
    HelloOk,
)
from headwater.wire.session import Session, derive_session

#: Environment variable holding the shared plane secret itself.
SECRET_ENV = "HEADWATER_PLANE_SECRET"
#: The weakest secret accepted: this many bytes, of at least MIN_SECRET_DISTINCT values.
#: One recorded handshake lets an attacker test guesses offline, as fast as HMAC runs:
#: a short or repetitive secret (``a``, a word) falls at once. 16 characters of a
#: random alphabet are beyond reach (16 hex digits: 2**64 guesses); what is checked is
#: the length and variety, not the randomness, so make one with :func:`generate_secret`.
MIN_SECRET_BYTES = 16
MIN_SECRET_DISTINCT = 8


class PlaneSecret(bytes):
    """The secret this end proves itself with (its bytes), and the earlier ones it still
    accepts from a peer while a rotation is under way (:attr:`accepted`, current first).

    A ``bytes`` so that every config and call that carries the secret carries this
    unchanged; only the handshake looks at :attr:`accepted`.
    """

    accepted: tuple[bytes, ...]

    def __new__(cls, current: bytes, previous: Iterable[bytes] = ()) -> PlaneSecret:
        self = super().__new__(cls, current)
        self.accepted = (bytes(current), *(bytes(p) for p in previous if p != current))
        return self


def accepted_secrets(secret: bytes) -> tuple[bytes, ...]:
    """Every secret *secret* accepts from a peer: itself, and a rotation's earlier ones."""
    return secret.accepted if isinstance(secret, PlaneSecret) else (secret,)


def _matching(
    secret: bytes, side: str, client_nonce: bytes, server_nonce: bytes, presented: bytes
) -> bytes | None:
    """The accepted secret whose proof is *presented*, else None. Every candidate is
    compared, without stopping early, so timing says nothing of which one matched."""
    found: bytes | None = None
    for candidate in accepted_secrets(secret):
        expected = proof(candidate, side, client_nonce, server_nonce)
        if hmac.compare_digest(expected, presented) and found is None:
            found = candidate
    return found


def proof(secret: bytes, side: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The HMAC-SHA256 proof of *side* (``"client"`` or ``"server"``)."""
    label = f"headwater-plane/{PROTOCOL_VERSION}|{side}|".encode()
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


class ClientHandshake:
    """The client's side: :meth:`start`, then :meth:`receive` each frame until done.

    ``receive`` returns the frame to send next (or None) and sets :attr:`peer` when the
    handshake completes. Raises :class:`AuthError`, :class:`ProtocolError` (with the
    server's code when it sent an error frame).
    """

    def __init__(self, *, role: str, peer_id: str, model: str, secret: bytes | None) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._hello = Hello(PROTOCOL_VERSION, role, peer_id, model, nonce)
        self._secret = secret
        self._server_proved = False
        self._shared = b""  # the secret the worker proved
        self._server_nonce = b""
        self.peer: HelloOk | None = None
        #: The session's keys once the handshake is done with a secret; else None.
        self.session: Session | None = None

    def start(self) -> Hello:
        return self._hello

    def receive(self, frame: Frame) -> Frame | None:
        if self.peer is not None:
            raise ProtocolError("handshake already complete")
        match frame:
            case Challenge():
                if self._secret is None:
                    raise AuthError("the worker requires a plane secret and none is configured")
                if self._server_proved:
                    raise ProtocolError("second challenge")
                shared = _matching(
                    self._secret, "server", self._hello.nonce, frame.nonce, frame.proof
                )
                if shared is None:
                    raise AuthError("the worker does not know the plane secret")
                self._server_proved = True
                self._shared, self._server_nonce = shared, frame.nonce
                # Answer with the secret the worker proved: it is one the worker holds.
                return Auth(proof(shared, "client", self._hello.nonce, frame.nonce))
            case HelloOk():
                if self._secret is not None and not self._server_proved:
                    raise AuthError("the worker skipped authentication but a secret is configured")
                if frame.version != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"worker speaks protocol {frame.version}", "unsupported_version"
                    )
                self.peer = frame
                if self._secret is not None:
                    hello = self._hello
                    self.session = derive_session(
                        self._shared,
                        "client",
                        hello.nonce,
                        self._server_nonce,
                        (hello.role, hello.peer_id, hello.model),
                        (frame.role, frame.worker_id, frame.model),
                    )
                return None
            case Fault():
                if frame.code == "unauthorized":
                    raise AuthError(f"refused by the worker: {frame.message}")
                raise ProtocolError(f"refused by the worker: {frame.message}", frame.code)
        raise ProtocolError(f"unexpected {type(frame).__name__} during the handshake")


class ServerHandshake:
    """The server's side: :meth:`receive` each client frame until :attr:`peer` is set.

    Returns the frame to send back. Raises :class:`AuthError` or
    :class:`ProtocolError`; the caller sends ``Fault(exc.code, exc.message)`` and closes.
    """

    def __init__(self, identity: HelloOk, *, secret: bytes | None) -> None:
        self._identity = identity
        self._secret = secret
        self._hello: Hello | None = None
        self._nonce = b""
        self.peer: Hello | None = None
        #: The session's keys once the handshake is done with a secret; else None.
        self.session: Session | None = None

    def receive(self, frame: Frame) -> Frame:
        if self.peer is not None:
            raise ProtocolError("handshake already complete")
        if self._hello is None:
            if not isinstance(frame, Hello):
                raise ProtocolError(f"expected hello, got {type(frame).__name__}")
            if frame.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"protocol {frame.version} not supported (this worker speaks "
                    f"{PROTOCOL_VERSION})",
                    "unsupported_version",
                )
            self._hello = frame
            if self._secret is None:
                self.peer = frame
                return self._identity
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            current = accepted_secrets(self._secret)[0]
            return Challenge(self._nonce, proof(current, "server", frame.nonce, self._nonce))
        if not isinstance(frame, Auth) or self._secret is None:
            raise ProtocolError(f"expected auth, got {type(frame).__name__}")
        shared = _matching(self._secret, "client", self._hello.nonce, self._nonce, frame.proof)
        if shared is None:
            raise AuthError("wrong plane secret")
        hello, identity = self._hello, self._identity
        self.session = derive_session(
            shared,
            "server",
            hello.nonce,
            self._nonce,
            (hello.role, hello.peer_id, hello.model),
            (identity.role, identity.worker_id, identity.model),
        )
        self.peer = hello
        return identity


def generate_secret() -> str:
    """A new plane secret: 32 random bytes, base64 (what ``head -c 32 /dev/urandom |
    base64`` prints)."""
    return base64.b64encode(secrets.token_bytes(32)).decode()


def check_secret_strength(secret: bytes, source: str = "the plane secret") -> None:
    """Raise ValueError unless *secret* is at least :data:`MIN_SECRET_BYTES` long and
    holds :data:`MIN_SECRET_DISTINCT` different bytes; the message says how to make one
    and never quotes the secret."""
    if len(secret) < MIN_SECRET_BYTES or len(set(secret)) < MIN_SECRET_DISTINCT:
        raise ValueError(
            f"{source} is too weak: it needs at least {MIN_SECRET_BYTES} characters, of "
            f"at least {MIN_SECRET_DISTINCT} different ones (one recorded handshake lets a "
            "guess be tested offline); make one with: head -c 32 /dev/urandom | base64"
        )


def load_secret(secret_file: str | None = None) -> PlaneSecret | None:
    """The shared plane secret: *secret_file*'s content, else ``$HEADWATER_PLANE_SECRET``.

    One secret per line (blank lines skipped, each line's surrounding whitespace
    stripped): the first is the one this end proves itself with, the others are earlier
    secrets still accepted from peers while a rotation is under way. Returns None when
    neither is set; raises ValueError for an empty secret or a weak one (any line:
    :func:`check_secret_strength`) and OSError for an unreadable file. Called at
    startup, never on the event loop's hot path.
    """
    if secret_file:
        with open(secret_file, "rb") as f:
            raw = f.read()
        source = secret_file
    else:
        env = os.environ.get(SECRET_ENV)
        if env is None:
            return None
        raw, source = env.encode(), SECRET_ENV
    lines = [line.strip() for line in raw.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"the plane secret from {source} is empty")
    for number, line in enumerate(lines, 1):
        which = "the plane secret" if number == 1 else f"line {number} (an earlier secret)"
        check_secret_strength(line, f"{which} from {source}")
    return PlaneSecret(lines[0], lines[1:])
