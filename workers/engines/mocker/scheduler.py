"""The mocker's continuous-batching scheduler, as plain Python over a paged KV cache.

Each step it admits waiting sequences (FIFO) while ``max_num_seqs`` and the KV cache
allow, then spends up to ``max_num_batched_tokens``: one token per decoding sequence,
the rest on prompt chunks (chunked prefill). The step lasts ``prefill_ms(T)`` if it
prefills ``T > 0`` prompt tokens, else ``decode_ms(u)`` with ``u`` the share of the
cache the running batch holds (:mod:`.timing`). When a sequence's last prompt token
is computed, that step also samples its first output token (as real engines do); each
later step adds one token. A prefill-only sequence instead hands its KV to
:class:`~.transfers.HeldTransfers` and is done.

A sequence computes KV for its tokens in order; ``num_computed`` counts them. While
some of its KV is missing it is scheduled for the remainder, and when all is there it
samples a token, which leaves exactly one token to compute next step. Preemption
(a decoding sequence needs a block and none is free) drops the newest sequence's KV
and puts it back at the head of the queue to recompute prompt plus output; output
tokens depend only on seed and position (:mod:`.sampling`), so the redo emits the
same ids.

Why no trio here: the batching rules are the engine's substance and are easiest to
test, and to reason about, one step at a time with numbers for the clock. The trio
shell (:mod:`.engine`) owns time and waiting::

    batch, seconds = scheduler.plan()        # admit, choose, price the step
    ...                                      # the step runs for `seconds`
    scheduler.finish(batch, now)             # its KV is computed, tokens sampled
    for seq in scheduler.woken: ...          # wake their consumers
    scheduler.woken.clear()

It runs on the frontend's event loop when the mocker is in-process, once per step
for every running sequence, so the per-sequence paths avoid calls and allocations.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from headwater.wire import FinishReason, KvHandle, TokenLogprobs
from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.kv_cache import BlockTable, KvCache
from workers.engines.mocker.sampling import logprobs_at, token_at, top_token_at
from workers.engines.mocker.timing import step_seconds
from workers.engines.mocker.transfers import HeldTransfers


@dataclass(slots=True)
class MockerCounters:
    """Monotonic counters for tests and metrics (read them, never write)."""

    requests_started: int = 0
    requests_finished: int = 0  # the final chunk was handed to the consumer
    requests_cancelled: int = 0  # the consumer left before the final chunk
    requests_failed: int = 0  # ended by an EngineError (transfer failed, shutdown)
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0  # prompt tokens served by the prefix cache
    preemptions: int = 0
    transfers_released: int = 0
    transfers_expired: int = 0


class State(enum.Enum):
    """Where a :class:`Sequence` is."""

    PULLING = enum.auto()  # decode leg fetching KV; not queued yet
    WAITING = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()


@dataclass(eq=False, slots=True)
class Sequence:
    """One request as the scheduler sees it: its tokens, its KV, its progress.

    The caller fills in the request's part (the fields up to ``block_hashes``) and
    hands it to :meth:`Scheduler.add`; the scheduler writes the rest. Output tokens
    are appended to ``tokens`` and to ``pending``, which the consumer drains (and
    their logprobs to ``pending_logprobs`` when the request asked for ``logprobs``).
    """

    request_id: str
    tokens: array[int]  # prompt + output so far: the KV content
    max_tokens: int
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    eos_token: int | None = None
    eos_index: int | None = None  # output index at which eos_token is emitted
    seed_key: int = 0  # sampling.seed_key()
    greedy: bool = False  # temperature 0: the most likely token, not a draw
    prefill_only: bool = False  # hold the KV once the prompt is computed; sample nothing
    logprobs: int | None = None  # top logprobs to report per output token; None: none
    transferred: int = 0  # leading tokens whose KV arrived by transfer
    # Prefix-cache hashes of leading full prompt blocks, computed by the prefill worker.
    block_hashes: tuple[int, ...] = ()
    state: State = State.PULLING
    table: BlockTable | None = None
    num_computed: int = 0
    prefill_end: int = 0  # tokens below this index count as prefill work
    cached_tokens: int | None = None  # set at first admission
    num_output: int = 0
    pending: deque[int] = field(default_factory=deque)
    pending_logprobs: deque[TokenLogprobs] = field(default_factory=deque)
    finish: FinishReason | None = None
    handle: KvHandle | None = None  # a prefill-only sequence's held KV, once computed


S = TypeVar("S", bound=Sequence)


class Scheduler(Generic[S]):
    """Continuous batching of :class:`Sequence` records over *cache*.

    Not thread-safe and never blocks: the caller serializes calls. *transfers* takes
    the KV of prefill-only sequences; without it none may be added. *counters* gets
    the prefill, cache-hit and preemption counts.

    ``woken`` lists, in order, the sequences with news for their consumer since the
    caller last cleared it: a token in ``pending``, a ``finish`` reason or a
    ``handle``. ``replan`` is True when the last :meth:`plan` freed KV (preempted or
    finished a sequence): planning again may admit what waits, so an empty batch then
    does not mean "idle".
    """

    def __init__(
        self,
        config: MockerConfig,
        cache: KvCache,
        counters: MockerCounters,
        transfers: HeldTransfers | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.counters = counters
        self.transfers = transfers
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self.woken: list[S] = []
        self.replan = False
        self._capacity = config.kv_capacity_tokens
        self._speedup = config.speedup_ratio
        self._low = config.output_token_low
        self._span = config.output_token_high - config.output_token_low

    def add(self, seq: S) -> None:
        """Queue *seq* behind the waiting ones. Its prompt must fit the cache.

        Raises ValueError for a prefill-only sequence when there are no *transfers*.
        """
        if seq.prefill_only and self.transfers is None:
            raise ValueError("a prefill-only sequence needs a scheduler with transfers")
        seq.state = State.WAITING
        self.waiting.append(seq)

    def remove(self, seq: S) -> None:
        """Take *seq* out wherever it is and free its blocks (its consumer is gone).

        Safe in any state and mid-step: :meth:`finish` skips it. A held transfer is
        not freed here; that is the transfers' owner's call.
        """
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
        elif seq.state is State.RUNNING:
            self.running.remove(seq)
        seq.state = State.DONE
        if seq.table is not None:
            self.cache.free(seq.table)
            seq.table = None

    def drain(self) -> list[S]:
        """Take out every waiting and running sequence, freeing their blocks; return
        them (waiting first) for the caller to fail."""
        seqs = [*self.waiting, *self.running]
        for seq in seqs:
            if seq.table is not None:
                self.cache.free(seq.table)
                seq.table = None
            seq.state = State.DONE
        self.waiting.clear()
        self.running.clear()
        return seqs

    # ---- a step ----------------------------------------------------------------------

    def plan(self) -> tuple[list[tuple[S, int]], float]:
        """Admit what fits, then choose this step's work; return (sequence, tokens to
        compute) pairs and the step's duration in seconds (0.0 for an empty batch).

        Decoding sequences go first, one token each, so a long prompt never stalls
        streams already running; prompt chunks share what is left of the budget in
        admission order. Only decoding sequences need a new block, so only the first
        pass may preempt (the newest sequence, which that pass has not reached yet)
        or finish a sequence that cannot get one. The batch is for :meth:`finish`.
        """
        self.replan = False
        self._admit()
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[S, int]] = []
        decoding = [s for s in self.running if s.num_computed >= s.prefill_end]
        prefilling = [s for s in self.running if s.num_computed < s.prefill_end]
        for seq in decoding:
            if budget == 0:
                break
            if seq.state is State.RUNNING and self._grow(seq, seq.num_computed + 1):
                batch.append((seq, 1))
                budget -= 1
        prefill = 0
        for seq in prefilling:
            if budget == 0:
                break
            if seq.state is State.RUNNING:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                batch.append((seq, n))
                budget -= n
                prefill += min(seq.num_computed + n, seq.prefill_end) - seq.num_computed
        if not batch:
            return batch, 0.0
        active = sum(s.table.num_tokens for s in self.running if s.table is not None)
        return batch, step_seconds(prefill, active / self._capacity, self._speedup)

    def finish(self, batch: list[tuple[S, int]], now: float) -> None:
        """Complete *batch* (from :meth:`plan`) at time *now*: record the KV computed,
        sample a token for each sequence whose KV is complete, hold a prefill-only
        one's KV (its deadline counts from *now*). Sequences removed meanwhile are
        skipped. What has news is appended to ``woken``.
        """
        commit = self.cache.commit
        woken = self.woken
        counters = self.counters
        low, span = self._low, self._span
        for seq, n in batch:
            if seq.state is not State.RUNNING or seq.table is None:
                continue  # removed while the step ran
            start = seq.num_computed
            if start < seq.prefill_end:
                counters.prefill_tokens_computed += min(start + n, seq.prefill_end) - start
            tokens = seq.tokens
            seq.num_computed = computed = start + n
            commit(seq.table, tokens, computed)
            if computed < len(tokens):
                continue  # more prompt chunks to go
            if seq.prefill_only:
                self._hold(seq, now)
                continue
            # Sample, inline: this runs for every decoding sequence every step.
            index = seq.num_output
            eos = seq.eos_token if index == seq.eos_index else None
            if eos is not None:
                token = eos
            elif seq.greedy:
                token = top_token_at(seq.seed_key, len(tokens) + 1, low, span)
            else:
                token = token_at(seq.seed_key, len(tokens) + 1, low, span)
            if seq.logprobs is not None:
                seq.pending_logprobs.append(
                    logprobs_at(
                        seq.seed_key,
                        len(tokens) + 1,
                        token,
                        low,
                        span,
                        seq.logprobs,
                        first=eos,
                    )
                )
            tokens.append(token)
            seq.pending.append(token)
            seq.num_output = index + 1
            if index == seq.eos_index or (index >= seq.min_tokens and token in seq.stop_ids):
                self._finish(seq, FinishReason.STOP)
            elif index + 1 >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH)
            else:
                woken.append(seq)

    # ---- internals -------------------------------------------------------------------

    def _admit(self) -> None:
        waiting, running = self.waiting, self.running
        while waiting and len(running) < self.config.max_num_seqs:
            seq = waiting[0]
            table = self.cache.allocate(seq.tokens, seq.block_hashes)
            if table is None:
                return  # FIFO: later sequences wait behind the head too
            waiting.popleft()
            n = len(seq.tokens)
            covered = min(max(seq.transferred, table.cached_tokens), n - 1)
            seq.table = table
            seq.num_computed = covered
            # A fully transferred prompt goes straight to decoding: its first step
            # computes the last prompt token and samples, like any decode step.
            seq.prefill_end = n - 1 if seq.transferred >= n else n
            self.cache.commit(table, seq.tokens, covered)
            reused = max(0, covered - seq.transferred)
            if seq.cached_tokens is None:
                seq.cached_tokens = reused
            self.counters.prefill_tokens_cached += reused
            seq.state = State.RUNNING
            running.append(seq)

    def _grow(self, seq: S, target: int) -> bool:
        """Make room for *target* tokens of *seq*, preempting the newest sequences.

        False if *seq* itself was preempted, or finished because it outgrew the cache.
        """
        table = seq.table
        assert table is not None
        while table.num_tokens < target:
            if self.cache.append_slot(table):
                continue
            self.replan = True
            if len(self.running) == 1:
                self._finish(seq, FinishReason.LENGTH)  # alone and still no room
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: S) -> None:
        self.running.remove(seq)
        if seq.table is not None:
            self.cache.free(seq.table)  # computed full blocks stay cached for the redo
            seq.table = None
        seq.num_computed = 0
        seq.transferred = 0
        seq.state = State.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1

    def _finish(self, seq: S, reason: FinishReason) -> None:
        self.running.remove(seq)
        if seq.table is not None:
            self.cache.free(seq.table)
            seq.table = None
        seq.finish = reason
        seq.state = State.DONE
        self.woken.append(seq)

    def _hold(self, seq: S, now: float) -> None:
        assert seq.table is not None
        assert self.transfers is not None  # add() checked
        seq.handle = self.transfers.hold(seq.table, len(seq.tokens), now, seq.tokens)
        seq.table = None
        self.running.remove(seq)
        seq.state = State.DONE
        self.woken.append(seq)
