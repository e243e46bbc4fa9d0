"""Streaming detokenization: token ids in, text that is safe to show out.

Byte-level BPE tokens (DeepSeek, GPT-style) carry bytes, not characters: one CJK
character or emoji is often split over two or three tokens, and decoding a window that
ends inside a character yields U+FFFD. :class:`IncrementalDetokenizer` holds such a tail
back until the character completes.

Cost per token is O(1): like vLLM's ``detokenize_incrementally`` it decodes only a short
window ``ids[prefix_offset:]`` and diffs it against ``ids[prefix_offset:read_offset]``
(the text already emitted from that window), never the whole output. The window starts at
the previous emission point rather than at ``read_offset`` so decoders whose output
depends on the preceding token (SentencePiece's leading space) see some context.

Pure computation, no I/O; one instance per stream, not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# An unfinished UTF-8 character has at most 3 of its bytes present, so it starts within the
# last 3 tokens (every byte-level token carries at least one byte).
_MAX_SPLIT_TOKENS = 3


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    Contract (for byte-level decoders, whose output for a split at a character boundary is
    the concatenation of both halves): the concatenation of every :meth:`add` result and
    the final :meth:`flush` equals ``decode(ids)`` for all ids added (less ``special_ids``
    when skipping), for any split of the ids into calls. No piece ends inside a UTF-8
    character; U+FFFD appears only where ``decode`` of the whole would show it (invalid
    bytes), or in the flush of a stream cut off mid-character.

    ``decode`` maps ids to text and must not skip tokens itself for the contract to hold
    when ``skip_special_tokens`` is False (e.g. ``lambda ids: tok.decode(ids,
    skip_special_tokens=False)``). With ``skip_special_tokens`` (the default) ids in
    ``special_ids`` are dropped before decoding, as HF's ``decode(...,
    skip_special_tokens=True)`` drops them.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        skip_special_tokens: bool = True,
        special_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._decode = decode
        self._skip = frozenset(special_ids) if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start; ids before it are never decoded again
        self._read_offset = 0  # ids before it have been emitted as text

    @property
    def token_ids(self) -> list[int]:
        """The ids kept so far (special ids already removed when skipping). Do not mutate."""
        return self._ids

    def add(self, token_ids: Iterable[int]) -> str:
        """Append ids; return the newly completed text ("" while a character is pending)."""
        before = len(self._ids)
        if self._skip:
            self._ids.extend(t for t in token_ids if t not in self._skip)
        else:
            self._ids.extend(token_ids)
        if len(self._ids) == before:
            return ""
        return self._advance(before)

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD) and
        mark everything emitted. Call once at end of stream; later calls return ""."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._window(self._read_offset)
        text = self._window(len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix_text) :]

    def _window(self, end: int) -> str:
        if end == self._prefix_offset:
            return ""
        return self._decode(self._ids[self._prefix_offset : end])

    def _advance(self, before: int) -> str:
        # ``before``: len(ids) at the previous call, whose window was already tried.
        prefix_text = self._window(self._read_offset)
        end = len(self._ids)
        text = self._window(end)
        if text.endswith(_REPLACEMENT):
            # Several new ids at once (a multi-token chunk) may end inside a character while
            # most of their text is complete: look for the last id boundary that ends on a
            # whole character and emit up to it. A window ending in a real character proves
            # the boundary: bytes after it cannot change it.
            end = -1
            lowest = max(self._read_offset, before, len(self._ids) - 1 - _MAX_SPLIT_TOKENS)
            for cut in range(len(self._ids) - 1, lowest, -1):
                candidate = self._window(cut)
                if not candidate.endswith(_REPLACEMENT):
                    end, text = cut, candidate
                    break
            if end < 0:
                return ""
        if len(text) <= len(prefix_text):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        return text[len(prefix_text) :]
