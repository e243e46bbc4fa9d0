"""What a worker's prefix cache holds, as events: the feed a KV-aware router reads.

An engine says which of its blocks it *stored* (a full block whose KV is computed and
reusable), *removed* (evicted or freed for good) or that it *cleared* everything. Each
event gets the next number of the worker's own sequence, so a reader that missed some
can tell, and asks for a *dump*: every block the worker holds, as one batch that
replaces what the reader knew (``docs/routing.md``).

Engines name blocks by their own ids (an engine's block hash, say) and give each stored
run its tokens; the router hashes the tokens itself (``frontend.router.kv_index``), so
the engine's hash is an identifier, never the key the router looks prompts up by.

:class:`KvEventLog` is the worker's side: a bounded ring of the latest events. A reader
polls it from where it left off (``headwater.plane``: ``kv_poll`` / ``kv_events``
frames on TCP, a direct call in-process); publishing never waits for a reader, and a
reader that falls behind by more than the ring holds gets a *gap* and dumps. So a slow
frontend costs a worker one dump, never a stall. No I/O here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one chain became reusable.

    ``block_ids`` are the engine's ids of the blocks, in chain order; ``parent`` the id
    of the block before the first (None when the first starts its chain); ``position``
    the first block's index in its chain; ``token_ids`` the blocks' tokens,
    ``len(block_ids) * block_size`` of them.
    """

    block_ids: tuple[int, ...]
    parent: int | None
    position: int
    token_ids: Sequence[int] = field(repr=False)
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine no longer holds these blocks (by its ids)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped every block (a reset); a dump also starts with one."""


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """Events ``start``, ``start + 1``, ... ``end - 1`` of one worker.

    ``dump``: the events replace all the reader knew of the worker (they start with
    :class:`AllCleared`), and reading goes on from ``end``. ``gap``: events from the
    asked number on are gone (the ring overflowed, or the worker restarted): no events,
    ask for a dump.
    """

    start: int
    end: int
    events: tuple[KvEvent, ...] = ()
    dump: bool = False
    gap: bool = False


#: Events a worker keeps for its readers; older ones are dropped (a reader that missed
#: them dumps). A stored event holds a run of blocks, so this is thousands of blocks.
DEFAULT_LOG_EVENTS = 4096
#: Most events one poll answers with (the frame stays small; the reader polls again).
DEFAULT_POLL_LIMIT = 512

#: What an engine's cache holds now, as stored events in chain order (parents first).
Snapshot = Callable[[], Iterable[BlockStored]]


class KvEventLog:
    """A worker's bounded event ring: the engine publishes, readers poll or dump.

    Publishing is O(1) and never blocks; the ring's oldest event is dropped when full.
    """

    def __init__(self, capacity: int = DEFAULT_LOG_EVENTS) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._next = 0  # the number the next event gets
        self.snapshot: Snapshot | None = None  # set by the engine that owns the cache
        #: Called once, at the first read: an engine whose events cost it work (the
        #: mocker hashes eagerly to publish) starts publishing only when someone reads.
        self.on_first_read: Callable[[], None] | None = None
        self.read_once = False
        self.published = 0
        self.dumps = 0

    def _first_read(self) -> None:
        if not self.read_once:
            self.read_once = True
            if self.on_first_read is not None:
                self.on_first_read()

    @property
    def next_seq(self) -> int:
        return self._next

    def publish(self, event: KvEvent) -> None:
        self._events.append(event)
        self._next += 1
        self.published += 1

    def read(self, since: int, limit: int = DEFAULT_POLL_LIMIT) -> KvEventBatch:
        """Events from number *since* on, at most *limit*; a dump when *since* is
        negative; a gap when *since* is no longer (or not yet) in the ring."""
        self._first_read()
        if since < 0:
            return self.dump()
        oldest = self._next - len(self._events)
        if since < oldest or since > self._next:
            return KvEventBatch(since, self._next, gap=True)
        lo = since - oldest
        events = tuple(islice(self._events, lo, lo + max(1, limit)))
        return KvEventBatch(since, since + len(events), events)

    def dump(self) -> KvEventBatch:
        """Everything the cache holds now; reading continues from :attr:`next_seq`."""
        self._first_read()
        self.dumps += 1
        stored = tuple(self.snapshot()) if self.snapshot is not None else ()
        return KvEventBatch(self._next, self._next, (AllCleared(), *stored), dump=True)
