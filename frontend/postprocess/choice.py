"""One choice of a response: everything that turns its tokens into what it sends.

A response has ``n`` choices, each generated on its own; each has one
:class:`ChoiceStream`, the one object holding that choice's postprocessing state: its
text (:class:`~frontend.postprocess.TextPostprocessor`: detokenizer and stop strings),
its logprobs (:mod:`.logprobs`: a token's go out with the step that sends its text, so
the logprobs a chunk carries are those of the tokens whose text it carries, and
tokens cut by a stop string are not reported), and completions' ``echo`` (the prompt's
text and logprob entries, before the first step's). Stages that act per choice join it
here.

Pure computation, no I/O; one instance per choice, fed from the task that consumes
that choice's tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend.postprocess import TextPostprocessor, TextStep
from frontend.postprocess.logprobs import LogprobEntry, TokenTexts
from headwater.wire import TokenLogprobs

__all__ = ["ChoiceStep", "ChoiceStream", "Echo", "echo"]


@dataclass(frozen=True, slots=True)
class Echo:
    """What completions' ``echo`` puts before a choice's answer: the prompt's text and,
    with logprobs, an entry per prompt token (the first without logprobs)."""

    text: str
    entries: tuple[LogprobEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class ChoiceStep:
    """What a step adds to the choice: text to send, whether a stop string ended it,
    and the logprob entries of the tokens whose text this step sends."""

    text: str
    stopped: bool
    logprobs: tuple[LogprobEntry, ...] = ()


class ChoiceStream:
    """One choice's postprocessing (see the module docstring).

    *texts*: the token texts for logprob entries; None when the request asked for no
    logprobs (then :meth:`step` ignores the logprobs it is given). *echo*: what goes
    before the first step's text.
    """

    def __init__(
        self,
        index: int,
        post: TextPostprocessor,
        texts: TokenTexts | None = None,
        echo: Echo | None = None,
    ) -> None:
        self.index = index
        self._post = post
        self._texts = texts
        self._echo = echo
        self._shift = len(echo.text) if echo else 0  # the answer's text comes after
        self._fed = 0  # tokens fed so far: the next one's output index
        self._pending: deque[tuple[int, int, TokenLogprobs]] = deque()  # (index, id, lps)

    @property
    def completion_tokens(self) -> int:
        return self._post.completion_tokens

    @property
    def stopped(self) -> bool:
        return self._post.stopped

    def step(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None = None
    ) -> ChoiceStep:
        """Take the next tokens (and their logprobs, one each, when asked)."""
        if self._texts is not None and logprobs is not None:
            pairs = zip(token_ids, logprobs, strict=True)
            self._pending.extend((self._fed + i, t, lp) for i, (t, lp) in enumerate(pairs))
        self._fed += len(token_ids)
        return self._out(self._post.step(token_ids))

    def finish(self) -> ChoiceStep:
        """The choice's stream ended: what was held back (see
        :meth:`~frontend.postprocess.TextPostprocessor.finish`)."""
        return self._out(self._post.finish_step())

    def _out(self, step: TextStep) -> ChoiceStep:
        text, entries = step.text, self._entries(step.tokens)
        if self._echo is not None:  # the first output: the prompt's goes first
            echo, self._echo = self._echo, None
            text, entries = echo.text + text, echo.entries + entries
        return ChoiceStep(text, step.stopped, entries)

    def _entries(self, released: tuple[tuple[int, int], ...]) -> tuple[LogprobEntry, ...]:
        if self._texts is None or not released:
            return ()
        pending, entries = self._pending, []
        for index, offset in released:
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
