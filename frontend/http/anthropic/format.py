"""The pipeline's deltas as Anthropic's answer: a Message, or its event stream.

Content blocks come from :class:`~frontend.http.blocks.BlockTracker`, in the order the
model wrote them: ``thinking`` (the parse stage's reasoning), ``text``, ``tool_use``
(its ``input`` the call's arguments, parsed). A stream is Anthropic's sequence::

    event: message_start        the Message, empty, with the prompt's usage
    event: ping
    event: content_block_start  per block: thinking / text / tool_use, empty
    event: content_block_delta  thinking_delta / text_delta / input_json_delta
    event: content_block_stop
    event: message_delta        stop_reason, stop_sequence, the final usage
    event: message_stop

An answer with no block at all has one empty text block (the shape Anthropic gives an
empty answer; clients read ``content[0]``). Thinking blocks carry an empty
``signature``: headwater does not sign reasoning, and ignores the signatures clients
send back. ``stop_reason``: ``tool_use`` when the model called a tool, ``max_tokens``
when cut by the limit, ``stop_sequence`` (naming it) for a stop sequence, else
``end_turn``. ``usage``: ``input_tokens`` are the prompt's tokens the engine did not
have cached, ``cache_read_input_tokens`` those it had (Anthropic counts them apart),
``cache_creation_input_tokens`` 0 (an engine's prefix cache costs nothing to write).

No I/O; one format per request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson

from frontend.http.anthropic.errors import anthropic_error_body
from frontend.http.blocks import Added, Block, BlockTracker, Closed, Event, Opened
from frontend.http.errors import ApiError
from frontend.http.responses import ResponseFormat
from frontend.pipeline import Delta, Prepared
from frontend.request import ParsedRequest

log = logging.getLogger(__name__)

#: The message id's prefix, as Anthropic's.
MESSAGE_PREFIX = "msg_"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """One event of an Anthropic stream: its ``event:`` line names the data's type."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def stop_reason(last: Delta) -> str:
    """Anthropic's ``stop_reason`` for the pipeline's last delta."""
    if last.finish_reason == "stop" and last.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(last.finish_reason or "", "end_turn")


def tool_input(block: Block) -> dict[str, Any]:
    """A tool call's arguments as ``input``. The parse stage sends a complete call's
    arguments as a JSON object; anything else is kept whole under ``arguments``, as
    the DeepSeek-V4 template reads arguments it cannot parse (and logged: a parser bug)."""
    raw = block.text
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning("tool call %s: arguments are not a JSON object: %.200r", block.name, raw)
    return {"arguments": raw}


class MessagesFormat(ResponseFormat[Delta]):
    """Anthropic's Message and its stream, for one request (see the module docstring).
    *max_tool_calls*: 1 when the client set ``disable_parallel_tool_use``."""

    DONE = b""  # an Anthropic stream ends with message_stop

    def __init__(
        self,
        prep: Prepared[ParsedRequest],
        *,
        max_tool_calls: int | None = None,
        show_thinking: bool = True,
    ) -> None:
        self.show_thinking = show_thinking
        self.id = MESSAGE_PREFIX + prep.request_id
        self.model = prep.parsed.model
        self.prompt_tokens = len(prep.prompt_ids)
        self.tracker = BlockTracker(max_tool_calls=max_tool_calls)
        self._started = False

    def _usage(self, delta: Delta) -> dict[str, int]:
        cached = min(delta.cached_tokens, self.prompt_tokens)
        return {
            "input_tokens": self.prompt_tokens - cached,
            "output_tokens": delta.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[dict[str, Any]], last: Delta, *, done: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": stop_reason(last) if done else None,
            "stop_sequence": last.stop_sequence if done else None,
            "usage": self._usage(last),
        }

    # -- unary -------------------------------------------------------------------------

    def unary(self, deltas: list[Delta]) -> bytes:
        for d in deltas:
            self.tracker.feed(d)
        content = [self._whole(b) for b in self.tracker.blocks] or [{"type": "text", "text": ""}]
        return orjson.dumps(self._message(content, deltas[-1], done=True))

    # -- stream ------------------------------------------------------------------------

    def event(self, delta: Delta) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            start = self._message([], Delta("", 0, cached_tokens=delta.cached_tokens), done=False)
            out += sse("message_start", {"type": "message_start", "message": start})
            out += sse("ping", {"type": "ping"})
        events = self.tracker.feed(delta)
        if delta.finish_reason is not None:
            events += self.tracker.close()
            if not self.tracker.blocks:  # the empty answer's one empty text block
                empty = Block(0, "text", closed=True)
                events += [Opened(empty), Closed(empty)]
        out += b"".join(map(self._event, events))
        if delta.finish_reason is not None:
            out += sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(delta),
                        "stop_sequence": delta.stop_sequence,
                    },
                    "usage": self._usage(delta),
                },
            )
            out += sse("message_stop", {"type": "message_stop"})
        return out

    def usage(self, last: Delta) -> bytes:
        return b""  # in message_delta

    def error(self, err: ApiError) -> bytes:
        return sse("error", anthropic_error_body(err))

    def _whole(self, block: Block) -> dict[str, Any]:
        """A block of a unary Message."""
        if block.kind == "reasoning":
            text = block.text if self.show_thinking else ""
            return {"type": "thinking", "thinking": text, "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text}
        return {
            "type": "tool_use",
            "id": block.call_id,
            "name": block.name,
            "input": tool_input(block),
        }

    def _event(self, e: Event) -> bytes:
        if isinstance(e, Added) and e.block.kind == "reasoning" and not self.show_thinking:
            return b""
        return _event(e)


def _event(e: Event) -> bytes:
    index = e.block.index
    if isinstance(e, Opened):
        b = e.block
        start: dict[str, Any]
        if b.kind == "reasoning":
            start = {"type": "thinking", "thinking": "", "signature": ""}
        elif b.kind == "text":
            start = {"type": "text", "text": ""}
        else:
            start = {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}
        return sse(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        )
    if isinstance(e, Added):
        kind = e.block.kind
        delta = (
            {"type": "thinking_delta", "thinking": e.text}
            if kind == "reasoning"
            else {"type": "text_delta", "text": e.text}
            if kind == "text"
            else {"type": "input_json_delta", "partial_json": e.text}
        )
        return sse(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )
    return sse("content_block_stop", {"type": "content_block_stop", "index": index})
