"""KV a prefill engine holds for decode workers to pull: hold, release, expiry.

When a prefill engine has computed a prompt it keeps the prompt's blocks and returns a
:class:`~headwater.wire.KvHandle` naming them; the decode worker that gets the handle
pulls, which releases them (:meth:`HeldTransfers.release`). A handle nobody pulls
within ``kv_transfer_timeout`` expires and its blocks are freed
(:meth:`HeldTransfers.expire`).

Every hold gets the same timeout, so insertion order is expiry order: the holds live
in one dict, and one task (``MockerEngine._expire_held``, the trio side) sleeps until
the oldest one's deadline. A timer task per hold cost a spawn and a cancellation per
disaggregated request. This module is bookkeeping only, no trio: callers pass the
time.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from headwater.wire import KvHandle
from workers.engines.mocker.kv_cache import BlockTable, KvCache


@dataclass(slots=True)
class HeldTransfer:
    """The blocks of one prefilled prompt, kept for a pull until *expires_at*, and the
    prompt's ids (the request's own array, not a copy), which a pull may ask for."""

    table: BlockTable
    num_tokens: int
    expires_at: float  # the caller's clock (trio time in the engine)
    tokens: Sequence[int] = ()


class HeldTransfers:
    """The KV a prefill engine holds, by transfer id, oldest (first to expire) first.

    Handles it returns name *worker_id* and *address* (where decode workers reach
    this worker) and carry the prompt's block hashes as far as *cache* computed them,
    so the decode engine need not hash the prompt again. Freeing a hold frees its
    blocks in *cache*; the caller wakes whoever waits for KV.
    """

    def __init__(self, cache: KvCache, timeout: float, worker_id: str, address: str) -> None:
        self._cache = cache
        self._timeout = timeout
        self._worker_id = worker_id
        self._address = address
        self._held: dict[str, HeldTransfer] = {}  # insertion order is expiry order

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, table: BlockTable, num_tokens: int, now: float, tokens: Sequence[int] = ()
    ) -> KvHandle:
        """Keep *table* (its first *num_tokens* tokens computed and committed) until
        ``now + timeout``; return the handle that names it. The hold owns *table* now.
        *tokens*, the prompt (at least *num_tokens* long), is kept with it: the handle
        then says so (``holds_prompt``), and a decode leg need not carry the prompt."""
        transfer_id = uuid.uuid4().hex
        kept = tokens if len(tokens) == num_tokens else ()
        self._held[transfer_id] = HeldTransfer(table, num_tokens, now + self._timeout, kept)
        # The prompt's block hashes known here go along: the decode engine need not
        # recompute them.
        return KvHandle(
            self._worker_id,
            self._address,
            transfer_id,
            num_tokens,
            block_hashes=self._cache.prefix_hashes(table, num_tokens),
            block_size=self._cache.block_size,
            holds_prompt=bool(kept),
        )

    def prompt(self, transfer_id: str) -> Sequence[int] | None:
        """The prompt held with *transfer_id*, or None (none kept, or no such hold)."""
        held = self._held.get(transfer_id)
        return held.tokens if held is not None and held.tokens else None

    def release(self, transfer_id: str) -> int | None:
        """Free the hold under *transfer_id*; return its token count, or None if there
        is none (unknown, already released or expired)."""
        held = self._held.pop(transfer_id, None)
        if held is None:
            return None
        self._cache.free(held.table)
        return held.num_tokens

    def next_expiry(self) -> float | None:
        """The oldest hold's deadline; None when nothing is held."""
        for held in self._held.values():
            return held.expires_at
        return None

    def expire(self, now: float) -> int:
        """Free every hold whose deadline is not after *now*; return how many."""
        held = self._held
        expired = 0
        while held:
            transfer_id, oldest = next(iter(held.items()))
            if now < oldest.expires_at:
                break
            del held[transfer_id]
            self._cache.free(oldest.table)
            expired += 1
        return expired

    def clear(self) -> None:
        """Free everything held (the engine is stopping)."""
        for held in self._held.values():
            self._cache.free(held.table)
        self._held.clear()
