"""The contract of the parse stage: a model's raw answer text in, OpenAI's parts out.

The parse stage runs after the detokenizer and the stop strings, one
:class:`AnswerParser` per response stream (per choice when ``n`` > 1). It splits the
model's text into ``content``, ``reasoning`` (``<think>…</think>``) and tool calls
(DeepSeek-V4's DSML, DeepSeek V3.1/V3.2's formats, hermes' ``<tool_call>{json}</tool_call>``).

Streaming contract, the same for every parser:

- :meth:`AnswerParser.feed` takes the next piece of text and returns what can be said
  of it now. Text that may be the start of a marker is held back, like a partial stop
  string, and released as ``content`` the moment it cannot be one: no markup ever
  reaches ``content`` or ``reasoning``, and plain text is never delayed by more than the
  longest marker's length.
- A tool call's first :class:`ToolCallDelta` carries ``index``, ``id`` and ``name``;
  later ones carry ``arguments`` fragments whose concatenation is the call's final
  arguments JSON (typed by the tool's JSON schema when one was given).
- :meth:`AnswerParser.finish` ends the stream. ``truncated`` (the answer was cut by
  ``max_tokens``) drops a call still open: complete calls are returned, a cut one is
  never invented.
- Concatenating every delta's fields gives what a unary parse of the whole text gives,
  for any split of the text into pieces.
- Cost per :meth:`feed` is proportional to the piece (plus the held-back tail), never
  to the whole text so far.

Pure computation, no I/O; one instance per stream, not thread-safe.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A step of one tool call: its first step names it, later ones add arguments."""

    index: int  # the call's position in the answer's tool calls, from 0
    id: str | None = None  # on the call's first delta only ("call_<hex>")
    name: str | None = None  # on the call's first delta only
    arguments: str = ""  # a fragment of the arguments JSON


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    """What a piece of the answer adds: content, reasoning and tool-call steps."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class AnswerParser(abc.ABC):
    """One response stream's parser (see the module docstring for the contract)."""

    @abc.abstractmethod
    def feed(self, text: str) -> AnswerDelta:
        """Take the next piece of the answer's text; return what can be emitted now."""

    @abc.abstractmethod
    def finish(self, *, truncated: bool = False) -> AnswerDelta:
        """The answer ended: release what is held back. ``truncated``: it was cut by
        ``max_tokens``, so a tool call still open is dropped, not completed."""

    @property
    @abc.abstractmethod
    def tool_calls_made(self) -> int:
        """Complete tool calls so far (finish_reason becomes "tool_calls" when > 0)."""
