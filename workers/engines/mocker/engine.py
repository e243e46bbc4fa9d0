"""The simulated engine: a continuous-batching scheduler over a paged KV cache.

One scheduler task (:meth:`MockerEngine.run`) owns the batch. Each step it admits
waiting sequences (FIFO) while ``max_num_seqs`` and the KV cache allow, then spends up
to ``max_num_batched_tokens``: one token per decoding sequence, the rest on prompt
chunks (chunked prefill). The step lasts ``prefill_ms(T)`` if it prefilled ``T > 0``
prompt tokens, else ``decode_ms(u)`` (:mod:`.timing`), on the device's own timeline
(:meth:`MockerEngine._schedule_forever`) and trio's clock, so tests run on virtual
time. When a sequence's last prompt token is computed, that step also samples its
first output token (as real engines do); each later step adds one token.

A sequence computes KV for its tokens in order; ``num_computed`` counts them. While
some of its KV is missing it is scheduled for the remainder, and when all is there it
samples a token, which leaves exactly one token to compute next step. Preemption
(a decoding sequence needs a block and none is free) drops the newest sequence's KV
and puts it back at the head of the queue to recompute prompt plus output.

Output tokens are a pure function of (seed, absolute position) (:mod:`.sampling`).
Requests talk to the scheduler
through their :class:`_Sequence`: the scheduler appends tokens and sets an event;
the request's generator yields them.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from headwater.plane.base import WorkerError
from headwater.plane.kv import KvTransfer
from headwater.wire import Chunk, ErrorCode, FinishReason, GenerateRequest, KvHandle, Role
from headwater.wire.tokens import copy_tokens
from workers.engines.base import Engine, EngineContext, EngineError, EngineStats
from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.kv_cache import BlockTable, KvCache, KvCacheStats
from workers.engines.mocker.sampling import natural_length, seed_key, token_at
from workers.engines.mocker.timing import step_seconds
from workers.engines.mocker.transfers import HeldTransfers

#: The shortest wait the scheduler sleeps for; shorter ones just yield (see
#: :meth:`MockerEngine._schedule_forever`).
MIN_SLEEP = 0.5e-3


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


class _State(enum.Enum):
    PULLING = enum.auto()  # decode leg fetching KV; not queued yet
    WAITING = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()


@dataclass(eq=False, slots=True)
class _Sequence:
    request_id: str
    tokens: array[int]  # prompt + output so far: the KV content
    prompt_len: int
    max_tokens: int
    min_tokens: int
    stop_ids: frozenset[int]
    eos_token: int | None
    eos_index: int | None  # output index at which eos_token is emitted
    seed_key: int
    prefill_only: bool
    state: _State = _State.PULLING
    transferred: int = 0  # leading tokens whose KV arrived by transfer
    # Prefix-cache hashes of leading full prompt blocks, computed by the prefill worker.
    block_hashes: tuple[int, ...] = ()
    table: BlockTable | None = None
    num_computed: int = 0
    prefill_end: int = 0  # tokens below this index count as prefill work
    cached_tokens: int | None = None  # set at first admission
    num_output: int = 0
    pending: deque[int] = field(default_factory=deque)
    finish: FinishReason | None = None
    error: EngineError | None = None
    handle: KvHandle | None = None
    ready: trio.Event = field(default_factory=trio.Event)


class MockerEngine(Engine):
    """A simulated model engine in one :class:`~headwater.wire.Role`.

    Start it with ``await nursery.start(engine.run)``. Requests may be submitted
    before that (they queue); after :meth:`run` ends every pending and new request
    fails with ``EngineError("shutting_down")``. A decode or agg engine needs
    *kv_transfer* to serve requests carrying a ``kv_handle``. *transfer_address* is
    advertised in the handles a prefill engine returns (default ``memory://<id>``).
    """

    def __init__(
        self,
        config: MockerConfig,
        role: Role | str,
        worker_id: str,
        kv_transfer: KvTransfer | None = None,
        transfer_address: str = "",
    ) -> None:
        self.config = config
        self.role = Role(role)
        self.worker_id = worker_id
        self.kv_transfer = kv_transfer
        self.transfer_address = transfer_address or f"memory://{worker_id}"
        self.counters = MockerCounters()
        self._cache = KvCache(config.num_gpu_blocks, config.block_size)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._transfers = HeldTransfers(
            self._cache, config.kv_transfer_timeout, worker_id, self.transfer_address
        )
        self._held_added = trio.Event()
        self._pulling = 0
        self._work = trio.Event()
        self._started = False
        self._closed = False

    # ---- Engine API -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler until cancelled. May be called once.

        Held transfers expire in a child task. On exit every queued or running
        request fails with ``shutting_down`` and all KV is freed.
        """
        if self._started:
            raise RuntimeError("MockerEngine.run() may only be called once")
        self._started = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._expire_held)
                task_status.started()
                await self._schedule_forever()
        finally:
            self._shutdown()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Serve *request*; see :meth:`Engine.generate`.

        Yields one chunk per output token (``cached_tokens`` on each), the last with
        ``finish_reason``; a prefill engine yields a single token-less chunk carrying
        the :class:`KvHandle`. Raises EngineError: ``invalid_request`` (empty prompt,
        prompt larger than the cache, ``max_tokens < 1``, bad ``min_tokens`` or
        handle), ``kv_transfer_failed`` (pull failed), ``shutting_down``.
        Closing or cancelling the consumer frees the sequence's KV at once.
        """
        seq = self._new_sequence(request)
        self.counters.requests_started += 1
        finished = failed = False
        try:
            if request.kv_handle is not None:
                await self._pull(request.kv_handle)
                seq.transferred = request.kv_handle.num_tokens
                seq.block_hashes = self._usable_hashes(request.kv_handle)
            self._enqueue(seq)
            while True:
                if seq.pending:
                    token = seq.pending.popleft()
                    last = seq.finish is not None and not seq.pending
                    if last:
                        finished = True
                        self.counters.requests_finished += 1
                    yield Chunk(
                        request.request_id,
                        [token],
                        finish_reason=seq.finish if last else None,
                        cached_tokens=seq.cached_tokens or 0,
                    )
                    if last:
                        return
                elif seq.error is not None:
                    raise seq.error
                elif seq.handle is not None or seq.finish is not None:
                    finished = True
                    self.counters.requests_finished += 1
                    yield Chunk(
                        request.request_id,
                        [],
                        finish_reason=seq.finish,
                        kv_handle=seq.handle,
                        cached_tokens=seq.cached_tokens or 0,
                    )
                    return
                else:
                    seq.ready = trio.Event()
                    await seq.ready.wait()
        except Exception:
            failed = True
            raise
        finally:
            # Synchronous on purpose: runs under cancellation and GeneratorExit alike.
            if not finished:
                if failed:
                    self.counters.requests_failed += 1
                else:
                    self.counters.requests_cancelled += 1
            self._discard(seq, delivered=finished)

    async def release_transfer(self, transfer_id: str) -> int:
        """Free the KV held under *transfer_id*; return its payload size in bytes
        (:class:`~headwater.plane.kv.KvSource`, used by a prefill engine's worker).

        Raises ``EngineError("kv_transfer_failed")`` if the id is unknown, already
        pulled or expired. Cancellation before the release leaves the KV held.
        """
        await trio.lowlevel.checkpoint()
        num_tokens = self._transfers.release(transfer_id)
        if num_tokens is None:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"{self.worker_id}: no KV held under transfer {transfer_id!r} "
                "(unknown, already pulled or expired)",
            )
        self._notify()
        self.counters.transfers_released += 1
        return num_tokens * self.config.kv_bytes_per_token

    def statistics(self) -> EngineStats:
        """Running/queued requests (a pulling decode leg counts as queued) and KV use."""
        kv = self._cache.statistics()
        return EngineStats(
            active_requests=len(self._running),
            waiting_requests=len(self._waiting) + self._pulling,
            kv_blocks_used=kv.used_blocks,
            kv_blocks_total=kv.total_blocks,
            kv_transfers_held=len(self._transfers),
        )

    def kv_statistics(self) -> KvCacheStats:
        """Block usage including blocks that are free but still hold a cached prefix."""
        return self._cache.statistics()

    # ---- request side -----------------------------------------------------------

    def _new_sequence(self, request: GenerateRequest) -> _Sequence:
        cfg = self.config
        prompt = request.token_ids
        sampling = request.sampling
        handle = request.kv_handle
        if self._closed:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} is shut down")
        problem = None
        if not prompt:
            problem = "empty prompt"
        elif len(prompt) > cfg.kv_capacity_tokens:
            problem = (
                f"prompt of {len(prompt)} tokens exceeds the KV cache "
                f"({cfg.kv_capacity_tokens} tokens)"
            )
        elif sampling.max_tokens < 1:
            problem = f"max_tokens must be >= 1, got {sampling.max_tokens}"
        elif not 0 <= sampling.min_tokens <= sampling.max_tokens:
            problem = f"min_tokens must be in [0, max_tokens], got {sampling.min_tokens}"
        elif handle is not None and self.role is Role.PREFILL:
            problem = "a prefill engine cannot take a kv_handle"
        elif handle is not None and not 0 <= handle.num_tokens <= len(prompt):
            problem = f"kv_handle covers {handle.num_tokens} tokens of a {len(prompt)}-token prompt"
        if problem is not None:
            raise EngineError(ErrorCode.INVALID_REQUEST, problem)

        if self.role is Role.PREFILL and isinstance(prompt, array):
            tokens = prompt  # a prefill never appends: it reads the request's array
        else:
            try:
                tokens = copy_tokens(prompt)  # a memcpy for a token array
            except ValueError as exc:
                raise EngineError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
        key = seed_key(sampling.seed, request.request_id)
        stop_ids = set(sampling.stop_token_ids)
        eos_token = eos_index = None
        if not sampling.ignore_eos:
            stop_ids.update(request.eos_token_ids)
            mean = cfg.mean_output_tokens
            if mean is not None and request.eos_token_ids:
                eos_token = request.eos_token_ids[0]
                eos_index = max(natural_length(key, mean), sampling.min_tokens)
        return _Sequence(
            request_id=request.request_id,
            tokens=tokens,
            prompt_len=len(prompt),
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_ids=frozenset(stop_ids),
            eos_token=eos_token,
            eos_index=eos_index,
            seed_key=key,
            prefill_only=self.role is Role.PREFILL,
        )

    async def _pull(self, handle: KvHandle) -> None:
        if self.kv_transfer is None:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED, f"{self.worker_id} has no KV transfer configured"
            )
        self._pulling += 1
        try:
            await self.kv_transfer.pull(handle)
        except EngineError:
            raise
        except WorkerError as exc:  # the transfer's own report (TCP: kv_transfer_failed)
            raise EngineError(exc.code, exc.message) from exc
        except Exception as exc:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"pulling {handle.transfer_id!r} from {handle.worker_id!r} failed: {exc!r}",
            ) from exc
        finally:
            self._pulling -= 1

    def _usable_hashes(self, handle: KvHandle) -> tuple[int, ...]:
        """The handle's block hashes this cache can use in place of hashing the prompt.

        What the prefill worker hashed (a prefix hit there) need not be hashed again
        here: hashing is most of the KV bookkeeping. Only hashes of blocks of this
        cache's size count, and only those within the transferred tokens (no more than
        the prompt, as ``_new_sequence`` checked; both legs carry the same prompt). They
        describe content, so they stay valid when a preempted sequence is allocated
        again.
        """
        if handle.block_size != self.config.block_size:
            return ()  # none sent (an older peer), or another block size: hash here
        return handle.block_hashes[: handle.num_tokens // handle.block_size]

    def _enqueue(self, seq: _Sequence) -> None:
        if self._closed:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} is shut down")
        seq.state = _State.WAITING
        self._waiting.append(seq)
        self._notify()

    def _discard(self, seq: _Sequence, *, delivered: bool) -> None:
        """Take *seq* out of the engine and free what it holds (the consumer is gone)."""
        if seq.state is _State.WAITING:
            self._waiting.remove(seq)
        elif seq.state is _State.RUNNING:
            self._running.remove(seq)
        seq.state = _State.DONE
        if seq.table is not None:
            self._cache.free(seq.table)
            seq.table = None
        if seq.handle is not None and not delivered:
            # Nobody will learn the transfer id: free now rather than at expiry.
            self._transfers.release(seq.handle.transfer_id)
        self._notify()

    # ---- scheduler --------------------------------------------------------------

    def _notify(self) -> None:
        self._work.set()

    async def _schedule_forever(self) -> None:
        """Run steps while there is work, on the simulated device's own timeline.

        A step that follows another starts where that one ended; after an idle spell,
        when it is planned. The scheduler sleeps until a step's end only when that is
        at least :data:`MIN_SLEEP` away, and otherwise just yields: a trio timer costs
        ~50 us of loop CPU (a cancel scope, a deadline, a Cancelled raised and caught),
        more than a decode step lasts at ``--speedup-ratio 1000`` (6-30 us), and with
        the engine in-process it is the frontend's loop that pays. Short steps thus run
        ahead of their timeline by less than ``MIN_SLEEP``, and the sleep that follows
        brings the device back onto it.
        """
        capacity = self.config.kv_capacity_tokens
        speedup = self.config.speedup_ratio
        step_end: float | None = None  # the last step's end, while steps run back to back
        while True:
            self._work = trio.Event()
            self._admit()
            batch, prefill_tokens = self._plan_step()
            if not batch:
                step_end = None
                if self._work.is_set():  # the plan itself freed or preempted something
                    await trio.lowlevel.checkpoint()
                else:
                    await self._work.wait()
                continue
            active = sum(s.table.num_tokens for s in self._running if s.table is not None)
            now = trio.current_time()
            step_end = (now if step_end is None else step_end) + step_seconds(
                prefill_tokens, active / capacity, speedup
            )
            if step_end - now >= MIN_SLEEP:
                await trio.sleep_until(step_end)
            else:
                await trio.lowlevel.checkpoint()
            self._finish_step(batch)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            table = self._cache.allocate(seq.tokens, seq.block_hashes)
            if table is None:
                return  # FIFO: later sequences wait behind the head too
            self._waiting.popleft()
            n = len(seq.tokens)
            covered = min(max(seq.transferred, table.cached_tokens), n - 1)
            seq.table = table
            seq.num_computed = covered
            # A fully transferred prompt goes straight to decoding: its first step
            # computes the last prompt token and samples, like any decode step.
            seq.prefill_end = n - 1 if seq.transferred >= n else n
            self._cache.commit(table, seq.tokens, covered)
            reused = max(0, covered - seq.transferred)
            if seq.cached_tokens is None:
                seq.cached_tokens = reused
            self.counters.prefill_tokens_cached += reused
            seq.state = _State.RUNNING
            self._running.append(seq)

    def _plan_step(self) -> tuple[list[tuple[_Sequence, int]], int]:
        """Choose (sequence, tokens to compute) for this step; return them and the
        prefill token count.

        Decoding sequences go first, one token each, so a long prompt never stalls
        streams already running; prompt chunks share what is left of the budget in
        admission order. Only decoding sequences need a new block, so only the first
        pass may preempt (the newest sequence, which that pass has not reached yet)
        or finish a sequence that cannot get one.
        """
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[_Sequence, int]] = []
        decoding = [s for s in self._running if s.num_computed >= s.prefill_end]
        prefilling = [s for s in self._running if s.num_computed < s.prefill_end]
        for seq in decoding:
            if budget == 0:
                break
            if seq.state is _State.RUNNING and self._grow(seq, seq.num_computed + 1):
                batch.append((seq, 1))
                budget -= 1
        prefill = 0
        for seq in prefilling:
            if budget == 0:
                break
            if seq.state is _State.RUNNING:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                batch.append((seq, n))
                budget -= n
                prefill += min(seq.num_computed + n, seq.prefill_end) - seq.num_computed
        return batch, prefill

    def _grow(self, seq: _Sequence, target: int) -> bool:
        """Make room for *target* tokens of *seq*, preempting the newest sequences.

        False if *seq* itself was preempted, or finished because it outgrew the cache.
        """
        table = seq.table
        assert table is not None
        while table.num_tokens < target:
            if self._cache.append_slot(table):
                continue
            if len(self._running) == 1:
                self._finish(seq, FinishReason.LENGTH)  # alone and still no room
                return False
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        if seq.table is not None:
            self._cache.free(seq.table)  # computed full blocks stay cached for the redo
            seq.table = None
        seq.num_computed = 0
        seq.transferred = 0
        seq.state = _State.WAITING
        self._waiting.appendleft(seq)
        self.counters.preemptions += 1
        self._notify()

    def _finish_step(self, batch: list[tuple[_Sequence, int]]) -> None:
        for seq, n in batch:
            if seq.state is not _State.RUNNING or seq.table is None:
                continue  # cancelled while the step ran
            start = seq.num_computed
            if start < seq.prefill_end:
                self.counters.prefill_tokens_computed += min(start + n, seq.prefill_end) - start
            seq.num_computed = start + n
            self._cache.commit(seq.table, seq.tokens, seq.num_computed)
            if seq.num_computed < len(seq.tokens):
                continue  # more prompt chunks to go
            if seq.prefill_only:
                self._hold(seq)
            else:
                self._sample(seq)

    def _sample(self, seq: _Sequence) -> None:
        index = seq.num_output
        if index == seq.eos_index and seq.eos_token is not None:
            token = seq.eos_token
        else:
            low = self.config.output_token_low
            span = self.config.output_token_high - low
            token = token_at(seq.seed_key, len(seq.tokens) + 1, low, span)
        seq.tokens.append(token)
        seq.pending.append(token)
        seq.num_output += 1
        if index == seq.eos_index or (index >= seq.min_tokens and token in seq.stop_ids):
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output >= seq.max_tokens:
            self._finish(seq, FinishReason.LENGTH)
        else:
            seq.ready.set()

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        self._running.remove(seq)
        if seq.table is not None:
            self._cache.free(seq.table)
            seq.table = None
        seq.finish = reason
        seq.state = _State.DONE
        seq.ready.set()
        self._notify()

    # ---- held transfers (prefill role) -------------------------------------------

    def _hold(self, seq: _Sequence) -> None:
        assert seq.table is not None
        seq.handle = self._transfers.hold(seq.table, len(seq.tokens), trio.current_time())
        self._held_added.set()
        seq.table = None
        self._running.remove(seq)
        seq.state = _State.DONE
        seq.ready.set()
        self._notify()

    async def _expire_held(self) -> None:
        """Free the KV of transfers nobody pulled within ``kv_transfer_timeout``.

        One task for all holds, sleeping until the oldest one's deadline.
        """
        transfers = self._transfers
        while True:
            deadline = transfers.next_expiry()
            if deadline is None:
                self._held_added = trio.Event()
                await self._held_added.wait()
                continue
            now = trio.current_time()
            if now < deadline:
                await trio.sleep_until(deadline)
                continue
            self.counters.transfers_expired += transfers.expire(now)
            self._notify()

    def _shutdown(self) -> None:
        self._closed = True
        for seq in [*self._waiting, *self._running]:
            if seq.table is not None:
                self._cache.free(seq.table)
                seq.table = None
            seq.state = _State.DONE
            seq.error = EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} stopped")
            seq.ready.set()
        self._waiting.clear()
        self._running.clear()
        self._transfers.clear()


def build_engine(config: MockerConfig, context: EngineContext) -> MockerEngine:
    """The registry's factory (:mod:`workers.engines.registry`)."""
    return MockerEngine(
        config, context.role, context.worker_id, kv_transfer=context.kv_transfer,
        transfer_address=context.transfer_address,
    )  # fmt: skip
