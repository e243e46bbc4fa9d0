"""The KV cache's memo of chained block hashes: it saves hashing, and changes nothing else.

Unit tests of :class:`ChainMemo` (what it gives back, how it is cut and bounded), and a
differential test: the cache, memo and all, against the naive eager cache of
``test_mocker`` on traffic whose prompts share long prefixes and extend each other, with
every table's chain compared with the one computed from scratch.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from headwater.wire.tokens import token_array
from workers.engines.mocker import chain_memo
from workers.engines.mocker.chain_memo import MIN_BLOCKS, ChainMemo
from workers.engines.mocker.kv_cache import BlockTable, KvCache

from test_mocker import EagerKvCache

BS = 4


def chain(tokens: list[int], start_block: int = 0, parent: int = 0) -> list[int]:
    """The chain hashes of the full blocks of *tokens* from *start_block*, from scratch."""
    h, out = parent, []
    for i in range(start_block, len(tokens) // BS):
        h = hash((h, hash(tuple(tokens[i * BS : (i + 1) * BS]))))
        out.append(h)
    return out


def test_recall_gives_the_chain_of_the_equal_blocks_and_cuts_the_stretch_there() -> None:
    memo = ChainMemo(BS)
    shared = list(range(100, 100 + 12 * BS))
    first = [*shared, *range(1, 1 + 4 * BS)]
    memo.remember(token_array(first), 0, chain(first))
    other = [*shared, *range(500, 500 + 6 * BS)]
    key = chain(other)[0]
    assert memo.recall(key, other, 0, len(other) // BS) == chain(other)[:12]
    # Cut back to the shared part: the next prompt with that prefix is answered whole.
    assert memo.recall(key, first, 0, len(first) // BS) == chain(first)[:12]
    assert memo.recall(key, shared[: 5 * BS], 0, 5) == chain(shared)[:5]  # a shorter one
    assert memo.recall(key + 1, other, 0, 18) == []  # filed under another first block


def test_a_stretch_left_early_is_forgotten_and_short_chains_are_not_kept() -> None:
    memo = ChainMemo(BS)
    tokens = list(range(40 * BS))
    memo.remember(tokens, 0, chain(tokens))
    assert len(memo) == 1
    early = [*tokens[: 2 * BS], *range(9000, 9000 + 30 * BS)]
    assert memo.recall(chain(tokens)[0], early, 0, 32) == chain(tokens)[:2]
    assert len(memo) == 0  # two blocks shared are not worth a comparison each time
    short = tokens[: (MIN_BLOCKS - 1) * BS]
    memo.remember(short, 0, chain(short))
    assert len(memo) == 0


def test_a_stretch_past_a_parent_and_a_list_prompt() -> None:
    memo = ChainMemo(BS)
    tokens = list(range(7, 7 + 30 * BS))
    tail = chain(tokens, 10, parent=chain(tokens)[9])
    memo.remember(token_array(tokens), 10 * BS, tail)
    assert memo.recall(tail[0], tokens, 10 * BS, 20) == tail  # a list compares too


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain_memo, "MAX_ENTRIES", 3)
    monkeypatch.setattr(chain_memo, "MAX_TOKENS", 100 * BS)
    memo = ChainMemo(BS)
    for i in range(5):
        tokens = [i, *range(1000, 1000 + 10 * BS - 1)]
        memo.remember(tokens, 0, chain(tokens))
    assert len(memo) == 3  # the oldest went first
    big = list(range(5000, 5000 + 91 * BS))
    memo.remember(big, 0, chain(big))
    assert len(memo) == 1  # 91 blocks leave no room for another 10
    assert memo.recall(chain(big)[0], big, 0, 91) == chain(big)


@pytest.mark.parametrize("seed", range(8))
def test_cache_with_memo_hits_evicts_and_hashes_as_eager_hashing_would(seed: int) -> None:
    """Prompts from families that extend each other (system prompt, then turns), long
    enough for the memo; chunked commits, decode steps, frees, eviction. Every lookup's
    hits and the block counts after every operation agree with the eager cache, and
    each table's chain is the one computed from scratch."""
    rng = random.Random(seed)
    lazy, eager = KvCache(120, block_size=BS), EagerKvCache(120, BS)
    base = [[rng.randrange(60) for _ in range(rng.randrange(30, 90))] for _ in range(3)]
    families = [[*b, *(rng.randrange(60) for _ in range(rng.randrange(0, 40)))] for b in base]
    families += base
    live: list[tuple[BlockTable, dict[Any, Any], list[int], int]] = []
    memo_used = 0
    for _ in range(1200):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = [*rng.choice(families), *(rng.randrange(60) for _ in range(rng.randrange(9)))]
            table, ref = lazy.allocate(tokens), eager.allocate(tokens)
            assert (table is None) == (ref is None)
            if table is not None and ref is not None:
                assert table.cached_tokens == ref["committed"] * BS
                assert table.hashes == chain(tokens)[: len(table.hashes)]
                live.append((table, ref, tokens, table.cached_tokens))
            memo_used = max(memo_used, len(lazy._memo))
        else:
            i = rng.randrange(len(live))
            table, ref, tokens, computed = live[i]
            if op < 0.65:
                if computed >= len(tokens):
                    assert lazy.append_slot(table) == eager.append_slot(ref)
                    if table.num_tokens > len(tokens):
                        tokens = [*tokens, rng.randrange(60)]
                computed = min(len(tokens), computed + rng.randrange(1, 6 * BS))
                lazy.commit(table, tokens, computed)
                eager.commit(ref, tokens, computed)
                assert table.hashes == chain(tokens)[: len(table.hashes)]
                live[i] = (table, ref, tokens, computed)
            else:
                lazy.free(table)
                eager.free(ref)
                del live[i]
        assert lazy.statistics() == eager.statistics()
    assert memo_used > 0  # the traffic did exercise the memo
