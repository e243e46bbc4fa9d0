"""Postprocessing of generated tokens: ids → text pieces, cut at stop strings.

:class:`IncrementalDetokenizer` (``detokenizer.py``) turns ids into text without ever
splitting a character; :class:`StopMatcher` (``stop.py``) cuts the text at the first stop
string; :class:`TextPostprocessor` chains the two for one response stream and counts its
completion tokens. All pure computation: one instance per stream, called from the task
that consumes the engine's chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend.postprocess.detokenizer import IncrementalDetokenizer
from frontend.postprocess.stop import StopMatcher

__all__ = ["IncrementalDetokenizer", "StopMatcher", "TextPostprocessor", "TextStep"]


@dataclass(frozen=True, slots=True)
class TextStep:
    """What one chunk of tokens adds to the response: ``text`` to send (may be empty) and
    whether a stop string ended the response (finish_reason "stop"; send nothing more)."""

    text: str
    stopped: bool


class TextPostprocessor:
    """Detokenize and stop-match one response stream.

    Feed each chunk's ids to :meth:`step`; at the engine's end of stream call
    :meth:`finish` for the held-back tail. Once a stop string is hit, later steps return
    ``TextStep("", True)`` and are not counted: the caller should cancel the generation.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        special_ids: frozenset[int] = frozenset(),
    ) -> None:
        """Raises ValueError for an empty stop string."""
        self._detok = IncrementalDetokenizer(
            decode, skip_special_tokens=skip_special_tokens, special_ids=special_ids
        )
        self._stop = StopMatcher(stops)
        self._has_stops = bool(stops)
        self._completion_tokens = 0
        self._finished = False

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
        if self._has_stops and len(token_ids) > 1:
            return self._step_each(token_ids)
        self._completion_tokens += len(token_ids)
        text = self._detok.add(token_ids)
        if not text:
            return TextStep("", False)
        out, stopped = self._stop.feed(text)
        return TextStep(out, stopped)

    def _step_each(self, token_ids: Sequence[int]) -> TextStep:
        # A chunk of several tokens (the plane merges waiting ones) is taken one token
        # at a time, so that usage counts up to the token that completed a stop string.
        pieces = []
        for token in token_ids:
            delta = self.step((token,))
            pieces.append(delta.text)
            if delta.stopped:
                return TextStep("".join(pieces), True)
        return TextStep("".join(pieces), False)

    def finish(self) -> str:
        """Release the text still held back (an unfinished character, a partial stop
        string). Check :attr:`stopped` afterwards: the tail may complete a stop string.
        Idempotent."""
        if self._finished or self._stop.stopped:
            self._finished = True
            return ""
        self._finished = True
        out, stopped = self._stop.feed(self._detok.flush())
        return out if stopped else out + self._stop.flush()
