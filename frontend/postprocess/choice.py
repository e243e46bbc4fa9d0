"""One choice of a response: everything that turns its tokens into what it sends.

A response has ``n`` choices, each generated on its own; each has one
:class:`ChoiceStream`, the one object holding that choice's postprocessing state, in
the order the stages run: its text (:class:`~frontend.postprocess.TextPostprocessor`:
detokenizer and stop strings), completions' ``echo`` (the prompt's text and logprob
entries, before the first output), the parse stage (chat's reasoning and tool calls:
an :class:`~frontend.postprocess.parsers.AnswerParser`), and its logprobs
(:mod:`.logprobs`). A token's logprobs go out with the step that sends its text, so
the logprobs a chunk carries are those of the tokens whose text it carries, and tokens
cut by a stop string are not reported; when the parse stage holds text back (a
possible marker), the logprobs wait with it for the next step it lets out.

Pure computation, no I/O; one instance per choice, fed from the task that consumes
that choice's tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from frontend.postprocess import TextPostprocessor, TextStep
from frontend.postprocess.logprobs import LogprobEntry, TokenTexts
from frontend.postprocess.parsers import AnswerParser, ToolCallDelta
from headwater.wire import TokenLogprobs

__all__ = ["ChoiceStep", "ChoiceStream", "Echo", "echo"]


@dataclass(frozen=True, slots=True)
class Echo:
    """What completions' ``echo`` puts before a choice's answer: the prompt's text and,
    with logprobs, an entry per prompt token (the first without logprobs)."""

    text: str
    entries: tuple[LogprobEntry, ...] = ()


class ChoiceStep(NamedTuple):
    """What a step adds to the choice: its answer's content (``text``; all of it without
    a parse stage), reasoning and tool-call steps, the logprob entries that go with
    them, and, on the choice's last step, ``finish_reason``. False when there is
    nothing to send. (A named tuple: one is made per token, and a tuple is made in C.)"""

    text: str = ""
    logprobs: tuple[LogprobEntry, ...] = ()
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(
            self.text or self.logprobs or self.reasoning or self.tool_calls or self.finish_reason
        )


_NOTHING = ChoiceStep()


class ChoiceStream:
    """One choice's postprocessing (see the module docstring).

    *texts*: the token texts for logprob entries; None when the request asked for no
    logprobs (then :meth:`step` ignores the logprobs it is given). *echo*: what goes
    before the first output. *parser*: the parse stage; None leaves the text as it is.
    """

    def __init__(
        self,
        index: int,
        post: TextPostprocessor,
        *,
        texts: TokenTexts | None = None,
        echo: Echo | None = None,
        parser: AnswerParser | None = None,
    ) -> None:
        self.index = index
        self._post = post
        self._texts = texts
        self._echo = echo
        self._parser = parser
        self._shift = len(echo.text) if echo else 0  # the answer's text comes after
        self._fed = 0  # tokens fed so far: the next one's output index
        self._pending: deque[tuple[int, int, TokenLogprobs]] = deque()  # (index, id, lps)
        self._held: tuple[LogprobEntry, ...] = ()  # entries of text the parser holds
        # Text alone (no logprobs, echo or parser): the common case, kept to one branch
        # per step, as it runs for every token of every answer.
        self._plain = texts is None and echo is None and parser is None

    @property
    def completion_tokens(self) -> int:
        return self._post.completion_tokens

    @property
    def stopped(self) -> bool:
        """A stop string ended the choice."""
        return self._post.stopped

    def step(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None = None,
        finish_reason: str | None = None,
    ) -> ChoiceStep:
        """Take the next tokens (and their logprobs, one each, when asked).
        *finish_reason*: the engine's, on its last tokens. The step that ends the
        choice (that one, or a stop string) has ``finish_reason`` set: the engine's,
        "stop" for a stop string, "tool_calls" when the parse stage found a complete
        call; send nothing after it."""
        if self._texts is not None and logprobs is not None:
            pairs = zip(token_ids, logprobs, strict=True)
            self._pending.extend((self._fed + i, t, lp) for i, (t, lp) in enumerate(pairs))
        self._fed += len(token_ids)
        text = self._post.step(token_ids)
        if text.stopped or finish_reason is not None:
            return self._last(text, finish_reason or "stop")
        if self._plain:
            return ChoiceStep(text.text) if text.text else _NOTHING
        return self._emit(*self._first(text.text, self._entries(text)))

    def _emit(self, text: str, entries: tuple[LogprobEntry, ...]) -> ChoiceStep:
        parser = self._parser
        if parser is None:
            return ChoiceStep(text, entries)
        out = parser.feed(text) if text else None
        if not out:  # all held back: its logprobs wait with it
            self._held += entries
            return ChoiceStep()
        entries, self._held = self._held + entries, ()
        return ChoiceStep(out.content, entries, out.reasoning, out.tool_calls)

    def _last(self, text: TextStep, reason: str) -> ChoiceStep:
        tail = text.text, self._entries(text)
        if not text.stopped:  # the engine's end: what the text stage held back
            rest = self._post.finish_step()
            tail = tail[0] + rest.text, tail[1] + self._entries(rest)
        cut = self._post.stopped  # a stop string, here or in the tail
        reason = "stop" if cut else reason
        content, entries = self._first(*tail)
        entries, self._held = self._held + entries, ()
        parser = self._parser
        if parser is None:
            return ChoiceStep(content, entries, finish_reason=reason)
        head = parser.feed(content) if content else None
        # Cut by a stop string or max_tokens: a tool call still open is dropped.
        end = parser.finish(truncated=cut or reason == "length")
        if parser.tool_calls_made and reason == "stop":
            reason = "tool_calls"
        return ChoiceStep(
            (head.content if head else "") + end.content,
            entries,
            (head.reasoning if head else "") + end.reasoning,
            (head.tool_calls if head else ()) + end.tool_calls,
            reason,
        )

    def _first(
        self, text: str, entries: tuple[LogprobEntry, ...]
    ) -> tuple[str, tuple[LogprobEntry, ...]]:
        """*text* and *entries*, after the echo on the choice's first output."""
        if self._echo is None:
            return text, entries
        echo, self._echo = self._echo, None
        return echo.text + text, echo.entries + entries

    def _entries(self, step: TextStep) -> tuple[LogprobEntry, ...]:
        """The entries of the tokens whose text *step* sends."""
        if self._texts is None or not step.tokens:
            return ()
        pending, entries = self._pending, []
        for index, offset in step.tokens:
            # Tokens before a released one that were not released never will be (special
            # tokens without text): dropped.
            while pending and pending[0][0] < index:
                pending.popleft()
            if pending and pending[0][0] == index:
                _, token_id, lp = pending.popleft()
                entries.append(self._texts.entry(token_id, lp, self._shift + offset))
        return tuple(entries)


def echo(
    text: str | None,
    prompt_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    texts: TokenTexts | None = None,
    prompt_logprobs: Sequence[TokenLogprobs] | None = None,
) -> Echo:
    """Completions' echo of a prompt: *text* as the client sent it (None: the prompt came
    as ids, and is *decode*\\ d, special tokens included), and with *texts* and the
    engine's *prompt_logprobs* (from the second token on) an entry per token, placed in
    the text by decoding the ids one at a time. Costs a decode per prompt token: the
    caller runs a long prompt's in a thread."""
    if texts is None or prompt_logprobs is None:
        return Echo(decode(list(prompt_ids)) if text is None else text)
    post = TextPostprocessor(decode, skip_special_tokens=False, track_tokens=True)
    pieces: list[str] = []
    offsets: dict[int, int] = {}
    for step in (post.step(prompt_ids), post.finish_step()):
        pieces.append(step.text)
        offsets.update(step.tokens)
    lps: list[TokenLogprobs | None] = [None, *prompt_logprobs]
    entries = tuple(
        texts.entry(t, lps[i] if i < len(lps) else None, offsets.get(i, 0))
        for i, t in enumerate(prompt_ids)
    )
    return Echo("".join(pieces) if text is None else text, entries)
