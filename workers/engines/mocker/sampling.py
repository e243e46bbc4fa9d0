"""The simulated engine's "sampling": deterministic draws from a request's seed.

Output tokens are a pure function of (seed, absolute position), so a request rerun
with the same seed — or preempted and recomputed, or migrated with its output appended
to the prompt — produces the same id at each position. A request without a seed gets
its key from a stable hash of its id, so it too is reproducible, and across worker
processes. The answer's length (where it emits EOS, :func:`output_length`) is drawn
from the same key, salted apart from the token draws.

Each position has a simulated next-token distribution over the output range
``[low, low + span)``, and the token is drawn from it (at temperature 1), or, at
temperature 0, is its most likely token (:func:`top_token_at`), every greedy request
sharing one key (:data:`GREEDY_KEY`) whatever its seed: :data:`HEAD` candidates,
``base``, ``base + 1``, ... (mod ``span``, with ``base`` hashed from the key and the
position), have probabilities falling as
``1 / rank**2``; every other token of the range is :data:`TAIL_RATIO` times less likely
than the last candidate. :func:`logprobs_at` reports that same distribution, so the
logprobs a client sees are those of the distribution its tokens came from. A prompt's
logprobs (:func:`prompt_logprobs`) use one fixed key, so they depend on the prompt
alone, as a model's do.

The draws are splitmix64 (a counter hashed by its finalizer): cheap, stateless and
well spread, which is all a simulator needs. :func:`token_at` runs once per output
token on the frontend's event loop when the mocker is in-process, so it is written as
one hash with the finalizer inlined and one bisection in a precomputed table.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from headwater.wire import TokenLogprobs

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment
LENGTH_SALT = 0x5851F42D4C957F2D  # separates the length draw from token draws
_NORMAL = NormalDist()
#: Candidates a position's distribution ranks by name: enough for OpenAI's 20
#: ``top_logprobs``.
HEAD = 20
#: How much less likely than the last candidate each other token of the range is.
TAIL_RATIO = 1e4
#: The key of every prompt's distributions (:func:`prompt_logprobs`).
PROMPT_KEY = 0x243F6A8885A308D3
_U32 = 1 << 32


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


def prompt_key(tokens: Sequence[int]) -> int:
    """A key of the prompt alone (its length and last 16 tokens, hashed): what a greedy
    answer's length is drawn from, since every greedy request shares one stream key. The
    same prompt gets an answer of the same length, as at a model's temperature 0, and
    prompts that differ get lengths that differ."""
    x = mix64((len(tokens) ^ GREEDY_KEY) & MASK64)
    for token in tokens[-16:]:
        x = mix64((x ^ token) & MASK64)
    return x


def output_length(key: int, mean: int, sigma: float) -> int:
    """The length, EOS included, of the answer of stream *key*: a lognormal draw of
    mean *mean* tokens and shape *sigma* (0: exactly *mean*), rounded, at least 1.

    One uniform draw from *key* (52 bits, strictly inside (0, 1)) through the normal
    quantile: pure arithmetic, so every worker draws the same length for a seed.
    """
    u = ((mix64(key ^ LENGTH_SALT) >> 12) + 0.5) / (1 << 52)
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is *mean*, not the median
    return max(1, round(math.exp(mu + sigma * _NORMAL.inv_cdf(u))))


@dataclass(frozen=True, slots=True)
class Shape:
    """The distribution of every position over a range of *span* tokens, up to which
    candidate is which: the candidates' logprobs (most likely first), the other
    tokens' logprob, and the cumulative thresholds a 32-bit draw is bisected in."""

    span: int
    head: int  # candidates: min(HEAD, span)
    logprobs: tuple[float, ...]
    tail_logprob: float  # -inf when every token is a candidate
    cuts: tuple[int, ...]  # the draw u < cuts[r] (and >= cuts[r - 1]) picks candidate r


@functools.cache
def shape(span: int) -> Shape:
    """The distribution's shape over a range of *span* tokens (computed once)."""
    head = min(HEAD, span)
    weights = [1.0 / (r + 1) ** 2 for r in range(head)]
    tail_weight = weights[-1] / TAIL_RATIO
    total = sum(weights) + (span - head) * tail_weight
    cuts, cumulative = [], 0.0
    for w in weights:
        cumulative += w / total
        cuts.append(min(_U32, round(cumulative * _U32)))
    tail = math.log(tail_weight / total) if span > head else -math.inf
    return Shape(span, head, tuple(math.log(w / total) for w in weights), tail, tuple(cuts))


def token_at(key: int, position: int, low: int, span: int) -> int:
    """The token id in ``[low, low + span)`` drawn for stream *key* at *position*.

    The engine passes ``len(tokens) + 1`` for the token it appends to prompt plus
    output ``tokens``. One 64-bit hash of (key, position): its low half places the
    candidates (``base``), its high half is the draw.
    """
    x = (key + position * GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    s = shape(span)
    u = x >> 32
    base = (x & 0xFFFFFFFF) % span
    rank = bisect.bisect_right(s.cuts, u)
    if rank < s.head:
        return low + (base + rank) % span
    # A token outside the candidates, evenly: the draw's place in the tail's share.
    start = s.cuts[-1]
    return low + (base + s.head + (u - start) * (span - s.head) // (_U32 - start)) % span


def top_token_at(key: int, position: int, low: int, span: int) -> int:
    """The most likely token at *position* of stream *key*: greedy decoding's pick
    (the first candidate, ``base``, of :func:`token_at`)."""
    return low + (mix64((key + position * GAMMA) & MASK64) & 0xFFFFFFFF) % span


def logprobs_at(
    key: int,
    position: int,
    token: int,
    low: int,
    span: int,
    top: int,
    first: int | None = None,
) -> TokenLogprobs:
    """The logprobs of *token* at *position* of stream *key* (see :func:`token_at`) and
    the *top* most likely tokens there. *first*: a token that takes the most likely
    candidate's place (the EOS a request emits at its natural end). A token outside
    the range (a special one) has logprob ``-inf``, ranked after the whole range."""
    s = shape(span)
    base = (mix64((key + position * GAMMA) & MASK64) & 0xFFFFFFFF) % span
    top_ids = [low + (base + r) % span for r in range(min(top, s.head))]
    if first is not None and top_ids:
        top_ids[0] = first
    if token == first:
        logprob, rank = s.logprobs[0], 1
    elif low <= token < low + span and (offset := (token - low - base) % span) < s.head:
        if offset == 0 and first is not None:
            logprob, rank = -math.inf, span + 1  # displaced by *first*
        else:
            logprob, rank = s.logprobs[offset], offset + 1
    elif low <= token < low + span:
        logprob, rank = s.tail_logprob, span  # every token is at least as likely
    else:
        logprob, rank = -math.inf, span + 1
    return TokenLogprobs(logprob, rank, tuple(top_ids), s.logprobs[: len(top_ids)])


def prompt_logprobs(
    tokens: Sequence[int], top: int, low: int, span: int
) -> tuple[TokenLogprobs, ...]:
    """The logprobs of a prompt's tokens from the second on (the first has nothing
    before it), each from its position's distribution under :data:`PROMPT_KEY`."""
    return tuple(
        logprobs_at(PROMPT_KEY, i + 1, tokens[i], low, span, top) for i in range(1, len(tokens))
    )
