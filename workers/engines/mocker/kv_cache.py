"""A paged KV cache with prefix reuse, accounting only (no tensors).

Blocks hold ``block_size`` tokens. A *full* block whose KV has been computed is
registered under a chained hash of its content — ``hash((parent_hash, hash(block_tokens)))``
— so a later sequence with the same token prefix shares it instead of recomputing.
Blocks are ref-counted; a registered block whose count drops to 0 stays cached
(``cached_free``) and is evicted least-recently-freed first when a new block is needed.
Partial blocks, and full blocks whose content is already registered elsewhere, are
private to their sequence and return to the free list when released.

Cost matters: with the mocker in-process this runs on the frontend's event loop, and a
40k-token prompt is 625 blocks. So blocks move in runs (one slice off the free stack;
an unhashed prompt enters and leaves the evictable pool as one entry, :class:`_Run`;
one tight loop per operation rather than a call per block), and tokens are hashed in
C-level passes (:func:`_block_contents`).

Hashing is the one cost per token, and most prompts are never looked up again, so it is
done lazily. :meth:`KvCache.commit` hashes only the first new block and files the
stretch under that hash as a pending :class:`_Run`; a lookup that arrives at the run's
first hash hashes and registers the whole run then (:meth:`KvCache._materialize`), and
an eviction only shortens it. Every lookup gets the hits eager hashing would give: a
run's blocks are all freed together, tail first, and no lookup can reach past a run's
first block without hashing it. What is known is not hashed twice: a table keeps its
chain as far as computed (:attr:`BlockTable.hashes`), a prefill engine ships it in the
KV handle, and the decode engine hands it to :meth:`KvCache.allocate`. The price is
memory: a pending run keeps its tokens alive until it is hashed or evicted. And what was
hashed once is remembered by content (:mod:`.chain_memo`): a shared system prompt that
every request looks up is compared with the memo's copy in C instead of being hashed
block by block each time.

With a :class:`~headwater.wire.kv_events.KvEventLog` the cache publishes what it stores
and evicts, for KV-aware routing, from the log's first reader on: every full block is
then hashed as it is committed (no pending runs; a block is announced when it becomes
reusable, which a lazy run's blocks are too), and each registered block keeps its
parent, position and tokens for a dump. That trades the lazy hashing's savings for an
exact feed (about as much CPU again as the rest of a 40k-token request's frontend
work: docs/routing.md), so it waits for a reader: a frontend that routes by KV
subscribes as the worker registers, and nobody else pays. Blocks registered before the
first read are not announced (a router can miss them, never see a block that is not
there); the chain hashes are the events' block ids.

Python's int/tuple hash is used for the chain: deterministic for ints (str and bytes
hashes are salted per process, so a chain computed in one worker process is valid in
another), 64 bits wide, and a collision only mislabels a simulated cache hit. Not
thread-safe; the engine's scheduler and its request generators share it on one trio
thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from headwater.wire.kv_events import BlockRemoved, BlockStored, KvEventLog
from headwater.wire.tokens import token_array
from workers.engines.mocker.chain_memo import ChainMemo

_ROOT_HASH = 0  # parent hash of a sequence's first block


@dataclass(frozen=True, slots=True)
class KvCacheStats:
    """A snapshot of block usage. ``used`` blocks have a reference; the rest are free,
    of which ``cached_free`` still hold a reusable prefix."""

    used_blocks: int
    total_blocks: int
    cached_free_blocks: int

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks


class BlockTable:
    """The blocks one sequence holds, in token order. Created by :meth:`KvCache.allocate`.

    ``num_tokens`` is how many token slots are reserved; ``cached_tokens`` how many
    leading tokens were found in the prefix cache at allocation. ``hashes`` holds the
    chained hashes of the leading full blocks as far as they are known: the prefix hits,
    those handed to :meth:`KvCache.allocate`, and every block committed since. Read it,
    never write it.
    """

    __slots__ = (
        "blocks",
        "cached_tokens",
        "freed",
        "hashes",
        "num_committed",
        "num_tokens",
        "run",
    )

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_tokens = 0
        self.cached_tokens = 0
        self.hashes: list[int] = []
        #: Leading blocks registered, found registered, or pending in :attr:`run`.
        self.num_committed = 0
        #: The pending run holding this table's blocks past ``hashes``, if any.
        self.run: _Run | None = None
        self.freed = False


class _Run:
    """Committed full blocks of one sequence whose hashes are not computed yet.

    ``blocks`` are the sequence's blocks ``first``, ``first + 1``, ...; ``key`` is the
    chained hash of the first (the run is filed under it), ``parent`` the one before.
    ``tokens`` holds the sequence's tokens from its block ``first`` on (the sequence's
    own list when that is 0, else a copy of the tail: a run past a shared prefix must
    not keep the whole prompt alive), read when the run is hashed; ``table_hashes`` is
    the owning table's chain, extended then if it still ends where the run starts.
    Evicting blocks cuts them off ``blocks``.

    Its blocks are held by its table alone (no lookup can reach an unhashed block), so
    when the table frees them they all become evictable at once, tail first: the run
    then enters the evictable pool as *one* entry instead of a block each, and eviction
    takes blocks off its tail in a slice. That keeps a 40k-token prompt's release and
    eviction (625 blocks) to a few operations instead of a few per block.
    """

    __slots__ = ("blocks", "first", "key", "parent", "segment", "table_hashes", "tokens")

    def __init__(
        self,
        key: int,
        parent: int,
        first: int,
        blocks: list[int],
        table_hashes: list[int],
    ) -> None:
        self.key = key
        self.parent = parent
        self.first = first
        self.blocks = blocks
        self.tokens: Sequence[int] = ()
        self.table_hashes = table_hashes
        #: Hashed while it waited in the evictable pool: from then on the pool entry is
        #: a *segment* of registered blocks, each live while ``_seg_of[block]`` is it.
        self.segment = False

    def read(self, token_ids: Sequence[int], block_size: int) -> None:
        """Keep what hashing the run will need of *token_ids*, the sequence's tokens."""
        start = self.first * block_size
        self.tokens = token_ids[start:] if start else token_ids


def _block_contents(token_ids: Sequence[int], block_size: int, start: int = 0) -> Iterable[int]:
    """``hash(tuple(block))`` for each full block of *token_ids* from index *start* (a
    block boundary), lazily; a partial last block is skipped.

    Runs of blocks use the itertools "grouper" recipe: ``zip`` over one iterator repeated
    *block_size* times cuts the blocks in C, and since ``map(hash, ...)`` drops each
    block tuple at once, ``zip`` refills one tuple instead of allocating one per block.
    Setting that up costs more than slicing a lone block (a decode step filling one).
    """
    bs = block_size
    remaining = len(token_ids) - start
    if remaining < 2 * bs:
        return [hash(tuple(token_ids[start : start + bs]))] if remaining >= bs else []
    tokens = iter(token_ids)
    if start:
        # List and tuple iterators seek in O(1); slicing would copy the rest of the prompt.
        tokens.__setstate__(start)  # type: ignore[attr-defined]
    return map(hash, zip(*[tokens] * bs, strict=False))


class KvCache:
    """Block allocator with prefix reuse and LRU eviction of unreferenced cached blocks.

    Every block is in exactly one place: held by tables (``_refcount > 0``), on the
    ``_free`` stack (neither hash nor run), or in the evictable pool (unreferenced, with
    a registered hash or in a pending run; ``_n_evictable`` blocks). ``_hash[block]``
    and ``_by_hash`` map registered blocks and hashes both ways; ``_pending`` files
    pending runs by their first hash. No hash is both registered and the key of a
    pending run.

    The pool, ``_evictable``, is ordered least recently freed first; an entry is a block
    or a whole pending run (:class:`_Run`). A run hashed while it waits there stays as
    one entry, a *segment*: ``_seg_of[block]`` names the segment a block still counts
    in, and a block revived by a lookup just stops counting (its place is skipped).
    """

    def __init__(self, num_blocks: int, block_size: int, events: KvEventLog | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._pending: dict[int, _Run] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # stack; pops block 0 first
        self._evictable: OrderedDict[int | _Run, None] = OrderedDict()  # oldest first
        self._n_evictable = 0
        self._seg_of: list[_Run | None] = [None] * num_blocks
        self._memo = ChainMemo(block_size)
        #: Where stored and removed blocks are published (None: no events, lazy hashing).
        self.events = events
        #: Publishing (eager hashing): from the event log's first reader on.
        self._publishing = False
        #: While publishing: each announced hash's (parent hash or None, position, tokens).
        self._stored: dict[int, tuple[int | None, int, Sequence[int]]] = {}
        self._removed: list[int] = []  # hashes unregistered by the eviction under way
        if events is not None:
            events.snapshot = self.snapshot
            events.on_first_read = self._start_publishing
            if events.read_once:
                self._start_publishing()

    def _start_publishing(self) -> None:
        """Switch to eager hashing: the pending runs are hashed now, unannounced (their
        blocks were registered before anyone read), and every commit from here on is
        hashed and announced as it happens."""
        for run in list(self._pending.values()):
            self._materialize(run)
        self._publishing = True

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def allocate(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] = ()
    ) -> BlockTable | None:
        """Reserve slots for *token_ids*, reusing the longest cached prefix of full blocks.

        *block_hashes*, if given, are the chained hashes of the leading full blocks of
        *token_ids* as a cache of the same block size computes them (another table's
        :meth:`prefix_hashes`); they are used instead of hashing those blocks, here and
        in :meth:`commit`, and blocks past them are hashed as usual. Wrong hashes only
        mislabel simulated cache hits. Returns None, with nothing changed, when the free
        and evictable blocks cannot cover the uncached remainder.
        """
        bs = self.block_size
        needed = -(-len(token_ids) // bs)
        full = len(token_ids) // bs
        hashes = list(block_hashes[:full])
        if self._memo and len(hashes) < full:
            self._recall(token_ids, hashes, full)
        by_hash = self._by_hash
        refcount = self._refcount
        hits: list[int] = []
        revived = 0  # hits that currently sit in the evictable pool
        for h in hashes:
            block = by_hash.get(h)
            if block is None and (block := self._materialize_at(h)) is None:
                break
            hits.append(block)
            revived += refcount[block] == 0
        else:
            # Every known hash hit: look further, hashing the content from there on.
            h = hashes[-1] if hashes else _ROOT_HASH
            known = len(hashes)
            for content in _block_contents(token_ids, bs, known * bs):
                nh = hash((h, content))  # the chain; commit computes the same
                block = by_hash.get(nh)
                if block is None and (block := self._materialize_at(nh)) is None:
                    break
                hits.append(block)
                hashes.append(nh)
                revived += refcount[block] == 0
                h = nh
            self._memo.remember(token_ids, known * bs, hashes[known:])
        if needed - len(hits) > len(self._free) + self._n_evictable - revived:
            return None
        evictable = self._evictable
        seg_of = self._seg_of
        for block in hits:
            if refcount[block] == 0:
                if seg_of[block] is None:
                    del evictable[block]
                else:
                    seg_of[block] = None  # its place in the segment is skipped from now on
                self._n_evictable -= 1
            refcount[block] += 1
        table = BlockTable()
        table.num_tokens = len(token_ids)
        table.num_committed = len(hits)
        table.hashes = hashes
        table.cached_tokens = len(hits) * bs
        hits += self._take(needed - len(hits))
        table.blocks = hits
        return table

    def append_slot(self, table: BlockTable) -> bool:
        """Grow *table* by one token slot; False (nothing changed) if no block is free."""
        if table.num_tokens == len(table.blocks) * self.block_size:
            if not self._free and not self._n_evictable:
                return False
            table.blocks += self._take(1)
        table.num_tokens += 1
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first *num_computed* tokens for reuse.

        Call as KV gets computed (in any number of steps); *token_ids*, a sequence of ints,
        must be the content the table was allocated for (plus appended tokens), and
        stay unchanged up to there. A block whose content is already registered under
        another block stays private. Blocks with a known hash are registered at once;
        the rest join a pending run, hashed only if a lookup comes for them.
        """
        bs = self.block_size
        start = table.num_committed
        full = min(num_computed, table.num_tokens) // bs
        if full <= start:
            return
        hashes = table.hashes
        known = min(full, len(hashes))
        if known > start:
            # Blocks past num_committed were taken fresh, so none of them is registered
            # yet: setdefault hands back the very block object it stored iff the hash was
            # new (one dict operation per block instead of a lookup and a store).
            register = self._by_hash.setdefault
            hash_of = self._hash
            new: list[int] = []
            for block, h in zip(table.blocks[start:known], hashes[start:known], strict=True):
                if register(h, block) is block:
                    hash_of[block] = h
                    new.append(h)
            if new and self._publishing:
                self._announce(hashes, start, known, token_ids)
        table.num_committed = full
        if full == known:
            return
        # From here known == len(hashes): the chain is known up to block `known`.
        lo = max(start, known)
        blocks = table.blocks[lo:full]
        if self._publishing:  # published blocks are hashed now, not lazily
            self._register_now(hashes, blocks, token_ids, lo * bs)
            return
        run = table.run
        if run is not None and lo > known:
            # The table's pending run ends at `start`: it grows, and reads the newest
            # list (a caller may pass a longer copy each time).
            run.blocks += blocks
            run.read(token_ids, bs)
        else:
            parent = hashes[-1] if hashes else _ROOT_HASH
            [content] = islice(_block_contents(token_ids, bs, lo * bs), 1)
            key = hash((parent, content))
            if key in self._by_hash or key in self._pending:
                # The content is cached already (a twin committed first): hash it all
                # now, so that what is registered is what eager hashing would register.
                table.run = None
                self._register_now(hashes, blocks, token_ids, lo * bs)
                return
            run = table.run = _Run(key, parent, lo, blocks, hashes)
            run.read(token_ids, bs)
            self._pending[key] = run

    def prefix_hashes(self, table: BlockTable, num_tokens: int) -> tuple[int, ...]:
        """The chained hashes of the full blocks among *table*'s first *num_tokens*
        tokens as far as this cache has computed them, for :meth:`allocate` in another
        cache of the same block size (a decode engine's, for a prompt this one
        prefilled), which hashes the rest itself if it needs them.

        Raises ValueError if some of those blocks have not been committed.
        """
        full = num_tokens // self.block_size
        if full > table.num_committed:
            raise ValueError(f"{full} full blocks asked for, {table.num_committed} committed")
        return tuple(table.hashes[:full])

    def free(self, table: BlockTable) -> None:
        """Drop *table*'s references. Idempotent.

        Tail blocks are released first so they are evicted before the prefix they
        extend (a shared system prompt outlives the answers hanging off it).
        """
        if table.freed:
            return
        table.freed = True
        blocks = table.blocks
        run = table.run
        if run is not None and run.blocks:  # still pending: hashing it would empty it
            # The run's blocks are this table's alone: all of them join the pool now, as
            # one entry, between the blocks after the run and those before it.
            end = run.first + len(run.blocks)
            self._release(blocks[end:])
            refcount = self._refcount
            for block in run.blocks:
                refcount[block] = 0
            self._evictable[run] = None
            self._n_evictable += len(run.blocks)
            self._release(blocks[: run.first])
        else:
            self._release(blocks)
        table.blocks = []
        table.num_tokens = 0

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of *blocks*, tail first; none is in a pending run."""
        refcount = self._refcount
        hash_of = self._hash
        evictable = self._evictable
        push_free = self._free.append
        cached = 0
        for block in reversed(blocks):
            count = refcount[block] - 1
            refcount[block] = count
            if count:
                continue
            if hash_of[block] is None:
                push_free(block)
            else:
                evictable[block] = None
                cached += 1
        self._n_evictable += cached

    def _announce(self, hashes: Sequence[int], lo: int, hi: int, token_ids: Sequence[int]) -> None:
        """Publish the blocks ``lo``..``hi - 1`` of a chain (*hashes*, whose content is
        *token_ids* from its start) that were registered just now, each stretch of
        consecutive ones as one event; twins of registered content are not theirs."""
        bs = self.block_size
        assert self.events is not None
        stored = self._stored
        i = lo
        while i < hi:
            h = hashes[i]
            if h in stored:  # announced before (a twin's block holds the content)
                i += 1
                continue
            j = i
            while j < hi and hashes[j] not in stored:
                parent = hashes[j - 1] if j else None
                stored[hashes[j]] = (parent, j, token_array(token_ids[j * bs : (j + 1) * bs]))
                j += 1
            self.events.publish(
                BlockStored(
                    tuple(hashes[i:j]),
                    hashes[i - 1] if i else None,
                    i,
                    token_array(token_ids[i * bs : j * bs]),
                    bs,
                )
            )
            i = j

    def snapshot(self) -> list[BlockStored]:
        """Every registered block as a stored event, parents before children (for a
        dump: ``headwater.wire.kv_events``). Only with events."""
        bs = self.block_size
        return [
            BlockStored((h,), parent, pos, tokens, bs)
            for h, (parent, pos, tokens) in sorted(self._stored.items(), key=lambda kv: kv[1][1])
        ]

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of *token_ids* a lookup would find cached now,
        without taking them (tests compare a router's index with this)."""
        found = 0
        h = _ROOT_HASH
        for content in _block_contents(token_ids, self.block_size):
            h = hash((h, content))
            if h not in self._by_hash and self._materialize_at(h) is None:
                break
            found += 1
        return found

    def statistics(self) -> KvCacheStats:
        cached = self._n_evictable
        return KvCacheStats(
            used_blocks=self.num_blocks - len(self._free) - cached,
            total_blocks=self.num_blocks,
            cached_free_blocks=cached,
        )

    def _take(self, count: int) -> list[int]:
        """Hand out *count* blocks with refcount 1, unregistered ones first.

        The caller has checked that free plus evictable blocks suffice. Blocks come off
        the top of the free stack as one slice; only the rest evict cached blocks.
        """
        free = self._free
        split = max(len(free) - count, 0)
        blocks = free[split:]
        del free[split:]
        blocks.reverse()  # top of the stack first
        refcount = self._refcount
        for block in blocks:
            refcount[block] = 1
        if len(blocks) < count:
            blocks += self._evict(count - len(blocks))
        return blocks

    def _evict(self, count: int) -> list[int]:
        """Forget the *count* least recently freed cached blocks; return them with
        refcount 1. A run entry gives up its tail first, as its blocks were freed."""
        evictable = self._evictable
        seg_of = self._seg_of
        victims: list[int] = []
        self._removed = []
        need = count
        while need:
            entry, _ = evictable.popitem(last=False)
            if isinstance(entry, int):
                self._unregister(entry)
                victims.append(entry)
                need -= 1
                continue
            blocks = entry.blocks
            if not entry.segment:  # a pending run: nothing in it is hashed yet
                taken = blocks[-need:]
                del blocks[-need:]
                taken.reverse()
                victims += taken
                need -= len(taken)
                if not blocks:
                    del self._pending[entry.key]
            else:  # a hashed run: its blocks that still count, tail first
                while need and blocks:
                    block = blocks.pop()
                    if seg_of[block] is entry:
                        seg_of[block] = None
                        self._unregister(block)
                        victims.append(block)
                        need -= 1
            if blocks:  # not used up: it stays the oldest entry
                evictable[entry] = None
                evictable.move_to_end(entry, last=False)
        self._n_evictable -= count
        refcount = self._refcount
        for block in victims:
            refcount[block] = 1
        if self._removed and self.events is not None:
            self.events.publish(BlockRemoved(tuple(self._removed)))
        return victims

    def _unregister(self, block: int) -> None:
        """Forget *block*'s hash, if it has one (it is being reused)."""
        h = self._hash[block]
        if h is not None:
            del self._by_hash[h]
            self._hash[block] = None
            if self._publishing and self._stored.pop(h, None) is not None:
                self._removed.append(h)

    def _materialize_at(self, h: int) -> int | None:
        """The block registered under *h* once the pending run filed under it, if any,
        is hashed and registered; None if there is none."""
        run = self._pending.get(h)
        if run is None:
            return None
        self._materialize(run)
        return self._by_hash.get(h)

    def _materialize(self, run: _Run) -> None:
        """Hash and register *run*'s blocks, as :meth:`commit` would have."""
        del self._pending[run.key]
        out = run.table_hashes if len(run.table_hashes) == run.first else []
        self._register_now(out, run.blocks, run.tokens, 0, run.parent)
        run.tokens = ()
        if run in self._evictable:
            # Its blocks wait in the pool as this one entry: it stays, as a segment.
            run.segment = True
            seg_of = self._seg_of
            for block in run.blocks:
                seg_of[block] = run
        else:
            run.blocks = []

    def _register_now(
        self,
        hashes: list[int],
        blocks: list[int],
        token_ids: Sequence[int],
        start: int,
        parent: int | None = None,
    ) -> None:
        """Hash *blocks*, whose content is *token_ids* from index *start* (a block
        boundary) on, append their chain to *hashes* and register each whose hash is
        new.

        The chain starts from *parent*, or ``hashes[-1]`` when not given. A pending run
        met on the way is registered first: it was committed before.
        """
        if parent is None:
            parent = hashes[-1] if hashes else _ROOT_HASH
        by_hash = self._by_hash
        register = by_hash.setdefault
        hash_of = self._hash
        pending = self._pending
        push = hashes.append
        chain = self._chain(token_ids, start, parent, len(blocks))
        first = len(hashes)
        for block, h in zip(blocks, chain, strict=False):  # fewer hashes: tokens ran out
            push(h)
            if pending and h in pending:
                self._materialize(pending[h])
            if register(h, block) is block:
                hash_of[block] = h
        if self._publishing and len(hashes) > first and start == first * self.block_size:
            self._announce(hashes, first, len(hashes), token_ids)

    def _chain(self, token_ids: Sequence[int], start: int, parent: int, count: int) -> list[int]:
        """The chain hashes of up to *count* full blocks of *token_ids* from index
        *start* (a block boundary) on, after *parent*: from the memo as far as it
        knows them, hashed past that (and then remembered)."""
        bs = self.block_size
        contents = iter(_block_contents(token_ids, bs, start))
        first = next(contents, None)
        if first is None or count < 1:
            return []
        h = hash((parent, first))
        chain = self._memo.recall(h, token_ids, start, count) if self._memo else []
        if chain:
            if len(chain) == count:
                return chain
            h = chain[-1]
            contents = iter(_block_contents(token_ids, bs, start + len(chain) * bs))
            fresh = len(chain)
        else:
            chain = [h]
            fresh = 0
        for content in islice(contents, count - len(chain)):
            h = hash((h, content))
            chain.append(h)
        # What was hashed here is remembered on its own: a remembered stretch is kept
        # to the prefix that sequences share (ChainMemo.recall).
        self._memo.remember(token_ids, start + fresh * bs, chain[fresh:])
        return chain

    def _recall(self, token_ids: Sequence[int], hashes: list[int], full: int) -> None:
        """Extend *hashes* (the chain of *token_ids*' leading blocks as far as known)
        with what the memo remembers of the blocks after them, up to block *full*.

        Costs one block's hash and a comparison in C, where hashing the blocks would
        cost a tuple of ints per block: a repeated prefix is hashed once, not once per
        request (:mod:`.chain_memo`).
        """
        bs = self.block_size
        while (pos := len(hashes)) < full:
            parent = hashes[-1] if hashes else _ROOT_HASH
            first = hash((parent, hash(tuple(token_ids[pos * bs : (pos + 1) * bs]))))
            known = self._memo.recall(first, token_ids, pos * bs, full - pos)
            if not known:
                return
            hashes += known  # and a stretch remembered after this one may follow
