"""The one streaming parser: reasoning and tool calls out of an answer, any dialect.

A state machine over the answer's text, driven by markers (:mod:`.scan`)::

    CONTENT ──<think>──▶ REASONING ──</think>──▶ CONTENT
    CONTENT or REASONING ──block start──▶ BLOCK ──call start──▶ NAME ──name end──▶ BODY
    BODY ──call end──▶ BLOCK (or AFTER, when the dialect has no block) ──block end──▶ AFTER
    AFTER: whitespace dropped; other text is content again

(a dialect without a name end goes from the call start to BODY; one without a block
accepts a call start in CONTENT.) A tool-call block starting inside the reasoning ends
the reasoning, as vLLM's DeepSeek-V4 parser does: a model that forgot ``</think>``
still calls its tools.

Why a call is sent whole, when its end marker arrives: a call cut by ``max_tokens`` is
then never half-sent, so the stream and the unary answer always agree (the contract in
:mod:`.base`), and an agent never sees a call it must not run. Text outside calls is
released at once but for a possible marker's start.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from frontend.postprocess.parsers.base import AnswerDelta, AnswerParser, ToolCallDelta
from frontend.postprocess.parsers.dialects import Dialect, Schemas
from frontend.postprocess.parsers.scan import Markers

THINK_START = "<think>"
THINK_END = "</think>"


class State(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    BLOCK = "block"  # inside a tool-call block, between calls
    NAME = "name"
    BODY = "body"
    AFTER = "after"  # after calls: whitespace dropped until other text


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    """The request's tools as :data:`~.dialects.Schemas` (name → parameter schemas)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = props if isinstance(props, Mapping) else {}
    return out


class StreamParser(AnswerParser):
    """Reasoning (``<think>`` tags, when *reasoning*) and tool calls (in *dialect*,
    when given) out of one answer stream. ``reasoning_forced``: the prompt opened the
    reasoning, so the answer starts in it."""

    def __init__(
        self,
        dialect: Dialect | None,
        *,
        reasoning: bool,
        tools: Sequence[Any] | None = None,
        reasoning_forced: bool = False,
    ) -> None:
        self._dialect = dialect
        self._reasoning = reasoning
        self._schemas: Schemas = tool_schemas(tools)
        self._state = State.REASONING if reasoning and reasoning_forced else State.CONTENT
        self._held = ""  # a possible marker's start, from the previous piece
        self._name: list[str] = []  # the open call's name and body, as they arrive
        self._body: list[str] = []
        self._calls = 0
        self._in_block = False  # the open call was opened inside a block
        # Whitespace held back: the reasoning's trailing run (dropped where the reasoning
        # ends, as vLLM strips it), and a content that is so far only whitespace (dropped
        # if calls follow: the "\n\n" before a block is not an answer).
        self._reasoning_ws = ""
        self._content_ws = ""
        self._content_started = False
        self._markers = {state: Markers(self._markers_in(state)) for state in State}

    @property
    def tool_calls_made(self) -> int:
        return self._calls

    def _markers_in(self, state: State) -> tuple[str, ...]:
        d, think = self._dialect, self._reasoning
        starts: tuple[str, ...] = ()
        if d is not None:
            bare = (d.call_start,) if d.bare_calls or not d.block_starts else ()
            starts = (*d.block_starts, *bare, *d.strays)
        if state is State.CONTENT or state is State.AFTER:
            return ((THINK_START, THINK_END) if think else ()) + starts
        if state is State.REASONING:
            return (THINK_START, THINK_END, *starts)
        if d is None:
            return ()  # tool states are never entered without a dialect
        if state is State.BLOCK:
            return (d.call_start, *d.block_ends)
        if state is State.NAME:
            return (d.name_end,) if d.name_end else ()
        return (d.call_end, *d.call_ends_also)  # BODY

    # -- the contract --------------------------------------------------------------------

    def feed(self, text: str) -> AnswerDelta:
        buf = self._held + text
        markers = self._markers[self._state]
        if not self._held and not markers.may_start_in(buf):
            # The common piece: no marker can start in it. Content and reasoning go out
            # as they are (but for the whitespace rules), a call's text is kept.
            if self._state is State.CONTENT and self._content_started:
                return AnswerDelta(content=buf)
            if self._state is State.REASONING and not self._reasoning_ws and buf[-1:] > " ":
                return AnswerDelta(reasoning=buf)
        out = _Out()
        self._held = ""
        while buf:
            markers = self._markers[self._state]
            hit = markers.first(buf)
            if hit is None:
                keep = markers.partial_tail(buf)
                self._text(buf[: len(buf) - keep], out)
                self._held = buf[len(buf) - keep :]
                break
            at, marker = hit
            self._text(buf[:at], out)
            self._marker(marker, out)
            buf = buf[at + len(marker) :]
        return out.delta()

    def finish(self, *, truncated: bool = False) -> AnswerDelta:
        """A call still open is dropped: cut by ``max_tokens`` or a stop string
        (*truncated*), or ended without its end marker, it is not a call the model
        finished, and a call is never invented. Text held back is released."""
        out = _Out()
        held, self._held = self._held, ""
        self._text(held, out)
        self._reasoning_ws = ""
        if not self._content_started and not self._calls and self._content_ws:
            out.content.append(self._content_ws)
        self._content_ws = ""
        if self._state in (State.NAME, State.BODY):
            self._name.clear()
            self._body.clear()
            self._state = State.AFTER
        return out.delta()

    # -- the machine -------------------------------------------------------------------------

    def _text(self, text: str, out: _Out) -> None:
        if not text:
            return
        state = self._state
        if state is State.CONTENT:
            self._content(text, out)
        elif state is State.REASONING:
            text = self._reasoning_ws + text
            kept = text.rstrip()
            self._reasoning_ws = text[len(kept) :]
            if kept:
                out.reasoning.append(kept)
        elif state is State.NAME:
            self._name.append(text)
        elif state is State.BODY:
            self._body.append(text)
        elif state is State.AFTER:
            text = text.lstrip()
            if text:
                self._state = State.CONTENT
                self._content(text, out)
        # BLOCK: the whitespace between calls is not content

    def _content(self, text: str, out: _Out) -> None:
        if not self._content_started:
            text = self._content_ws + text
            if not text.strip():
                self._content_ws = text
                return
            self._content_started = True
            self._content_ws = ""
        out.content.append(text)

    def _marker(self, marker: str, out: _Out) -> None:
        state, d = self._state, self._dialect
        if d is not None and marker in d.strays and state in _OUTSIDE_CALLS:
            return  # a stray closer: markup, dropped
        if state is State.REASONING and marker != THINK_START:
            self._reasoning_ws = ""  # the reasoning ends here: its trailing run goes
        if marker == THINK_START:
            if state is not State.REASONING:
                self._state = State.REASONING
            return  # a second <think> inside the reasoning is dropped
        if marker == THINK_END:
            if state is State.REASONING:
                self._state = State.CONTENT
            return  # a stray </think> in the content is dropped
        assert d is not None
        if state in (State.CONTENT, State.REASONING, State.AFTER):
            if not self._content_started:
                self._content_ws = ""  # only whitespace before calls: not an answer
            self._in_block = marker in d.block_starts
            if self._in_block:
                self._state = State.BLOCK
            else:
                self._open(marker)
        elif state is State.BLOCK:
            if marker == d.call_start:
                self._open(marker)
            else:
                self._state = State.AFTER
        elif state is State.NAME:
            self._state = State.BODY
        else:  # BODY: the call ends (its own end, or the block's)
            self._close(out)
            in_block = self._in_block and marker == d.call_end
            self._state = State.BLOCK if in_block else State.AFTER

    def _open(self, marker: str) -> None:
        d = self._dialect
        assert d is not None
        self._state = State.NAME if d.name_end else State.BODY

    def _close(self, out: _Out) -> None:
        d = self._dialect
        assert d is not None
        name, body = "".join(self._name), "".join(self._body)
        self._name.clear()
        self._body.clear()
        call = d.read(name, body, self._schemas)
        if call is None:
            if d.body_is_text:  # not a call: the model's text, kept without the tags
                self._content(body, out)
            return
        index = self._calls
        self._calls += 1
        call_id = "call_" + uuid.uuid4().hex[:24]
        out.calls.append(ToolCallDelta(index, id=call_id, name=call[0]))
        out.calls.append(ToolCallDelta(index, arguments=call[1]))


#: The states outside a call, where a stray closer is dropped.
_OUTSIDE_CALLS = frozenset({State.CONTENT, State.REASONING, State.AFTER})


class _Out:
    """What one piece adds, gathered before it becomes an :class:`AnswerDelta`."""

    __slots__ = ("calls", "content", "reasoning")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def delta(self) -> AnswerDelta:
        return AnswerDelta("".join(self.content), "".join(self.reasoning), tuple(self.calls))
