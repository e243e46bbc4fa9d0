"""Every frame a plane connection carries, as plain frozen dataclasses.

A connection carries two sorts of frame. The request messages
(``headwater.wire.messages``: GenerateRequest, Ack, Chunk, End, Error, Cancel) are what
the in-process transport passes as they are; the control frames here exist only on a
byte stream: the handshake (Hello, Challenge, Auth, HelloOk), heartbeats (Ping, Pong),
KV pulls (KvPull, KvPrompt, KvData, KvRelease), stats (GetStats, Stats) and
connection-level endings (Fault, GoAway). :data:`Frame` is their union: what
``headwater.wire.codec`` turns into bytes and back, and what the handshake and the trio
shells in ``headwater.plane`` match on.

Nothing here does I/O or knows the wire format; the kind names and field encodings are
the codec's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from headwater.wire.capabilities import Capabilities
from headwater.wire.kv_events import KvEventBatch
from headwater.wire.messages import (
    Ack,
    Cancel,
    Chunk,
    End,
    Error,
    GenerateRequest,
    WorkerLoad,
)

#: 2: with a secret, every frame after the handshake carries a tag
#: (``headwater.wire.session``); a version-1 peer is refused as ``unsupported_version``.
PROTOCOL_VERSION = 2
#: Length of each side's handshake nonce (bytes).
NONCE_BYTES = 32
#: Largest frame body either side accepts (bytes). A bigger length header is an error
#: before any of the body is buffered.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
#: Largest frame a worker accepts before the handshake is done (bytes): a hello or an
#: auth is a few hundred bytes, and a peer that has not proved the secret must not
#: make the worker buffer (and unpack) ``max_frame`` bytes per connection.
HANDSHAKE_MAX_FRAME = 16 * 1024


@dataclass(frozen=True, slots=True)
class Hello:
    """The client's first frame: who it is, and what it expects the worker to serve."""

    version: int
    role: str  # "frontend", or the role of a worker pulling KV
    peer_id: str
    model: str  # what the client expects the worker to serve ("" = anything)
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Challenge:
    """The server's answer to a hello when a secret is configured."""

    nonce: bytes
    proof: bytes  # the server's proof over both nonces


@dataclass(frozen=True, slots=True)
class Auth:
    """The client's answer to a challenge."""

    proof: bytes  # the client's proof over both nonces


@dataclass(frozen=True, slots=True)
class HelloOk:
    """The handshake is done; this is who the worker is, and what its engine declared
    it honours (None: it declared nothing, an older worker)."""

    version: int
    role: str
    worker_id: str
    model: str
    capabilities: Capabilities | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """A connection-level error; the sender closes the connection after it."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Ping:
    """A heartbeat; the peer answers with a :class:`Pong` echoing ``seq``."""

    seq: int


@dataclass(frozen=True, slots=True)
class Pong:
    """The answer to the :class:`Ping` with the same ``seq``; a worker adds its load
    (an older worker, or a client answering a worker's ping, sends none)."""

    seq: int
    load: WorkerLoad | None = None


@dataclass(frozen=True, slots=True)
class KvPull:
    """A decode worker asks a prefill worker for the KV it holds under ``transfer_id``;
    with ``prompt``, for the prompt's token ids too (a :class:`KvPrompt` before the
    payload), because its request came without them. An older prefill worker never
    gets ``prompt``: only a handle of this version's says it holds the prompt."""

    transfer_id: str
    prompt: bool = False


@dataclass(frozen=True, slots=True)
class KvPrompt:
    """The prompt's token ids held with ``transfer_id``, answering a :class:`KvPull`
    that asked for them, before its first :class:`KvData`. ``token_ids`` is a token
    array (``headwater.wire.tokens``)."""

    transfer_id: str
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class KvRelease:
    """The frontend gives up the KV a prefill worker holds under ``transfer_id`` (the
    request ended, or its decode leg failed, before any decode worker pulled it): free
    it now rather than at its timeout. Not answered; an unknown id is ignored."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class KvData:
    """One piece of a transfer's payload; ``last`` marks the final piece."""

    transfer_id: str
    data: bytes | memoryview
    last: bool


@dataclass(frozen=True, slots=True)
class GetStats:
    """Asks the worker for its counters; answered by :class:`Stats` with the same ``seq``."""

    seq: int


@dataclass(frozen=True, slots=True)
class Stats:
    """The worker's counters, flat: names to scalars."""

    seq: int
    values: dict[str, int | float | str | bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KvPoll:
    """The frontend asks for the worker's KV events from number ``since`` on (a dump
    when negative), at most ``limit``; answered by :class:`KvEvents` with the same
    ``seq`` (``headwater.wire.kv_events``)."""

    seq: int
    since: int
    limit: int


@dataclass(frozen=True, slots=True)
class KvEvents:
    """The answer to the :class:`KvPoll` with the same ``seq``."""

    seq: int
    batch: KvEventBatch


@dataclass(frozen=True, slots=True)
class GoAway:
    """The server takes no new requests on this connection (it is draining)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Not a frame on the wire: what the decoder yields for a ``request`` frame that
    arrived whole but could not be read, when its request id could (its frame's length
    kept the stream in step). The receiver fails that request alone
    (``headwater.wire.codec.decode_body``)."""

    request_id: str
    reason: str


Frame = (
    Hello
    | Challenge
    | Auth
    | HelloOk
    | GenerateRequest
    | Ack
    | Chunk
    | End
    | Error
    | Fault
    | Cancel
    | Ping
    | Pong
    | KvPull
    | KvPrompt
    | KvData
    | KvRelease
    | GetStats
    | Stats
    | KvPoll
    | KvEvents
    | GoAway
    | Unreadable
)
