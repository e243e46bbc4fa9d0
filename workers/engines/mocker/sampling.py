"""The simulated engine's "sampling": deterministic draws from a request's seed.

Output tokens are a pure function of (seed, absolute position), so a request rerun
with the same seed — or preempted and recomputed, or migrated with its output appended
to the prompt — produces the same id at each position. A request without a seed gets
its key from a stable hash of its id, so it too is reproducible, and across worker
processes. The answer's length (where it emits EOS, :func:`output_length`) is drawn
from the same key, salted apart from the token draws.

The draws are splitmix64 (a counter hashed by its finalizer): cheap, stateless and
well spread, which is all a simulator needs. :func:`token_at` runs once per output
token on the frontend's event loop when the mocker is in-process, so it is written as
one call with the finalizer inlined.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment
LENGTH_SALT = 0x5851F42D4C957F2D  # separates the length draw from token draws
_NORMAL = NormalDist()


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of a 64-bit int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seed_key(seed: int | None, request_id: str) -> int:
    """The request's stream key: from its seed, else a stable hash of its id."""
    if seed is None:
        # str hash() is salted per process; blake2b is stable across workers.
        return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest())
    return mix64((seed + GAMMA) & MASK64)


def output_length(key: int, mean: int, sigma: float) -> int:
    """The length, EOS included, of the answer of stream *key*: a lognormal draw of
    mean *mean* tokens and shape *sigma* (0: exactly *mean*), rounded, at least 1.

    One uniform draw from *key* (52 bits, strictly inside (0, 1)) through the normal
    quantile: pure arithmetic, so every worker draws the same length for a seed.
    """
    u = ((mix64(key ^ LENGTH_SALT) >> 12) + 0.5) / (1 << 52)
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is *mean*, not the median
    return max(1, round(math.exp(mu + sigma * _NORMAL.inv_cdf(u))))


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
