"""vLLM's token-in/token-out API as data: request bodies, stream events, metrics (no I/O).

``POST /inference/v1/generate`` (served with ``--tokens-only`` or
``--enable-scale-out``) takes ``request_id, token_ids, sampling_params, stream,
stream_options, kv_transfer_params``. Streaming is SSE, one event per token::

    data: {"request_id": "generate-tokens-<id>", "choices": [{"token_ids": [42],
           "finish_reason": null, ...}]}
    ...                                     the last token's event has finish_reason
    data: {"choices": [], "usage": {..., "prompt_tokens_details": {"cached_tokens": N}}}
    data: [DONE]

An error after the stream started is an event ``{"error": {"message", "code", ...}}``.
A unary answer is one JSON object with ``choices`` and, on a prefill server's answer,
``kv_transfer_params`` (the stream never carries them).

This module maps headwater's :class:`~headwater.wire.GenerateRequest` onto that body
and vLLM's answers back onto :class:`StreamEvent`, and reads the few series of
``/metrics`` that make a worker's load. The engine (:mod:`.engine`) does the I/O.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from headwater.wire import (
    FinishReason,
    GenerateRequest,
    StructuredKind,
    StructuredOutput,
    TokenLogprobs,
)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
#: vLLM names a token-API request ``generate-tokens-<request_id>`` internally (its
#: abort endpoint wants that name).
VLLM_ID_PREFIX = "generate-tokens-"

#: vLLM's finish reasons that end a stream normally.
FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class ProtocolError(Exception):
    """vLLM answered something this module cannot read."""


class VllmRequestError(Exception):
    """vLLM refused or failed a request: ``status`` (HTTP, or 0 inside a stream)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"vLLM {status or 'stream'}: {message}")
        self.status = status
        self.message = message


def sampling_params(
    request: GenerateRequest, *, max_tokens: int | None = None, prompt_logprobs: bool = False
) -> dict[str, Any]:
    """vLLM's ``sampling_params`` for *request*.

    Exact: temperature, top_p, seed, max_tokens, min_tokens, ignore_eos, the stop
    ids and ``logprobs`` pass as they are; ``prompt_logprobs`` only when asked
    (*prompt_logprobs*: vLLM's stream drops them, so the engine asks for them in a
    request of their own). The request's EOS ids join the stop ids unless
    ``ignore_eos`` (vLLM also stops on its own model's EOS then, from
    generation_config.json; the frontend's come from its tokenizer, and both must
    stop). Stop *strings* never reach vLLM: the frontend matches them on text.

    The declared features map one to one, each only when it asks for something (vLLM's
    defaults are the same neutral values): ``top_k``, ``min_p``, the three penalties,
    ``logit_bias`` (token id → bias), and the structured output as vLLM's
    ``structured_outputs`` (``{"json": schema}``, ``{"json_object": true}``,
    ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}`` or
    ``{"structural_tag": ...}``).
    """
    s = request.sampling
    stop = list(s.stop_token_ids)
    if not s.ignore_eos:
        stop += [t for t in request.eos_token_ids if t not in stop]
    params: dict[str, Any] = {
        "max_tokens": s.max_tokens if max_tokens is None else max_tokens,
        "min_tokens": min(s.min_tokens, s.max_tokens if max_tokens is None else max_tokens),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "ignore_eos": s.ignore_eos,
        "stop_token_ids": stop,
        "detokenize": False,  # token ids out; the frontend detokenizes
    }
    if s.seed is not None:
        params["seed"] = s.seed
    if s.logprobs is not None:
        params["logprobs"] = s.logprobs
    if prompt_logprobs and s.prompt_logprobs is not None:
        params["prompt_logprobs"] = s.prompt_logprobs
    if s.top_k:
        params["top_k"] = s.top_k
    if s.min_p:
        params["min_p"] = s.min_p
    if s.presence_penalty:
        params["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        params["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        params["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.structured is not None:
        params["structured_outputs"] = structured_outputs(s.structured)
    return params


def structured_outputs(structured: StructuredOutput) -> dict[str, Any]:
    """vLLM's ``StructuredOutputsParams`` for *structured*: one constraint, by its name."""
    kind = structured.kind
    if kind is StructuredKind.JSON_OBJECT:
        return {"json_object": True}
    if kind is StructuredKind.CHOICE:
        return {"choice": orjson.loads(structured.spec)}
    return {kind.value: structured.spec}


def generate_body(
    request: GenerateRequest,
    *,
    stream: bool,
    max_tokens: int | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
    prompt_logprobs: bool = False,
    request_id: str | None = None,
) -> bytes:
    """The JSON body of ``POST /inference/v1/generate`` for *request* (under
    *request_id* if given)."""
    ids = request.token_ids
    params = sampling_params(request, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    body: dict[str, Any] = {
        "request_id": request_id or request.request_id,
        "token_ids": ids.tolist() if isinstance(ids, array) else list(ids),
        "sampling_params": params,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class VllmCall:
    """One request to vLLM, whichever way it goes (:mod:`.backend`): *request* under
    *request_id* (its own id if None), streamed or not, with at most *max_tokens*
    (the request's if None), vLLM's *kv_transfer_params*, and the prompt's logprobs
    asked for (*prompt_logprobs*) when the request wants them."""

    request: GenerateRequest
    stream: bool
    max_tokens: int | None = None
    kv_transfer_params: Mapping[str, Any] | None = None
    prompt_logprobs: bool = False
    request_id: str | None = None

    @property
    def id(self) -> str:
        return self.request_id or self.request.request_id

    def sampling_params(self) -> dict[str, Any]:
        """vLLM's ``sampling_params`` for this call (:func:`sampling_params`)."""
        return sampling_params(
            self.request, max_tokens=self.max_tokens, prompt_logprobs=self.prompt_logprobs
        )

    def body(self) -> bytes:
        """The JSON body of ``POST /inference/v1/generate`` (:func:`generate_body`)."""
        return generate_body(
            self.request,
            stream=self.stream,
            max_tokens=self.max_tokens,
            kv_transfer_params=self.kv_transfer_params,
            prompt_logprobs=self.prompt_logprobs,
            request_id=self.request_id,
        )


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a generate stream (or the whole of a unary answer).

    ``finish`` is vLLM's finish reason, as it says it ("stop", "length", "abort",
    ...), on the last token's event; ``cached_tokens`` comes with the usage event
    (None elsewhere); ``done`` marks ``[DONE]``. ``logprobs`` (one per token) and
    ``prompt_logprobs`` (the prompt's from its second token on; a unary answer's) when
    the request asked and the reader was told how many top tokens it asked for.
    """

    token_ids: Sequence[int] = ()
    finish: str | None = None
    cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    done: bool = False
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


DONE = StreamEvent(done=True)


def parse_sse_line(line: str, *, logprobs: int | None = None) -> StreamEvent | None:
    """The event in one SSE line of a generate stream; None for lines without one
    (blank separators, comments). Raises VllmRequestError for an error event,
    ProtocolError for anything unreadable. *logprobs*: as :func:`parse_answer`."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    return parse_answer(data, logprobs=logprobs)


def parse_answer(
    data: str | bytes, *, logprobs: int | None = None, prompt_logprobs: int | None = None
) -> StreamEvent:
    """One JSON answer (a stream event, or a whole unary response) as an event; its
    logprobs read when the request asked for *logprobs* (and *prompt_logprobs*) top
    tokens.

    Raises VllmRequestError for ``{"error": ...}``, ProtocolError otherwise.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {data[:200]!r}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"not an object: {data[:200]!r}")
    if "error" in obj:
        raise VllmRequestError(0, error_message(obj))
    tokens: list[int] = []
    finish = None
    token_logprobs = prompt = None
    choices = obj.get("choices")
    if choices:
        choice = choices[0]
        tokens = choice.get("token_ids") or []
        finish = choice.get("finish_reason")
        if logprobs is not None:
            token_logprobs = read_token_logprobs(choice.get("logprobs"), tokens, logprobs)
    if prompt_logprobs is not None:
        prompt = read_prompt_logprobs(obj.get("prompt_logprobs"), prompt_logprobs)
    cached = None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = details["cached_tokens"]
    params = obj.get("kv_transfer_params")
    return StreamEvent(
        tokens,
        finish,
        cached,
        params if isinstance(params, dict) else None,
        logprobs=token_logprobs,
        prompt_logprobs=prompt,
    )


def _top(
    candidates: list[tuple[int, float, int | None]], top: int
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The *top* most likely of (id, logprob, rank) candidates, most likely first.

    vLLM lists the token at the position first, then the top ones (its dict order),
    so a token ranked below *top* is left out by its rank, and the top list is then
    one short (vLLM cut it to *top* entries with that token in): the rare case
    OpenAI documents as "fewer than asked"."""
    ranked = sorted(
        (c for c in candidates if c[2] is not None and c[2] <= top), key=lambda c: c[2] or 0
    )
    return tuple(c[0] for c in ranked), tuple(c[1] for c in ranked)


def read_token_logprobs(raw: Any, tokens: Sequence[int], top: int) -> tuple[TokenLogprobs, ...]:
    """A choice's ``logprobs`` (``{"content": [{token_id, logprob, rank,
    top_logprobs}]}``, one entry per token) as the plane's entries."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list) or len(content) != len(tokens):
        raise ProtocolError(f"logprobs asked, but the answer's are {str(raw)[:200]!r}")
    try:
        entries = []
        for entry in content:
            candidates = [
                (int(c["token_id"]), float(c["logprob"]), c.get("rank"))
                for c in entry.get("top_logprobs") or ()
            ]
            ids, logprobs = _top(candidates, top)
            entries.append(
                TokenLogprobs(float(entry["logprob"]), int(entry.get("rank") or 0), ids, logprobs)
            )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"unreadable logprobs: {exc!r}") from exc
    return tuple(entries)


def read_prompt_logprobs(raw: Any, top: int) -> tuple[TokenLogprobs, ...]:
    """A unary answer's ``prompt_logprobs`` (``[null, {"<id>": {logprob, rank}}, ...]``:
    each position's own token and the top ones, keyed by id) as the plane's entries,
    from the second position on. The position's own token is the first key (vLLM's
    order)."""
    if not isinstance(raw, list) or not raw or raw[0] is not None:
        raise ProtocolError(f"prompt logprobs asked, but the answer's are {str(raw)[:200]!r}")
    try:
        entries = []
        for position in raw[1:]:
            candidates = [(int(k), float(v["logprob"]), v.get("rank")) for k, v in position.items()]
            own = candidates[0]
            ids, logprobs = _top(candidates, top)
            entries.append(TokenLogprobs(own[1], int(own[2] or 0), ids, logprobs))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ProtocolError(f"unreadable prompt logprobs: {exc!r}") from exc
    return tuple(entries)


def error_message(obj: Any) -> str:
    """The message of vLLM's error body (``{"error": {"message"}}``, or FastAPI's
    ``{"detail"}``), or the body itself."""
    if isinstance(obj, dict):
        error = obj.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        detail = obj.get("detail")
        if detail is not None:
            return str(detail)
    return str(obj)[:500]


def error_from_body(status: int, body: bytes) -> VllmRequestError:
    """The error an HTTP answer of *status* with *body* means."""
    try:
        message = error_message(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = body[:500].decode(errors="replace")
    return VllmRequestError(status, message)


# ---- /metrics ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """The series of vLLM's ``/metrics`` a worker reads (summed over engines).

    ``prompt_tokens_by_source`` maps ``local_compute``, ``local_cache_hit`` and
    ``external_kv_transfer`` to prompt tokens so counted; ``kv_blocks_total`` is 0
    when vLLM does not say (its ``cache_config_info``).
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    block_size: int = 0
    prompt_tokens_by_source: Mapping[str, float] | None = None
    generation_tokens: float = 0.0
    nixl_xfer_seconds_sum: float = 0.0
    nixl_xfer_count: float = 0.0


_SCALARS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:nixl_xfer_time_seconds_sum": "nixl_xfer_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count": "nixl_xfer_count",
}


def parse_metrics(text: str) -> VllmMetrics:
    """Read the Prometheus text of vLLM's ``/metrics``. Lines it does not know are
    skipped; a malformed value counts as 0."""
    values: dict[str, float] = {}
    sources: dict[str, float] = {}
    blocks = block_size = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value_text = line.partition(" ")
            labels = ""
        else:
            labels, _, value_text = rest.rpartition("} ")
        value = _number(value_text)
        key = _SCALARS.get(name)
        if key is not None:
            values[key] = values.get(key, 0.0) + value
        elif name == "vllm:prompt_tokens_by_source_total":
            source = _label(labels, "source")
            if source:
                sources[source] = sources.get(source, 0.0) + value
        elif name == "vllm:cache_config_info":
            blocks += int(_number(_label(labels, "num_gpu_blocks") or "0"))
            block_size = int(_number(_label(labels, "block_size") or "0"))
    return VllmMetrics(
        running=int(values.get("running", 0)),
        waiting=int(values.get("waiting", 0)),
        kv_usage=min(1.0, max(0.0, values.get("kv_usage", 0.0))),
        kv_blocks_total=blocks,
        block_size=block_size,
        prompt_tokens_by_source=sources,
        generation_tokens=values.get("generation_tokens", 0.0),
        nixl_xfer_seconds_sum=values.get("nixl_xfer_seconds_sum", 0.0),
        nixl_xfer_count=values.get("nixl_xfer_count", 0.0),
    )


def _number(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def _label(labels: str, name: str) -> str | None:
    marker = f'{name}="'
    start = labels.find(marker)
    if start < 0 or (start > 0 and labels[start - 1] not in ",{"):
        return None
    start += len(marker)
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else None
