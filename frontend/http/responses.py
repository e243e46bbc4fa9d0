"""Response bodies, unary and SSE, built from the pipeline's deltas: one format per API.

- :class:`OpenAIFormat`: chat and completions objects and chunks, from text
  :class:`~frontend.pipeline.Delta`\\ s.
- :class:`TokenFormat`: the token-in API's (vLLM's ``GenerateResponse`` and
  ``GenerateStreamResponse``), from :class:`~frontend.pipeline.TokenDelta`\\ s.

Each delta belongs to one choice (``index``; ``n`` of them per request): a unary body
lists the choices by index, a stream sends each delta as an event of its choice.
Logprobs take each API's shape: chat's ``logprobs.content`` entries (token, logprob,
bytes, top_logprobs), completions' columns (tokens, token_logprobs, top_logprobs,
text_offset), the token-in API's vLLM shape (token ids and ranks, and the prompt's in
``prompt_logprobs``).

Kept apart from the routes so the shapes can be read (and tested) in one place; no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Generic

import orjson
from quart import Response

from frontend.http.errors import ApiError
from frontend.pipeline import D, Delta, Prepared, TokenDelta
from frontend.postprocess.logprobs import FLOOR, LogprobEntry, clamp
from frontend.postprocess.parsers import ToolCallDelta
from frontend.request import ParsedRequest, TokenRequest
from headwater.wire import TokenLogprobs

__all__ = ["D", "OpenAIFormat", "ResponseFormat", "TokenFormat"]

#: vLLM's name for a token-in request (``generate-tokens-<request_id>``), which it
#: reports as the response's ``request_id``; headwater reports the same.
TOKEN_RESPONSE_PREFIX = "generate-tokens-"


JSON = "application/json"


def json_response(body: bytes | dict[str, Any], status: int = 200) -> Response:
    """A JSON body (*body* as bytes already, or to serialize) with its content type."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return Response(data, status=status, content_type=JSON)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ResponseFormat(ABC, Generic[D]):
    """How one API answers one request: the body of a unary response, and the events
    of a streaming one (the caller sends ``opening()`` with the first event, one
    ``event()`` per delta, ``usage()`` when the client asked for it, then ``DONE``:
    OpenAI's end marker, which other APIs' streams leave out)."""

    DONE = b"data: [DONE]\n\n"

    @abstractmethod
    def unary(self, deltas: list[D]) -> bytes:
        """The whole response of a non-streaming request; *deltas* ends with the one
        that carries ``finish_reason``."""

    def opening(self) -> bytes:
        """What a stream starts with, before its first delta (nothing, by default)."""
        return b""

    @abstractmethod
    def event(self, delta: D) -> bytes:
        """One SSE event for *delta*."""

    @abstractmethod
    def usage(self, last: D) -> bytes:
        """The SSE event with the request's token counts, after the last delta."""

    def error(self, err: ApiError) -> bytes:
        """An error after the stream started: an event whose data is the error body."""
        return _event(err.body())


class OpenAIFormat(ResponseFormat[Delta]):
    """OpenAI's chat completion and text completion objects, and their chunks.

    The fixed parts of every chunk are built once; each event is one ``bytes``. What the
    parse stage took apart goes where OpenAI's clients read it: reasoning in
    ``reasoning_field`` (``reasoning_content`` by default: DeepSeek's and vLLM's name;
    some clients read ``reasoning``), tool calls in ``tool_calls`` (streamed as OpenAI
    does: a call's first delta has its index, id, type and name, later ones add
    ``arguments`` fragments).
    """

    def __init__(
        self, prep: Prepared[ParsedRequest], *, reasoning_field: str = "reasoning_content"
    ) -> None:
        self.prep = prep
        self.reasoning_field = reasoning_field
        self.chat = prep.parsed.endpoint == "chat"
        self.n = prep.parsed.sampling.n
        self.logprobs = prep.parsed.sampling.logprobs is not None
        self._id = ("chatcmpl-" if self.chat else "cmpl-") + prep.request_id
        self._head = self._fixed("chat.completion.chunk" if self.chat else "text_completion")

    def _fixed(self, obj: str) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": obj,
            "created": int(self.prep.created),
            "model": self.prep.parsed.model,
        }

    def _usage(self, last: Delta) -> dict[str, Any]:
        prompt = len(self.prep.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": last.completion_tokens,
            "total_tokens": prompt + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
        }

    def unary(self, deltas: list[Delta]) -> bytes:
        by_choice: list[list[Delta]] = [[] for _ in range(self.n)]
        for d in deltas:
            by_choice[d.index].append(d)
        choices = [self._choice(i, mine) for i, mine in enumerate(by_choice)]
        head = self._fixed("chat.completion" if self.chat else "text_completion")
        return orjson.dumps({**head, "choices": choices, "usage": self._usage(deltas[-1])})

    def _choice(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        """One choice of a unary body, from its deltas (the last carries its finish)."""
        text = "".join(d.text for d in deltas)
        entries = [e for d in deltas for e in d.logprobs]
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": deltas[-1].finish_reason,
            "logprobs": self._logprobs(entries),
        }
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = "".join(d.reasoning for d in deltas)
            if reasoning:
                message[self.reasoning_field] = reasoning
            if calls := _whole_calls(d.tool_calls for d in deltas):
                message["tool_calls"] = calls
                message["content"] = text or None  # OpenAI's: null beside tool calls
            choice["message"] = message
        else:
            choice["text"] = text
        return choice

    def _logprobs(self, entries: Sequence[LogprobEntry]) -> dict[str, Any] | None:
        """A choice's (or a chunk's) logprobs in the endpoint's shape; None when the
        request asked for none."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries]}
        tops: list[dict[str, float] | None] = []
        for e in entries:
            if e.top is None:  # a prompt's first token (echo)
                tops.append(None)
                continue
            # OpenAI's: the most likely tokens and the token itself (logprobs + 1 at
            # most), the token first as vLLM lists it.
            top = {e.token: FLOOR if e.logprob is None else e.logprob}
            for t in e.top:
                top.setdefault(t.token, t.logprob)
            tops.append(top)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.offset for e in entries],
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _event({**self._head, "choices": choices, **extra})

    def opening(self) -> bytes:
        """Chat streams open with the assistant role, one event per choice, as OpenAI's
        do."""
        if not self.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return b"".join(
            self._chunk([{"index": i, "delta": delta, "finish_reason": None, "logprobs": None}])
            for i in range(self.n)
        )

    def event(self, delta: Delta) -> bytes:
        choice: dict[str, Any] = {
            "index": delta.index,
            "finish_reason": delta.finish_reason,
            "logprobs": self._logprobs(delta.logprobs),
        }
        if self.chat:
            body: dict[str, Any] = {}
            if delta.reasoning:
                body[self.reasoning_field] = delta.reasoning
            if delta.text:
                body["content"] = delta.text
            if delta.tool_calls:
                body["tool_calls"] = [_call_step(c) for c in delta.tool_calls]
            choice["delta"] = body
        else:
            choice["text"] = delta.text
        return self._chunk([choice])

    def usage(self, last: Delta) -> bytes:
        return self._chunk([], usage=self._usage(last))


def _call_step(call: ToolCallDelta) -> dict[str, Any]:
    """One tool-call step of a chat chunk, in OpenAI's streamed shape."""
    function: dict[str, Any] = {"arguments": call.arguments}
    step: dict[str, Any] = {"index": call.index, "function": function}
    if call.id is not None:
        step["id"] = call.id
        step["type"] = "function"
    if call.name is not None:
        function["name"] = call.name
    return step


def _whole_calls(steps: Iterable[tuple[ToolCallDelta, ...]]) -> list[dict[str, Any]]:
    """The tool calls a unary answer made, each put together from its steps."""
    calls: dict[int, dict[str, Any]] = {}
    for batch in steps:
        for step in batch:
            call = calls.setdefault(
                step.index,
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if step.id is not None:
                call["id"] = step.id
            if step.name is not None:
                call["function"]["name"] = step.name
            call["function"]["arguments"] += step.arguments
    return [calls[i] for i in sorted(calls)]


class TokenFormat(ResponseFormat[TokenDelta]):
    """The token-in API's answers, shaped as vLLM's::

        {"request_id": "generate-tokens-<id>",
         "choices": [{"index": 0, "token_ids": [...], "finish_reason": "length",
                      "logprobs": null}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}

    A stream sends one such object per delta, with that delta's new ids (several when
    the plane merged chunks that were waiting) and ``finish_reason`` null but on the
    last; then, if ``stream_options.include_usage``, one with ``"choices": []`` and the
    usage (as vLLM does). ``<id>`` is the client's ``request_id``, else the plane's.
    """

    def __init__(self, prep: Prepared[TokenRequest]) -> None:
        self.prompt_tokens = len(prep.prompt_ids)
        self.prompt_ids = prep.prompt_ids
        self.request_id = TOKEN_RESPONSE_PREFIX + (prep.parsed.request_id or prep.request_id)
        sampling = prep.parsed.sampling
        self.n = sampling.n
        self.top = sampling.logprobs
        self.prompt_top = sampling.prompt_logprobs

    def _usage(self, last: TokenDelta) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "total_tokens": self.prompt_tokens + last.completion_tokens,
        }

    def unary(self, deltas: list[TokenDelta]) -> bytes:
        ids: list[list[int]] = [[] for _ in range(self.n)]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in range(self.n)]
        finish: list[str | None] = [None] * self.n
        prompt = None
        for d in deltas:
            ids[d.index].extend(d.token_ids)
            logprobs[d.index].extend(d.logprobs or ())
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
            prompt = prompt or d.prompt_logprobs
        choices = [
            {
                "index": i,
                "token_ids": ids[i],
                "finish_reason": finish[i],
                "logprobs": self._logprobs(ids[i], logprobs[i]),
            }
            for i in range(self.n)
        ]
        body: dict[str, Any] = {
            "request_id": self.request_id,
            "choices": choices,
            "usage": self._usage(deltas[-1]),
        }
        if self.prompt_top is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(prompt or ())
        return orjson.dumps(body)

    def event(self, delta: TokenDelta) -> bytes:
        choice = {
            "index": delta.index,
            "token_ids": delta.token_ids,
            "finish_reason": delta.finish_reason,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs or ()),
        }
        return _event({"request_id": self.request_id, "choices": [choice]})

    def _logprobs(
        self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
    ) -> dict[str, Any] | None:
        """vLLM's: per token its id, logprob and rank, and ``top_logprobs`` in vLLM's
        order (the token first, then the most likely others), ``logprobs`` long (1 for
        0)."""
        if self.top is None:
            return None
        keep = max(self.top, 1)
        content = []
        for token, lp in zip(ids, logprobs, strict=True):
            top = [_token_logprob(token, lp.logprob, lp.rank)]
            top += [
                _token_logprob(t, v, r)
                for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1)
                if t != token
            ]
            content.append({**top[0], "top_logprobs": top[:keep]})
        return {"content": content}

    def _prompt_logprobs(self, prompt: Sequence[TokenLogprobs]) -> list[dict[str, Any] | None]:
        """vLLM's: null for the first prompt token, then per token a map from token id
        to logprob and rank, the token first."""
        out: list[dict[str, Any] | None] = [None]
        for token, lp in zip(self.prompt_ids[1:], prompt, strict=True):
            entry = {str(token): _prompt_entry(lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                entry.setdefault(str(t), _prompt_entry(v, rank))
            out.append(entry)
        return out

    def usage(self, last: TokenDelta) -> bytes:
        return _event({"request_id": self.request_id, "choices": [], "usage": self._usage(last)})


def _chat_entry(e: LogprobEntry) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": FLOOR if e.logprob is None else e.logprob,
        "bytes": list(e.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top or ()
        ],
    }


def _token_logprob(token: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"token_id": token, "logprob": clamp(logprob), "rank": rank or None}


def _prompt_entry(logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": clamp(logprob), "rank": rank or None, "decoded_token": None}
