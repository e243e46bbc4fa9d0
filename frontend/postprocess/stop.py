"""Stop strings on a text stream.

A stop string may arrive split over any number of pieces ("E", "ND"), so text that could
be the start of one is held back until it either completes (the stream stops there) or
cannot any more (it is released). Stop *token ids* are the engine's business; this is
the text-level half, done in the frontend as OpenAI-compatible servers do.

Pure computation, no I/O; one instance per stream, not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Cuts a text stream at the first stop string.

    Semantics are those of checking after every character: the stream stops at the first
    position where some stop string ends (the longest one if several end there), and the
    output is the text before that stop string, which is itself not emitted (OpenAI's
    behaviour). The result therefore does not depend on how the text is split into
    :meth:`feed` calls.

    Cost per feed is O(len(piece) * len(stops) + L^2) where L is the longest stop string:
    only the held-back tail (shorter than L) is searched again, never the whole stream.
    Setting up is O(total length of the stops): no index of every prefix, which for the
    largest stops the limits allow (16 of 256 characters) cost ~5 ms of the event loop
    per request.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises ValueError for an empty stop string (it would match everywhere)."""
        if isinstance(stops, str):
            stops = [stops]
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        # The stops by their first character: a tail can only be held back for a stop
        # that starts with the tail's first character.
        self._by_first: dict[str, tuple[str, ...]] = {}
        for stop in self._stops:
            self._by_first[stop[0]] = (*self._by_first.get(stop[0], ()), stop)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self._stopped = False
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, once one did."""
        return self._matched

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached).

        After a stop every call returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._pending + text
        end = start = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0:
                stop_end = at + len(stop)
                if end < 0 or stop_end < end or (stop_end == end and at < start):
                    end, start = stop_end, at
        if end >= 0:
            self._pending = ""
            self._stopped = True
            self._matched = buf[start:end]
            return buf[:start], True
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream: release the held tail (it never became a stop string)."""
        out, self._pending = self._pending, ""
        return out

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            candidates = self._by_first.get(buf[-k])
            if candidates is not None:
                tail = buf[-k:]
                # A proper prefix: the whole stop would have been found by the search.
                if any(len(stop) > k and stop.startswith(tail) for stop in candidates):
                    return k
        return 0
