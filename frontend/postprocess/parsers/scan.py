"""Finding markers in streamed text: the one search every parser uses.

A marker (``<think>``, ``<｜DSML｜tool_calls>``, ``</tool_call>``) may arrive split
across pieces, so the end of a piece that could be a marker's start is held back until
the next piece says whether it is one: :func:`partial_tail` measures that tail. Both
look at the piece (plus the tail held back before it) only: the cost per piece is the
piece's length times the markers', never the length of the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest complete marker in *text* (the longest at a tie), with its position."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at < 0:
            continue
        if best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1])):
            best = (at, marker)
    return best


def partial_tail(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of *text* are a proper start of some marker
    (0: none), so that they are held back, not emitted as text."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0
