"""What an engine can honour: its declaration, and what a request asks of it.

Every engine honours the baseline of a request (``max_tokens``, ``min_tokens``, stop
token ids, ``ignore_eos``, ``temperature``, ``top_p``). Beyond it, each engine declares
the *features* it honours, by name (:data:`FEATURES`); a request that asks for one
(a field away from its neutral value: ``top_k`` 5, not 0) may go only to workers that
declared it. The frontend decides before dispatch (a 400 naming the field and the
engine); the worker runtime refuses again whatever reaches it anyway, so a request is
honoured or refused, never quietly served without what it asked for.

The declaration travels with the worker: in the handshake's ``hello_ok`` over TCP, in
its etcd record, and on the instance the in-process cluster reports
(docs/discovery.md). A worker that declares nothing (one older than declarations) is
taken to honour :data:`BASELINE` and no more. Names a side does not know (a newer
peer's) are kept and never match anything asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

SEED: Final = "seed"
TOP_K: Final = "top_k"
MIN_P: Final = "min_p"
PRESENCE_PENALTY: Final = "presence_penalty"
FREQUENCY_PENALTY: Final = "frequency_penalty"
REPETITION_PENALTY: Final = "repetition_penalty"
LOGIT_BIAS: Final = "logit_bias"
#: Constrained decoding: JSON schemas, JSON objects, regexes, choices, grammars,
#: structural tags (what ``response_format`` and ``tool_choice: "required"`` need).
STRUCTURED_OUTPUTS: Final = "structured_outputs"
LOGPROBS: Final = "logprobs"
PROMPT_LOGPROBS: Final = "prompt_logprobs"
#: The engine generates ``n`` choices of one request itself.
N: Final = "n"

#: Every feature this version knows, in the order the docs list them.
FEATURES: Final = (
    SEED,
    TOP_K,
    MIN_P,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
    LOGIT_BIAS,
    STRUCTURED_OUTPUTS,
    LOGPROBS,
    PROMPT_LOGPROBS,
    N,
)

#: Not a request's feature but the worker's: a decode leg may come without its prompt's
#: ids when its KV handle says the prefill worker holds them (``KvHandle.holds_prompt``),
#: and the engine takes them from its KV pull. The frontend's plane connection then
#: leaves them out, so a prompt crosses the plane from the frontend once.
PROMPT_FROM_KV: Final = "prompt_from_kv"

#: The most features a declaration may list on the wire, and the longest name: a
#: declaration is a few hundred bytes, read before any request.
MAX_FEATURES = 64
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class Capabilities:
    """An engine's declaration: its name (what a refusal names) and its features."""

    engine: str
    features: frozenset[str] = frozenset()

    def honours(self, feature: str) -> bool:
        return feature in self.features

    def describe(self) -> str:
        """The engine as a refusal names it."""
        return f"the {self.engine} engine" if self.engine else "this server's engine"


#: What a worker that declares nothing is taken to honour: seeds, which every engine
#: took before declarations existed (logprobs came after them).
BASELINE: Final = Capabilities("", frozenset({SEED}))


class Sampling(Protocol):
    """The fields :func:`needed` reads: the wire's :class:`~headwater.wire.SamplingParams`
    and the frontend's options alike."""

    @property
    def seed(self) -> int | None: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def structured(self) -> object | None: ...


def needed(s: Sampling) -> Iterator[str]:
    """The features *s* asks for, in :data:`FEATURES` order. A field at its neutral
    value (``top_k`` 0, a penalty of 0, a repetition penalty of 1, no bias) asks for
    nothing, so a client that sends every default is served anywhere."""
    if s.seed is not None:
        yield SEED
    if s.logprobs is not None:
        yield LOGPROBS
    if s.prompt_logprobs is not None:
        yield PROMPT_LOGPROBS
    if s.top_k > 0:
        yield TOP_K
    if s.min_p > 0:
        yield MIN_P
    if s.presence_penalty:
        yield PRESENCE_PENALTY
    if s.frequency_penalty:
        yield FREQUENCY_PENALTY
    if s.repetition_penalty != 1.0:
        yield REPETITION_PENALTY
    if s.logit_bias:
        yield LOGIT_BIAS
    if s.structured is not None:
        yield STRUCTURED_OUTPUTS


def refusal(caps: Capabilities, s: Sampling) -> str | None:
    """Why an engine of *caps* cannot serve *s*, or None when it can: the first feature
    asked for and not declared."""
    for feature in needed(s):
        if not caps.honours(feature):
            return f"'{feature}' is not supported by {caps.describe()}"
    return None


# ---- as plain data (the handshake's msgpack, etcd's JSON) ----------------------------


def to_plain(caps: Capabilities) -> dict[str, Any]:
    """*caps* as a JSON-like map: ``{"engine": str, "features": [str, ...]}``."""
    return {"engine": caps.engine, "features": sorted(caps.features)}


def from_plain(obj: object) -> Capabilities:
    """The inverse of :func:`to_plain`, checking everything (it comes from a peer or a
    store). Raises ValueError."""
    if not isinstance(obj, dict):
        raise ValueError(f"capabilities: a {type(obj).__name__}, not a map")
    engine = obj.get("engine", "")
    features = obj.get("features", [])
    if type(engine) is not str or len(engine) > MAX_NAME:
        raise ValueError("capabilities: engine must be a string of at most 64 characters")
    if type(features) is not list or len(features) > MAX_FEATURES:
        raise ValueError(f"capabilities: features must be a list of at most {MAX_FEATURES}")
    if not all(type(f) is str and 0 < len(f) <= MAX_NAME for f in features):
        raise ValueError("capabilities: each feature must be a non-empty short string")
    return Capabilities(engine, frozenset(features))
