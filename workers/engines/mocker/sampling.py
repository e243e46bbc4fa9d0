"""The simulated engine's "sampling": deterministic draws from a request's seed.

Output tokens are a pure function of (seed, absolute position), so a request rerun
with the same seed — or preempted and recomputed, or migrated with its output appended
to the prompt — produces the same id at each position. A request without a seed gets
its key from a stable hash of its id, so it too is reproducible, and across worker
processes. The natural output length (when ``mean_output_tokens`` is set) is drawn
from the same key, salted apart from the token draws.

The simulated model's next-token distribution is uniform over the ordinary ids, which
a temperature leaves as it is; greedy decoding (temperature 0) takes that model's one
most likely answer, so every greedy request shares one key (:data:`GREEDY_KEY`),
whatever its seed: the same ids at the same positions.

The draws are splitmix64 (a counter hashed by its finalizer): cheap, stateless and
well spread, which is all a simulator needs. :func:`token_at` runs once per output
token on the frontend's event loop when the mocker is in-process, so it is written as
one call with the finalizer inlined.
"""

from __future__ import annotations

import hashlib

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment
LENGTH_SALT = 0x5851F42D4C957F2D  # separates the natural-length draw from token draws


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of a 64-bit int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


#: The stream key of every greedy request (temperature 0).
GREEDY_KEY = 0x2545F4914F6CDD1D


def seed_key(seed: int | None, request_id: str, *, greedy: bool = False) -> int:
    """The request's stream key: :data:`GREEDY_KEY` for a greedy one, else from its
    seed, else a stable hash of its id."""
    if greedy:
        return GREEDY_KEY
    if seed is None:
        # str hash() is salted per process; blake2b is stable across workers.
        return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest())
    return mix64((seed + GAMMA) & MASK64)


def natural_length(key: int, mean: int) -> int:
    """The output length a request with stream *key* ends at with EOS: uniform in
    ``[1, 2 * mean - 1]`` (*mean* >= 1)."""
    return 1 + mix64(key ^ LENGTH_SALT) % (2 * mean - 1)


def token_at(key: int, position: int, low: int, span: int) -> int:
    """The token id in ``[low, low + span)`` drawn for stream *key* at *position*.

    The engine passes ``len(tokens) + 1`` for the token it appends to prompt plus
    output ``tokens``. Equals ``low + mix64((key + position * GAMMA) & MASK64) % span``;
    the finalizer is inlined to keep this to one call per token.
    """
    x = (key + position * GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return low + (x ^ (x >> 31)) % span
