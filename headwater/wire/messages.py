"""The messages that cross the request plane, in one place both sides import.

A request travels frontend → worker as a :class:`GenerateRequest`; the worker answers
with an :class:`Ack` as soon as it has decoded the request (before any engine work),
then zero or more :class:`Chunk` messages, then exactly one :class:`End` or
:class:`Error`. The caller may send :class:`Cancel` at any time.

These are plain frozen dataclasses and enums: no I/O and no serialization. The
in-process transport passes the objects themselves; the TCP transport's codec
(``headwater.wire.codec``) is the one place that turns them into bytes and back.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Role(enum.StrEnum):
    """What a worker does with a request.

    ``prefill`` computes the prompt's KV cache and hands back a :class:`KvHandle`;
    ``decode`` pulls that KV and generates tokens; ``agg`` does both in one place.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    AGG = "agg"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id; stop *strings* are matched by the frontend
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"


class StructuredKind(enum.StrEnum):
    """What a :class:`StructuredOutput` constrains the output to, as vLLM names it."""

    JSON = "json"  # valid against a JSON schema (``spec``: the schema as JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (``spec`` empty)
    REGEX = "regex"  # ``spec``: the regular expression
    CHOICE = "choice"  # one of several strings (``spec``: a JSON list of them)
    GRAMMAR = "grammar"  # ``spec``: an EBNF grammar
    STRUCTURAL_TAG = "structural_tag"  # ``spec``: xgrammar's structural tag, as JSON text


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text (constrained decoding), for engines that
    declare ``structured_outputs`` (:mod:`headwater.wire.capabilities`)."""

    kind: StructuredKind
    spec: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the engine needs to know to generate; text-level options stay in the frontend.

    ``logprobs``: report each generated token's log probability and the ``logprobs``
    most likely tokens at its position (0: the token's own only); ``prompt_logprobs``:
    the same for the prompt's tokens, on the first chunk. None: not asked (what an older
    peer sends).

    The fields after ``prompt_logprobs`` go beyond the baseline every engine honours:
    each asks for a feature the engine must declare (:mod:`headwater.wire.capabilities`)
    unless it is at its default, which asks for nothing (and is what an older peer
    sends). ``logit_bias`` is (token id, bias) pairs, each bias added to that token's
    logit before sampling.
    """

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # -- beyond the baseline: declared features --
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log probabilities (natural log) at one position of a sequence.

    ``logprob`` and ``rank`` are the token's at that position (the one sampled, or the
    prompt's own): ``rank`` counts the tokens at least as likely as it (1: the most
    likely). ``top_ids`` and ``top_logprobs`` are the most likely tokens there, most
    likely first, as many as asked (fewer only when the model has fewer to offer). A
    logprob may be ``-inf`` (a token the model rules out); the response formats clamp it.
    """

    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Where a decode worker can pull the KV cache a prefill worker computed.

    ``address`` is the prefill worker's transfer endpoint (``tcp://host:port`` for
    the TCP plane, ``memory://<worker id>`` in-process); ``transfer_id`` names the
    held blocks there. The prefill side frees them after the pull or a timeout.

    ``block_hashes`` are the prefix-cache hashes of the prompt's full blocks of
    ``block_size`` tokens, as the prefill worker computed them, so the decode worker
    need not hash the same prompt again; empty (and ``block_size`` 0) when the sender
    does not provide them (an older peer), in which case the decode side hashes.
    In-process the tuple is shared, not copied; it stays out of ``repr``.

    ``params`` is engine-specific and opaque to headwater: it travels from the prefill
    reply to the decode worker untouched (vLLM's ``kv_transfer_params``, SGLang's
    bootstrap host, port and room). Values are JSON-like: None, bool, int, float, str,
    bytes, and lists and str-keyed dicts of those; the TCP codec enforces that, a
    nesting depth and a size bound. In-process the mapping is shared, not copied, so
    nobody may mutate it: it is typed read-only, but a dict underneath. It stays out of
    ``repr`` (it may be large) and out of the hash (a dict has none); equality compares
    it. Empty when the sender has none (an older peer).

    ``holds_prompt``: the holder keeps the prompt's token ids with the KV (the
    ``num_tokens`` tokens it prefilled) and hands them over with a pull that asks. A
    decode leg carrying such a handle is a request for that same prompt, so over TCP it
    may leave its ids out (:attr:`GenerateRequest.prompt_in_kv`) and the decode worker
    takes them from the pull: the prompt crosses the plane from the frontend once. False
    from an engine whose KV moves outside the plane (vLLM's NIXL) and from an older peer.
    """

    worker_id: str
    address: str
    transfer_id: str
    num_tokens: int
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    block_size: int = 0
    # Any, not a recursive JSON type: the contents belong to the engine that reads them,
    # which knows their shape; the codec checks the shape at the process boundary. A
    # plain dict, not a MappingProxyType: a proxy guards only the top level (nested
    # lists and dicts stay mutable), costs a wrapper per handle and needs a copy to pack.
    params: Mapping[str, Any] = field(default_factory=dict, repr=False, hash=False)
    holds_prompt: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request as a worker sees it: token ids in, token ids out.

    ``token_ids`` is a token array (``headwater.wire.tokens``) on the serving path;
    engines accept any sequence of ints and never write to it. It is empty on a decode
    leg whose prompt comes with its KV pull (:attr:`prompt_in_kv`).
    """

    request_id: str
    model: str
    token_ids: Sequence[int]
    sampling: SamplingParams
    kv_handle: KvHandle | None = None  # set on the decode leg of a disaggregated request
    eos_token_ids: tuple[int, ...] = ()
    # W3C trace context of the frontend's span for this leg ("": not traced): the
    # worker's spans are its children (headwater.tracing; the codec validates both).
    traceparent: str = ""
    tracestate: str = ""

    @property
    def prompt_in_kv(self) -> bool:
        """The prompt's ids are not here but with the KV the handle names: the engine
        pulls them with it (``KvTransfer.pull_with_prompt``). Why: the prefill worker
        already holds the prompt, so a decode leg sent over TCP leaves out the ~160 KB
        of a 40k-token prompt's ids instead of sending them a second time."""
        handle = self.kv_handle
        return handle is not None and handle.holds_prompt and not self.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length, whether its ids are here or come with the KV."""
        handle = self.kv_handle
        if handle is not None and handle.holds_prompt and not self.token_ids:
            return handle.num_tokens
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as it reports it (with its heartbeat answers): requests its engine
    runs and has waiting, and the share of its KV cache in use (0 to 1)."""

    active: int
    waiting: int
    kv_usage: float


@dataclass(frozen=True, slots=True)
class Ack:
    """The worker decoded the request; engine work has not necessarily started."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """Newly generated tokens (possibly none, e.g. a prefill's handle-only answer).

    ``finish_reason`` is set on the last chunk of a stream. ``cached_tokens`` reports
    prompt tokens served from the prefix cache, for usage accounting.

    When the request asked (:class:`SamplingParams`), ``logprobs`` holds one entry per
    token of ``token_ids``, and the first chunk with tokens carries ``prompt_logprobs``:
    one entry per prompt token from the second on (the first has nothing before it).
    None otherwise.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    kv_handle: KvHandle | None = None
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class End:
    """The stream finished normally; no more messages for this request."""

    request_id: str


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # the worker could not use the request: do not retry
    OVERLOADED = "overloaded"  # try another worker
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # the decode leg could not pull KV
    SHUTTING_DOWN = "shutting_down"  # draining: try another worker
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class Error:
    """The worker gave up on this request. The stream ends with it."""

    request_id: str
    code: ErrorCode
    message: str

    @property
    def retryable(self) -> bool:
        return self.code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN)


@dataclass(frozen=True, slots=True)
class Cancel:
    """The caller no longer wants this request; the worker stops and frees its KV."""

    request_id: str


#: What a worker sends back for one request, in order: Ack, Chunk*, (End | Error).
Reply = Ack | Chunk | End | Error
