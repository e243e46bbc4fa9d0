"""The one parser every configuration uses: reasoning, then a tool-call format.

:class:`AnswerStream` scans the answer once, with one :class:`~.markers.Markers` set per
state. Outside a tool call the live markers are the reasoning markers (``<think>``,
``</think>``) and the tool format's markers; inside a call, only the format's own.
So there is one held-back tail, never longer than the longest marker, whatever the
combination of parsers.

A tool format (DSML, hermes, ...) is a :class:`ToolFormat`: a small state machine the
stream drives with the text and markers it finds, emitting complete calls into an
:class:`Output`. Reasoning needs no such class: it is two markers and a flag.

Rules common to every format:

- A format's *openers* start a call region from content or reasoning (a call that
  begins inside ``<think>`` ends the reasoning, as DeepSeek-V4 sometimes omits
  ``</think>``). The separator the chat template writes before a call block is part of
  the opener (``"\\n\\n<｜DSML｜tool_calls>"``), so the content a client sends back
  renders to the tokens the model produced.
- Any other marker of the format met outside a call (a stray closer), and a stray
  ``<think>``/``</think>``, is dropped: markup never reaches ``content`` or
  ``reasoning``.
- A call is emitted whole when it closes: its first delta (index, id, name) and its
  arguments. A call still open at the end is completed when the answer ended normally
  and dropped when it was cut by ``max_tokens`` (``finish(truncated=True)``); so a cut
  call is never shown, streaming or not. A held-back partial marker is likewise
  released as text at a normal end and dropped at a cut one.
"""

from __future__ import annotations

import abc
import uuid

from frontend.postprocess.parsers.base import AnswerDelta, AnswerParser, ToolCallDelta
from frontend.postprocess.parsers.markers import Markers

__all__ = ["THINK_END", "THINK_START", "AnswerStream", "Output", "ToolFormat"]

THINK_START = "<think>"
THINK_END = "</think>"


def new_call_id() -> str:
    """A tool call id as OpenAI shapes them: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


class Output:
    """What the parse produced since the last :meth:`take`."""

    __slots__ = ("_calls", "_content", "_reasoning", "calls_made")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self.calls_made = 0

    def content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)

    def call(self, name: str, arguments: str) -> None:
        """A complete tool call: its naming delta, then its arguments."""
        index = self.calls_made
        self.calls_made += 1
        self._calls.append(ToolCallDelta(index, id=new_call_id(), name=name))
        self._calls.append(ToolCallDelta(index, arguments=arguments))

    def take(self) -> AnswerDelta:
        content, reasoning, calls = self._content, self._reasoning, self._calls
        if not (content or reasoning or calls):
            return _EMPTY
        delta = AnswerDelta(
            content=content[0] if len(content) == 1 else "".join(content),
            reasoning=reasoning[0] if len(reasoning) == 1 else "".join(reasoning),
            tool_calls=tuple(calls),
        )
        content.clear()
        reasoning.clear()
        calls.clear()
        return delta


_EMPTY = AnswerDelta()


class ToolFormat(abc.ABC):
    """One tool-call syntax, driven by :class:`AnswerStream`.

    Between calls the format is :attr:`idle` and the stream looks for its
    :attr:`openers` (and drops its :attr:`strays`); once opened, the stream hands it
    every piece of text and every marker of :attr:`live` until it is idle again.
    """

    #: Markers that open a call region from content or reasoning.
    openers: frozenset[str]
    #: The format's other markers, dropped when met outside a call region.
    strays: frozenset[str]
    #: Outside any call region (set by the format on every transition).
    idle: bool = True
    #: The current state's markers while not idle (set by the format).
    live: Markers

    @abc.abstractmethod
    def open(self, opener: str, out: Output) -> None:
        """An opener was found; the format leaves idle."""

    @abc.abstractmethod
    def text(self, text: str, out: Output) -> None:
        """Text inside the region (between markers)."""

    @abc.abstractmethod
    def marker(self, marker: str, out: Output) -> None:
        """One of :attr:`live` was found."""

    @abc.abstractmethod
    def finish(self, truncated: bool, out: Output) -> None:
        """End of the answer inside the region: complete the open call, or drop it
        when ``truncated``; the format is idle after."""


class AnswerStream(AnswerParser):
    """Reasoning (optional) and one tool format (optional) over one scan.

    ``reasoning``: whether ``<think>…</think>`` is parsed. ``reasoning_forced``: the
    answer starts inside the reasoning (the prompt ended in ``<think>``).
    """

    def __init__(
        self, tool_format: ToolFormat | None, *, reasoning: bool, reasoning_forced: bool
    ) -> None:
        self._format = tool_format
        self._in_reasoning = reasoning and reasoning_forced
        think = (THINK_START, THINK_END) if reasoning else ()
        openers = tool_format.openers if tool_format is not None else frozenset()
        strays = tool_format.strays if tool_format is not None else frozenset()
        self._openers = openers
        # Outside a call the same markers are live in content and in reasoning; only
        # what their text becomes differs.
        self._outside = _outside_markers(think, openers, strays)
        self._held = ""
        self._out = Output()

    @property
    def tool_calls_made(self) -> int:
        return self._out.calls_made

    def feed(self, text: str) -> AnswerDelta:
        if not self._held and self._live().absent_from(text):
            self._text(text)  # the common piece: plain text in the current state
            return self._out.take()
        buf = self._held + text
        pos = 0
        while True:
            markers = self._live()
            found = markers.search(buf, pos)
            if found is None:
                cut = markers.held_from(buf, pos)
                self._text(buf[pos:cut])
                self._held = buf[cut:]
                return self._out.take()
            self._text(buf[pos : found.start()])
            self._marker(found.group())
            pos = found.end()

    def finish(self, *, truncated: bool = False) -> AnswerDelta:
        held, self._held = self._held, ""
        if not truncated:
            self._text(held)  # it never became a marker
        # else a partial marker is the start of markup that max_tokens cut: not text
        if self._format is not None and not self._format.idle:
            self._format.finish(truncated, self._out)
        return self._out.take()

    def _live(self) -> Markers:
        fmt = self._format
        return self._outside if fmt is None or fmt.idle else fmt.live

    def _text(self, text: str) -> None:
        if not text:
            return
        fmt = self._format
        if fmt is not None and not fmt.idle:
            fmt.text(text, self._out)
        elif self._in_reasoning:
            self._out.reasoning(text)
        else:
            self._out.content(text)

    def _marker(self, marker: str) -> None:
        fmt = self._format
        if fmt is not None and not fmt.idle:
            fmt.marker(marker, self._out)
        elif marker in self._openers:
            assert fmt is not None
            self._in_reasoning = False
            fmt.open(marker, self._out)
        elif marker == THINK_START:
            self._in_reasoning = True
        elif marker == THINK_END:
            self._in_reasoning = False
        # else: a stray marker of the format, dropped


_OUTSIDE: dict[tuple[frozenset[str], ...], Markers] = {}


def _outside_markers(
    think: tuple[str, ...], openers: frozenset[str], strays: frozenset[str]
) -> Markers:
    """The markers live outside a call, compiled once per configuration."""
    key = (frozenset(think), openers, strays)
    markers = _OUTSIDE.get(key)
    if markers is None:
        markers = _OUTSIDE[key] = Markers((*think, *openers, *strays))
    return markers
