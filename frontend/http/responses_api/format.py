"""The pipeline's deltas as a Responses API answer: a response object, or its events.

Output items come from :class:`~frontend.http.blocks.BlockTracker`, in the order the
model wrote them: ``reasoning`` (the parse stage's reasoning, as ``reasoning_text``
content; ``summary`` stays empty: nothing here summarizes), ``message`` (one
``output_text`` part), ``function_call`` (``call_id``, ``name``, ``arguments``). A
stream is the Responses API's sequence, each event with its ``sequence_number`` from 0
and an ``event:`` line naming its type::

    response.created, response.in_progress          the response, in progress, no output
    response.output_item.added                      per item, empty
    response.content_part.added                     reasoning_text / output_text, empty
    response.reasoning_text.delta | response.output_text.delta
        | response.function_call_arguments.delta
    response.reasoning_text.done | response.output_text.done
        | response.function_call_arguments.done
    response.content_part.done, response.output_item.done
    response.completed                              the whole response (or
                                                    response.incomplete when cut)

An answer cut by ``max_output_tokens`` is ``status: "incomplete"`` with
``incomplete_details.reason`` ``max_output_tokens``, its last item ``incomplete``. An
error after the stream started is an ``error`` event, then ``response.failed``.
``usage.output_tokens_details.reasoning_tokens`` counts the tokens generated up to the
reasoning's end. When the response is complete, *on_done* gets its body and its output
as a chat message, with its id (the store keeps them: :mod:`frontend.http.responses_api.store`).

No I/O; one format per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from frontend.http.blocks import Added, Block, BlockTracker, Closed, Event, Opened
from frontend.http.errors import ApiError
from frontend.http.responses import ResponseFormat
from frontend.http.responses_api.translate import encrypt
from frontend.pipeline import Delta, Prepared
from frontend.request import ParsedRequest

RESPONSE_PREFIX = "resp_"
_ITEM_PREFIX = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}

#: Called with a finished response's id, its body and its output as a chat message.
OnDone = Callable[[str, bytes, dict[str, Any]], None]


def sse(data: dict[str, Any]) -> bytes:
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ResponsesFormat(ResponseFormat[Delta]):
    """A Responses API answer for one request (see the module docstring). *echo* is
    what the response repeats of the request (:class:`.translate.Translated`)."""

    DONE = b""  # a Responses stream ends with its last lifecycle event

    def __init__(
        self,
        prep: Prepared[ParsedRequest],
        *,
        echo: dict[str, Any],
        max_tool_calls: int | None = None,
        encrypted_reasoning: bool = False,
        on_done: OnDone | None = None,
    ) -> None:
        self.id = RESPONSE_PREFIX + prep.request_id
        self.request_id = prep.request_id
        self.model = prep.parsed.model
        self.created = int(prep.created)
        self.prompt_tokens = len(prep.prompt_ids)
        self.echo = echo
        self.encrypted_reasoning = encrypted_reasoning
        self.on_done = on_done
        self.tracker = BlockTracker(max_tool_calls=max_tool_calls)
        self._seq = 0
        self._reasoning_tokens = 0
        self._started = False

    # -- the response object -----------------------------------------------------------

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        last: Delta | None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        usage = None
        if last is not None:
            cached = min(last.cached_tokens, self.prompt_tokens)
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": last.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens},
                "total_tokens": self.prompt_tokens + last.completion_tokens,
            }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def _item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = f"{_ITEM_PREFIX[block.kind]}{self.request_id}_{block.index}"
        if block.kind == "reasoning":
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": [],
                "status": status,
            }
            if status != "in_progress":
                item["content"] = [{"type": "reasoning_text", "text": block.text}]
                if self.encrypted_reasoning:
                    item["encrypted_content"] = encrypt(block.text)
            return item
        if block.kind == "text":
            content = [] if status == "in_progress" else [_output_text(block.text)]
            return {
                "type": "message",
                "id": item_id,
                "role": "assistant",
                "status": status,
                "content": content,
            }
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": block.call_id,
            "name": block.name,
            "status": status,
            "arguments": "" if status == "in_progress" else block.text,
        }

    def _output(self, status: str) -> list[dict[str, Any]]:
        blocks = self.tracker.blocks
        return [
            self._item(
                b, "incomplete" if status == "incomplete" and b is blocks[-1] else "completed"
            )
            for b in blocks
        ]

    def _count(self, delta: Delta) -> None:
        if delta.reasoning:
            self._reasoning_tokens = delta.completion_tokens

    def _done(self, status: str, body: dict[str, Any]) -> bytes:
        data = orjson.dumps(body)
        if self.on_done is not None:
            self.on_done(self.id, data, self._chat_message())
        return data

    def _chat_message(self) -> dict[str, Any]:
        """The output as the chat template's assistant message (what a continuation
        renders)."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        texts = [b.text for b in self.tracker.blocks if b.kind == "text"]
        if texts:
            message["content"] = "".join(texts)
        thoughts = [b.text for b in self.tracker.blocks if b.kind == "reasoning"]
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        if calls := self.tracker.tool_calls:
            message["tool_calls"] = [
                {
                    "id": b.call_id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": b.text or "{}"},
                }
                for b in calls
            ]
        return message

    # -- unary -------------------------------------------------------------------------

    def unary(self, deltas: list[Delta]) -> bytes:
        for d in deltas:
            self._count(d)
            self.tracker.feed(d)
        last = deltas[-1]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        return self._done(status, self._response(status, self._output(status), last))

    # -- stream ------------------------------------------------------------------------

    def _sse(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._seq
        self._seq += 1
        return sse(data)

    def event(self, delta: Delta) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            opening = self._response("in_progress", [], None)
            out += self._sse({"type": "response.created", "response": opening})
            out += self._sse({"type": "response.in_progress", "response": opening})
        self._count(delta)
        events = self.tracker.feed(delta)
        if delta.finish_reason is not None:
            events += self.tracker.close()
        status = "incomplete" if delta.finish_reason == "length" else "completed"
        out += b"".join(self._item_events(e, status) for e in events)
        if delta.finish_reason is not None:
            body = self._response(status, self._output(status), delta)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            self._done(status, body)
            out += self._sse({"type": kind, "response": body})
        return out

    def _item_events(self, e: Event, status: str) -> bytes:
        block, index = e.block, e.block.index
        item_id = f"{_ITEM_PREFIX[block.kind]}{self.request_id}_{index}"
        where = {"item_id": item_id, "output_index": index}
        if isinstance(e, Opened):
            out = self._sse(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": self._item(block, "in_progress"),
                }
            )
            if block.kind != "tool_call":
                part = _empty_part(block)
                out += self._sse(
                    {
                        "type": "response.content_part.added",
                        **where,
                        "content_index": 0,
                        "part": part,
                    }
                )
            return out
        if isinstance(e, Added):
            if block.kind == "tool_call":
                return self._sse(
                    {"type": "response.function_call_arguments.delta", **where, "delta": e.text}
                )
            if block.kind == "text":
                return self._sse(
                    {
                        "type": "response.output_text.delta",
                        **where,
                        "content_index": 0,
                        "delta": e.text,
                        "logprobs": [],
                    }
                )
            return self._sse(
                {
                    "type": "response.reasoning_text.delta",
                    **where,
                    "content_index": 0,
                    "delta": e.text,
                }
            )
        assert isinstance(e, Closed)
        is_last = block is self.tracker.blocks[-1]
        item = self._item(
            block, "incomplete" if status == "incomplete" and is_last else "completed"
        )
        if block.kind == "tool_call":
            out = self._sse(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": block.name,
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if block.kind == "text"
                else "response.reasoning_text.done"
            )
            extra: dict[str, Any] = {"logprobs": []} if block.kind == "text" else {}
            out = self._sse(
                {"type": done, **where, "content_index": 0, "text": block.text, **extra}
            )
            out += self._sse(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
            )
        return out + self._sse(
            {"type": "response.output_item.done", "output_index": index, "item": item}
        )

    def usage(self, last: Delta) -> bytes:
        return b""  # in the last response event

    def error(self, err: ApiError) -> bytes:
        code = err.code or err.type
        out = self._sse({"type": "error", "code": code, "message": err.message, "param": err.param})
        failed = self._response(
            "failed", self._output("completed"), None, {"code": code, "message": err.message}
        )
        return out + self._sse({"type": "response.failed", "response": failed})


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _empty_part(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return _output_text("")
    return {"type": "reasoning_text", "text": ""}
