"""Chained block hashes already computed, remembered by content, so that a prompt that
repeats a long prefix is not hashed again block by block.

Hashing is the KV cache's one cost per token (:mod:`.kv_cache`): a 40k-token prompt is
625 blocks, each a tuple of 64 ints to build and hash, ~1 ms of the loop's CPU when the
mocker runs in-process. Most prompts are never looked up again and are hashed lazily,
but a shared system prompt is looked up by every request, and every lookup hashed it all
over again: the shared-prefix scenario cost the engines 3× what distinct prompts did
(``scripts/bench/engine_bench.py``; docs/performance.md).

A chain hash is a pure function of the tokens from the start of the sequence, so what
was computed once stays true: :class:`ChainMemo` keeps, for a few recently hashed
stretches, their tokens and their chain, filed under the chain hash of their first block
(which names the parent too). A later sequence whose block at the same chain position
hashes the same is compared with the stretch's tokens in C (array slices, no int
objects), and the chain of the blocks that are equal is taken as it is. The memo gives
exactly the hashes hashing would: it changes what the cache costs, never what it does.

Bounded: at most :data:`MAX_ENTRIES` stretches and :data:`MAX_TOKENS` tokens in all
(least recently used out first), and only stretches of at least :data:`MIN_BLOCKS` blocks,
where comparing is cheaper than hashing, are kept.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from headwater.wire.tokens import token_array

#: Stretches remembered at most.
MAX_ENTRIES = 16
#: Tokens kept at most over all stretches (4 bytes each in a token array: 4 MiB).
MAX_TOKENS = 1 << 20
#: Shortest stretch worth remembering, in blocks.
MIN_BLOCKS = 8


class _Stretch:
    __slots__ = ("hashes", "tokens")

    def __init__(self, tokens: array[int], hashes: list[int]) -> None:
        self.tokens = tokens  # the stretch's tokens (a token array), a whole number of blocks
        self.hashes = hashes  # their chain: hashes[i] covers block i of the stretch


class ChainMemo:
    """Remembered chains of block hashes, by the chain hash of their first block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._stretches: OrderedDict[int, _Stretch] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._stretches)

    def remember(self, token_ids: Sequence[int], start: int, hashes: list[int]) -> None:
        """Keep *hashes*, the chain of the blocks of *token_ids* from index *start* (a
        block boundary) on, one hash per block. Short chains are not kept."""
        n = len(hashes)
        if n < MIN_BLOCKS:
            return
        self._forget(hashes[0])
        tokens = token_array(token_ids[start : start + n * self.block_size])
        self._stretches[hashes[0]] = _Stretch(tokens, list(hashes))
        self._tokens += len(tokens)
        while self._tokens > MAX_TOKENS or len(self._stretches) > MAX_ENTRIES:
            _, dropped = self._stretches.popitem(last=False)
            self._tokens -= len(dropped.tokens)

    def recall(self, first: int, token_ids: Sequence[int], start: int, limit: int) -> list[int]:
        """The chain hashes of up to *limit* blocks of *token_ids* from index *start* on,
        as far as a remembered stretch filed under *first* (the chain hash of the block
        at *start*, computed by the caller) holds the same tokens; [] if none does.

        A stretch that the tokens leave before its end is cut back to where they part,
        so that the next sequence with the same prefix compares in one pass: what is
        shared is what a prompt's private tail hangs off. One they leave within
        :data:`MIN_BLOCKS` is forgotten.
        """
        stretch = self._stretches.get(first)
        if stretch is None:
            return []
        self._stretches.move_to_end(first)
        bs = self.block_size
        n = _equal_blocks(token_ids, start, stretch.tokens, bs, limit)
        if n < min(limit, len(stretch.hashes)):
            self._forget(first)
            if n >= MIN_BLOCKS:
                self._stretches[first] = _Stretch(stretch.tokens[: n * bs], stretch.hashes[:n])
                self._tokens += n * bs
        return stretch.hashes[:n]

    def _forget(self, key: int) -> None:
        old = self._stretches.pop(key, None)
        if old is not None:
            self._tokens -= len(old.tokens)


def _equal_blocks(a: Sequence[int], start: int, b: array[int], bs: int, limit: int) -> int:
    """How many leading blocks of ``a[start:]`` equal those of *b*, a token array, up
    to *limit*.

    Slices of token arrays compare in C (a typed loop), so the whole run is compared at
    once first (what a repeated prefix needs), and only a run that differs is narrowed
    down, comparing only the part still in doubt each time. Any other sequence is made
    a token array first (an array never equals a list).
    """
    m = min(limit, (len(a) - start) // bs, len(b) // bs)
    if m <= 0:
        return 0
    a = token_array(a[start : start + m * bs])
    # Compare with b itself when it is all compared: two fresh slices of a long prompt
    # would take the second from new pages (glibc's mmap threshold), ~10x the compare.
    if a == (b if len(b) == m * bs else b[: m * bs]):
        return m
    lo, hi = 0, m  # blocks below lo are equal; one in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * bs : mid * bs] == b[lo * bs : mid * bs]:
            lo = mid
        else:
            hi = mid
    return lo
