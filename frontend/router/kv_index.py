"""Which worker holds which prefix: the index a KV-aware router looks prompts up in.

**The hash.** The router keys blocks by one documented hash of their tokens, whatever
the engine calls them (docs/routing.md)::

    block_hash(parent, tokens) = int.from_bytes(blake2b(parent as 8 bytes little endian
                                   + tokens as uint32 little endian, digest_size=8), "little")

with ``parent`` 0 for a chain's first block, so a block's hash names its whole prefix.
Blocks are ``block_size`` tokens (fixed per model: the engines' block size); a partial
last block is never cached, so never hashed. BLAKE2b is in C, ~0.5 µs per 64-token
block, and the prompt's hashes are computed beside its encoding, off the loop for long
prompts (:func:`prompt_hashes`).

**The index.** Per worker, its engine's block ids → the block hashes (from stored
events, hashed here from the events' tokens: the engine's own ids are identifiers only),
and per hash the workers holding it. :meth:`KvIndex.overlaps` walks a prompt's hashes
from the first and stops where no worker holds the prefix any more: it costs in
proportion to the prompt's blocks (times the workers still matching), not to the index.

**Keeping it right.** Events come numbered per worker (``headwater.wire.kv_events``);
:meth:`KvIndex.apply` takes each batch and says when the numbers skipped (then the
subscriber asks the worker for a dump, which replaces what was known of it). A worker
that leaves takes its blocks with it (:meth:`KvIndex.remove_worker`). A stored block
whose parent the index does not know (its parent was evicted before it was stored) is
dropped: it is unreachable from a prompt's start anyway until the parent comes back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from headwater.wire.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch
from headwater.wire.tokens import to_uint32_le

#: The parent hash of a chain's first block.
ROOT = 0


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The block hashes (module docstring) of *token_ids*' full blocks after *parent*."""
    data = memoryview(to_uint32_le(token_ids))
    step = 4 * block_size
    out: list[int] = []
    h = parent
    blake = hashlib.blake2b
    for start in range(0, len(data) - step + 1, step):
        digest = blake(h.to_bytes(8, "little"), digest_size=8)
        digest.update(data[start : start + step])
        h = int.from_bytes(digest.digest(), "little")
        out.append(h)
    return out


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """A prompt's block hashes, for the router; called in the tokenizer's thread for a
    long prompt (``frontend.preprocess.pool``)."""
    return tuple(chain_hashes(token_ids, block_size))


@dataclass(slots=True)
class _Worker:
    """What one worker holds: its engine's block ids → hashes, and how many of its ids
    name each hash (an engine may hold the same content twice)."""

    ids: dict[int, int] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    #: The number of the next event expected; None until a dump arrived.
    next_seq: int | None = None


@dataclass(frozen=True, slots=True)
class IndexStats:
    workers: int
    blocks: int  # distinct hashes held by some worker
    events: int  # events applied
    orphans: int  # stored blocks dropped: their parent was unknown
    mismatched: int  # stored events dropped: another block size than the index's


class KvIndex:
    """Block hash → workers, fed by the workers' KV events (module docstring)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[int, set[str]] = {}
        self._events = 0
        self._orphans = 0
        self._mismatched = 0

    # -- feeding --------------------------------------------------------------------

    def next_seq(self, worker_id: str) -> int:
        """The event number to read *worker_id* from; -1 (a dump) when it needs one."""
        w = self._workers.get(worker_id)
        return -1 if w is None or w.next_seq is None else w.next_seq

    def apply(self, worker_id: str, batch: KvEventBatch) -> bool:
        """Apply *batch* of *worker_id*'s events; False when it does not follow on
        from the last one applied (a gap): then what is known of the worker stands
        until a dump replaces it."""
        w = self._workers.setdefault(worker_id, _Worker())
        if batch.gap:
            w.next_seq = None
            return False
        if batch.dump:
            self._clear(worker_id, w)
        elif w.next_seq is None or batch.start != w.next_seq:
            w.next_seq = None
            return False
        for event in batch.events:
            self._events += 1
            match event:
                case BlockStored():
                    self._stored(worker_id, w, event)
                case BlockRemoved():
                    self._removed(worker_id, w, event.block_ids)
                case AllCleared():
                    self._clear(worker_id, w)
        w.next_seq = batch.end
        return True

    def remove_worker(self, worker_id: str) -> None:
        """*worker_id* left: it takes its blocks with it."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._clear(worker_id, w)

    def _stored(self, worker_id: str, w: _Worker, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            self._mismatched += 1
            return
        if event.parent is None:
            parent = ROOT
        elif (known := w.ids.get(event.parent)) is not None:
            parent = known
        else:
            self._orphans += len(event.block_ids)
            return
        hashes = chain_hashes(event.token_ids, self.block_size, parent)
        for block_id, h in zip(event.block_ids, hashes, strict=False):
            old = w.ids.get(block_id)
            if old == h:
                continue
            if old is not None:
                self._drop(worker_id, w, old)
            w.ids[block_id] = h
            count = w.counts.get(h, 0)
            w.counts[h] = count + 1
            if not count:
                self._holders.setdefault(h, set()).add(worker_id)

    def _removed(self, worker_id: str, w: _Worker, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            h = w.ids.pop(block_id, None)
            if h is not None:
                self._drop(worker_id, w, h)

    def _drop(self, worker_id: str, w: _Worker, h: int) -> None:
        count = w.counts[h] - 1
        if count:
            w.counts[h] = count
            return
        del w.counts[h]
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]

    def _clear(self, worker_id: str, w: _Worker) -> None:
        for h in w.counts:
            holders = self._holders[h]
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]
        w.ids.clear()
        w.counts.clear()

    # -- looking up -----------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the prompt's first block, how many of its leading
        blocks (*hashes*, from :func:`prompt_hashes`) it holds."""
        return walk(self._holders.get, hashes)

    def blocks_of(self, worker_id: str) -> int:
        """Distinct blocks *worker_id* holds."""
        w = self._workers.get(worker_id)
        return len(w.counts) if w is not None else 0

    def holds(self, worker_id: str, h: int) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and h in w.counts

    def statistics(self) -> IndexStats:
        return IndexStats(
            workers=len(self._workers),
            blocks=len(self._holders),
            events=self._events,
            orphans=self._orphans,
            mismatched=self._mismatched,
        )


def walk(get: Callable[[int], AbstractSet[str] | None], hashes: Sequence[int]) -> dict[str, int]:
    """The leading-block overlap per worker, walking *hashes* with *get* (hash → the
    workers holding it, or None)."""
    overlap: dict[str, int] = {}
    if not hashes:
        return overlap
    first = get(hashes[0])
    if not first:
        return overlap
    active = set(first)
    depth = 1
    for h in hashes[1:]:
        holders = get(h)
        still = active & holders if holders else set()
        for gone in active - still:
            overlap[gone] = depth
        active = still
        if not active:
            break
        depth += 1
    for wid in active:
        overlap[wid] = depth
    return overlap
