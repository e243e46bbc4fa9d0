"""Finding markers in a text stream, and the tail that may still become one.

Every parser of the parse stage is a state machine over markers (``<think>``,
``<｜DSML｜invoke``, ``</tool_call>``, ...). In each state some markers are live; a
:class:`Markers` is one state's set, compiled once: :meth:`Markers.search` finds the
next complete marker, :meth:`Markers.held_from` says where a tail that could still be
the start of one begins. The stream holds that tail back, like a partial stop string.

Split independence: the result of scanning must not depend on where the stream was
cut. A marker that occurs inside another one (other than as its suffix) would break it,
as the inner one could complete first and be taken, so such sets are refused.

Pure computation, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["Markers"]


class Markers:
    """One parser state's markers (immutable, shared by every stream)."""

    __slots__ = ("_first", "_prefixes", "_search", "longest", "names")

    def __init__(self, markers: Iterable[str]) -> None:
        """Raises ValueError for an empty marker, or one inside another (not as its
        suffix): either would make the parse depend on how the text was split."""
        names = frozenset(markers)
        if "" in names:
            raise ValueError("a marker must not be empty")
        for inner in names:
            for outer in names:
                if inner != outer and inner in outer and not outer.endswith(inner):
                    raise ValueError(f"marker {inner!r} occurs inside {outer!r}")
        self.names = names
        # Longest first: at one position the regex takes the first alternative that
        # matches, and a marker ending another ("\n\n<x>" and "<x>") must win there.
        ordered = sorted(names, key=lambda m: (-len(m), m))
        self.longest = len(ordered[0]) if ordered else 0
        self._search = (
            re.compile("|".join(map(re.escape, ordered))).search if ordered else None
        )
        self._prefixes = frozenset(m[:i] for m in names for i in range(1, len(m)))
        firsts = sorted({m[0] for m in names})
        self._first = re.compile("[" + "".join(map(re.escape, firsts)) + "]") if firsts else None

    def absent_from(self, text: str) -> bool:
        """No marker starts in ``text``, not even partly (the common piece: one
        C-level scan, then the piece is plain text)."""
        return self._first is None or self._first.search(text) is None

    def search(self, text: str, pos: int) -> re.Match[str] | None:
        """The leftmost complete marker in ``text[pos:]`` (the longest at that place)."""
        return self._search(text, pos) if self._search is not None else None

    def held_from(self, text: str, pos: int) -> int:
        """Where the longest tail of ``text[pos:]`` that is a proper prefix of a marker
        begins; ``len(text)`` when there is none. Looks at the last ``longest - 1``
        characters only, so the cost does not grow with the text."""
        end = len(text)
        if self._first is None:
            return end
        for m in self._first.finditer(text, max(pos, end - self.longest + 1)):
            if text[m.start() :] in self._prefixes:
                return m.start()
        return end
