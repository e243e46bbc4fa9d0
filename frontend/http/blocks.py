"""The answer as a sequence of blocks: what Anthropic's and the Responses API build on.

The pipeline's deltas carry three streams at once (``reasoning``, ``text`` and
``tool_calls`` steps, :class:`~frontend.pipeline.Delta`). Anthropic's Messages API and
OpenAI's Responses API both answer with an ordered list of parts instead: a thinking
block or reasoning item, a text block or message, a tool-use block or function call,
each opened, filled and closed in turn. :class:`BlockTracker` makes that list from the
deltas, once for both APIs: each format only names and serializes the events.

Order: a new kind of content closes the open block and opens one of its kind; within
one delta, reasoning comes before text and text before tool calls (the order a model
writes them in). A tool call's first step opens its block; its argument fragments fill
it, whichever block is open (parsers finish a call before they start the next).

``max_tool_calls`` honours a client's "one call at most" (Anthropic's
``disable_parallel_tool_use``, the Responses API's ``parallel_tool_calls: false`` and
``max_tool_calls``): calls past it are left out of the answer.

Pure computation, no I/O; one tracker per response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from frontend.pipeline import Delta

Kind = Literal["reasoning", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    """One part of the answer: its place, its kind, and its text so far (the reasoning,
    the text, or a tool call's arguments JSON)."""

    index: int  # its place among the answer's blocks, from 0
    kind: Kind
    pieces: list[str] = field(default_factory=list)
    call_id: str | None = None  # a tool call's
    name: str | None = None  # a tool call's
    closed: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True, slots=True)
class Opened:
    block: Block


@dataclass(frozen=True, slots=True)
class Added:
    block: Block
    text: str  # the new piece (not empty)


@dataclass(frozen=True, slots=True)
class Closed:
    block: Block


Event = Opened | Added | Closed


class BlockTracker:
    """Turns the deltas of one response into block events (see the module docstring)."""

    def __init__(self, *, max_tool_calls: int | None = None) -> None:
        self.blocks: list[Block] = []
        self.max_tool_calls = max_tool_calls
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # by the call's index in the answer

    @property
    def tool_calls(self) -> list[Block]:
        """The tool calls answered, in order."""
        return [b for b in self.blocks if b.kind == "tool_call"]

    def feed(self, delta: Delta) -> list[Event]:
        """The events *delta* makes."""
        events: list[Event] = []
        if delta.reasoning:
            self._add("reasoning", delta.reasoning, events)
        if delta.text:
            self._add("text", delta.text, events)
        for step in delta.tool_calls:
            if self.max_tool_calls is not None and step.index >= self.max_tool_calls:
                continue
            call = self._calls.get(step.index)
            if call is None:
                if step.name is None:  # a fragment of a call never opened: nothing to fill
                    continue
                call = self._open_block("tool_call", events)
                call.call_id, call.name = step.id, step.name
                self._calls[step.index] = call
            if step.arguments:
                call.pieces.append(step.arguments)
                events.append(Added(call, step.arguments))
        return events

    def close(self) -> list[Event]:
        """The answer ended: the open block closes."""
        events: list[Event] = []
        self._close(events)
        return events

    def _add(self, kind: Kind, text: str, events: list[Event]) -> None:
        block = self._open
        if block is None or block.kind != kind:
            block = self._open_block(kind, events)
        block.pieces.append(text)
        events.append(Added(block, text))

    def _open_block(self, kind: Kind, events: list[Event]) -> Block:
        self._close(events)
        block = Block(len(self.blocks), kind)
        self.blocks.append(block)
        self._open = block
        events.append(Opened(block))
        return block

    def _close(self, events: list[Event]) -> None:
        if self._open is not None:
            self._open.closed = True
            events.append(Closed(self._open))
            self._open = None
