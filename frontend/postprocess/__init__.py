"""Postprocessing of generated tokens: ids → text pieces, cut at stop strings.

:class:`IncrementalDetokenizer` (``detokenizer.py``) turns ids into text without ever
splitting a character; :class:`StopMatcher` (``stop.py``) cuts the text at the first stop
string; :class:`TextPostprocessor` chains the two for one response stream and counts its
completion tokens, and when asked tracks which token's text each piece completes (for
logprobs). A response's choice (``choice.py``) puts that together with its logprobs
(``logprobs.py``). All pure computation: one instance per stream, called from the task
that consumes the engine's chunks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend.postprocess.detokenizer import IncrementalDetokenizer
from frontend.postprocess.stop import StopMatcher

__all__ = ["IncrementalDetokenizer", "StopMatcher", "TextPostprocessor", "TextStep"]


@dataclass(frozen=True, slots=True)
class TextStep:
    """What one chunk of tokens adds to the response: ``text`` to send (may be empty) and
    whether a stop string ended the response (finish_reason "stop"; send nothing more).

    ``tokens`` (when tracking): the tokens whose text this step sends, as (output index,
    where its text begins in the response's text), in order (see
    :class:`TextPostprocessor`)."""

    text: str
    stopped: bool
    tokens: tuple[tuple[int, int], ...] = ()


class TextPostprocessor:
    """Detokenize and stop-match one response stream.

    Feed each chunk's ids to :meth:`step`; at the engine's end of stream call
    :meth:`finish` for the held-back tail. Once a stop string is hit, later steps return
    ``TextStep("", True)`` and are not counted: the caller should cancel the generation.

    With *track_tokens*, each step also says which tokens' text it sends, so that a
    token's logprobs go out with its text: a token is released by the step that sends
    the last character of its text, which may be later than the step that consumed it
    (the detokenizer holds back an unfinished character, the stop matcher a possible
    stop string). A stop string releases the tokens whose text begins before it (the
    last one's text may run into it); tokens wholly within or after it, and skipped
    special tokens (they have no text), are never released. Tracking takes the ids
    one at a time.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        special_ids: frozenset[int] = frozenset(),
        track_tokens: bool = False,
    ) -> None:
        """Raises ValueError for an empty stop string."""
        self._detok = IncrementalDetokenizer(
            decode, skip_special_tokens=skip_special_tokens, special_ids=special_ids
        )
        self._stop = StopMatcher(stops)
        self._has_stops = bool(stops)
        self._completion_tokens = 0
        self._finished = False
        self._track = track_tokens
        self._skipped = frozenset(special_ids) if skip_special_tokens else frozenset()
        self._decoded = 0  # characters out of the detokenizer
        self._sent = 0  # characters out of the stop matcher: the response's text
        self._unplaced: list[int] = []  # tokens whose text the detokenizer still holds
        self._placed: deque[tuple[int, int, int]] = deque()  # (index, start, end) not sent

    @property
    def completion_tokens(self) -> int:
        """Generated tokens consumed so far, special ones included, up to and including
        the token that completed a stop string (what OpenAI's ``usage`` reports)."""
        return self._completion_tokens

    @property
    def stopped(self) -> bool:
        """A stop string ended the response (in a :meth:`step` or in :meth:`finish`)."""
        return self._stop.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the response, if one did."""
        return self._stop.matched

    def step(self, token_ids: Sequence[int]) -> TextStep:
        if self._stop.stopped or self._finished:
            return TextStep("", self._stop.stopped)
        if (self._has_stops or self._track) and len(token_ids) > 1:
            return self._step_each(token_ids)
        index = self._completion_tokens
        self._completion_tokens += len(token_ids)
        text = self._detok.add(token_ids)
        if self._track:
            if token_ids and token_ids[0] not in self._skipped:
                self._unplaced.append(index)
            self._place(text)
        if not text:
            return TextStep("", False)
        out, stopped = self._stop.feed(text)
        return TextStep(out, stopped, self._release(len(out), stopped))

    def _step_each(self, token_ids: Sequence[int]) -> TextStep:
        # A chunk of several tokens (the plane merges waiting ones) is taken one token
        # at a time, so that usage counts up to the token that completed a stop string,
        # and each token's text is known.
        pieces = []
        tokens: list[tuple[int, int]] = []
        for token in token_ids:
            delta = self.step((token,))
            pieces.append(delta.text)
            tokens.extend(delta.tokens)
            if delta.stopped:
                return TextStep("".join(pieces), True, tuple(tokens))
        return TextStep("".join(pieces), False, tuple(tokens))

    def finish(self) -> str:
        """Release the text still held back (an unfinished character, a partial stop
        string). Check :attr:`stopped` afterwards: the tail may complete a stop string.
        Idempotent."""
        return self.finish_step().text

    def finish_step(self) -> TextStep:
        """:meth:`finish`, with the tokens it releases (all that are left, unless the
        tail completes a stop string)."""
        if self._finished or self._stop.stopped:
            self._finished = True
            return TextStep("", self._stop.stopped)
        self._finished = True
        tail = self._detok.flush()
        if self._track:
            self._place(tail, final=True)
        out, stopped = self._stop.feed(tail)
        if not stopped:
            out += self._stop.flush()
        return TextStep(out, stopped, self._release(len(out), stopped))

    def _place(self, text: str, *, final: bool = False) -> None:
        """The detokenizer let out *text*: it is the text of the tokens it held (all of
        them, as tracking adds one id at a time); at the end, even an empty one."""
        if (text or final) and self._unplaced:
            start, end = self._decoded, self._decoded + len(text)
            self._placed.extend((index, start, end) for index in self._unplaced)
            self._unplaced.clear()
        self._decoded += len(text)

    def _release(self, sent: int, stopped: bool) -> tuple[tuple[int, int], ...]:
        """The tokens whose text is now all sent (*sent* more characters); after a stop
        string, those whose text begins before it."""
        if not self._track:
            return ()
        self._sent += sent
        placed, out = self._placed, []
        if stopped:
            while placed and placed[0][1] < self._sent:
                index, start, _ = placed.popleft()
                out.append((index, start))
            placed.clear()
            self._unplaced.clear()
        else:
            while placed and placed[0][2] <= self._sent:
                index, start, _ = placed.popleft()
                out.append((index, start))
        return tuple(out)
