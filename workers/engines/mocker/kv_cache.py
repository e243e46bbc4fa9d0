"""A paged KV cache with prefix reuse, accounting only (no tensors).

Blocks hold ``block_size`` tokens. A *full* block whose KV has been computed is
registered under a chained hash of its content — ``hash((parent_hash, block_tokens))``
— so a later sequence with the same token prefix shares it instead of recomputing.
Blocks are ref-counted; a registered block whose count drops to 0 stays cached
(``cached_free``) and is evicted least-recently-freed first when a new block is needed.
Partial blocks, and full blocks whose content is already registered elsewhere, are
private to their sequence and return to the free list when released.

Python's tuple hash is used for the chain: deterministic for ints, 64 bits wide, and a
collision only mislabels a simulated cache hit. Not thread-safe; the engine's
scheduler and its request generators share it on one trio thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

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
    leading tokens were found in the prefix cache at allocation.
    """

    __slots__ = ("blocks", "cached_tokens", "freed", "last_hash", "num_hashed", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_tokens = 0
        self.cached_tokens = 0
        self.num_hashed = 0  # leading blocks whose chained hash is known
        self.last_hash = _ROOT_HASH
        self.freed = False


class KvCache:
    """Block allocator with prefix reuse and LRU eviction of unreferenced cached blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # stack; pops block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def allocate(self, token_ids: Sequence[int]) -> BlockTable | None:
        """Reserve slots for *token_ids*, reusing the longest cached prefix of full blocks.

        Returns None, with nothing changed, when the free and evictable blocks cannot
        cover the uncached remainder.
        """
        bs = self.block_size
        n = len(token_ids)
        needed = -(-n // bs)
        hits: list[int] = []
        h = _ROOT_HASH
        revived = 0  # hits that currently sit in the evictable pool
        for i in range(n // bs):
            nh = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            block = self._by_hash.get(nh)
            if block is None:
                break
            hits.append(block)
            revived += self._refcount[block] == 0
            h = nh
        if needed - len(hits) > len(self._free) + len(self._evictable) - revived:
            return None
        table = BlockTable()
        for block in hits:
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
        table.blocks = hits
        table.num_hashed = len(hits)
        table.last_hash = h
        table.cached_tokens = len(hits) * bs
        for _ in range(needed - len(hits)):
            table.blocks.append(self._take_block())
        table.num_tokens = n
        return table

    def append_slot(self, table: BlockTable) -> bool:
        """Grow *table* by one token slot; False (nothing changed) if no block is free."""
        if table.num_tokens == len(table.blocks) * self.block_size:
            if not self._free and not self._evictable:
                return False
            table.blocks.append(self._take_block())
        table.num_tokens += 1
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first *num_computed* tokens for reuse.

        Call as KV gets computed; *token_ids* must be the content the table was
        allocated for (plus appended tokens).
        """
        bs = self.block_size
        full = min(num_computed, table.num_tokens) // bs
        while table.num_hashed < full:
            i = table.num_hashed
            h = hash((table.last_hash, tuple(token_ids[i * bs : (i + 1) * bs])))
            block = table.blocks[i]
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block
            table.last_hash = h
            table.num_hashed += 1

    def free(self, table: BlockTable) -> None:
        """Drop *table*'s references. Idempotent.

        Tail blocks are released first so they are evicted before the prefix they
        extend (a shared system prompt outlives the answers hanging off it).
        """
        if table.freed:
            return
        table.freed = True
        for block in reversed(table.blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.blocks = []
        table.num_tokens = 0

    def statistics(self) -> KvCacheStats:
        cached = len(self._evictable)
        return KvCacheStats(
            used_blocks=self.num_blocks - len(self._free) - cached,
            total_blocks=self.num_blocks,
            cached_free_blocks=cached,
        )

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                del self._by_hash[h]
            self._hash[block] = None
        self._refcount[block] = 1
        return block
