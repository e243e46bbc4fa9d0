"""Finding markers in streamed text: the one search every parser uses.

A marker (``<think>``, ``<｜DSML｜tool_calls>``, ``</tool_call>``) may arrive split
across pieces, so the end of a piece that could be a marker's start is held back until
the next piece says whether it is one (:meth:`Markers.partial_tail`). Both searches look
at the piece (plus the tail held back before it) only, and the tail check only where a
marker's first character occurs within a marker's length of the end: the cost per piece
is the piece's length, never the length of the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence


class Markers:
    """A set of markers to look for in one state of a parser."""

    __slots__ = ("firsts", "longest", "markers")

    def __init__(self, markers: Sequence[str]) -> None:
        self.markers = tuple(markers)
        self.firsts = tuple({m[0] for m in self.markers if m})
        self.longest = max((len(m) for m in self.markers), default=0)

    def may_start_in(self, text: str) -> bool:
        """Whether a marker's first character occurs in *text* (if not, no marker starts
        there, whole or partial: the common piece, passed on at once). A loop, not any():
        this runs per piece, and a generator costs more than the search."""
        for first in self.firsts:  # noqa: SIM110
            if first in text:
                return True
        return False

    def first(self, text: str) -> tuple[int, str] | None:
        """The earliest complete marker in *text* (the longest at a tie), with its
        position."""
        best: tuple[int, str] | None = None
        for marker in self.markers:
            at = text.find(marker)
            if at < 0:
                continue
            if best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1])):
                best = (at, marker)
        return best

    def partial_tail(self, text: str) -> int:
        """How many characters at the end of *text* are a proper start of some marker
        (0: none), so that they are held back, not emitted as text."""
        window = max(0, len(text) - self.longest + 1)
        start = -1  # the leftmost position a marker could start at
        for first in self.firsts:
            at = text.find(first, window)
            while at >= 0:
                if start < 0 or at < start:
                    tail = text[at:]
                    if any(m.startswith(tail) for m in self.markers):
                        start = at
                        break
                at = text.find(first, at + 1)
        return 0 if start < 0 else len(text) - start


def first_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """:meth:`Markers.first` for a one-off set."""
    return Markers(markers).first(text)


def partial_tail(text: str, markers: Sequence[str]) -> int:
    """:meth:`Markers.partial_tail` for a one-off set."""
    return Markers(markers).partial_tail(text)
