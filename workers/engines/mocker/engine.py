"""The simulated engine's trio shell: requests in, chunks out, steps on virtual time.

:class:`MockerEngine` is what a worker hosts. Its batching rules live in
:mod:`.scheduler` (plain Python); this module gives them time and waiting. One
scheduler task (:meth:`MockerEngine.run`) owns the batch: it plans a step, waits out
the step's duration on the simulated device's own timeline
(:meth:`MockerEngine._schedule_forever`) and trio's clock, so tests run on virtual
time, then finishes it. Each request is an async generator that validates it, pulls
its KV first if it carries a handle, queues its sequence and yields the tokens the
scheduler appends; the scheduler reports which sequences have news and this shell
sets their events. A prefill engine's held KV (:mod:`.transfers`) expires in a child
task of :meth:`MockerEngine.run`.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncGenerator
from collections.abc import Sequence as IntSequence
from dataclasses import dataclass, field, replace
from functools import partial

import trio

from headwater.plane.base import WorkerError
from headwater.plane.kv import KvTransfer
from headwater.wire import Chunk, ErrorCode, GenerateRequest, KvHandle, Role, TokenLogprobs
from headwater.wire.capabilities import (
    LOGPROBS,
    PROMPT_FROM_KV,
    PROMPT_LOGPROBS,
    SEED,
    Capabilities,
)
from headwater.wire.kv_events import KvEventLog
from headwater.wire.tokens import copy_tokens
from workers.engines.base import Engine, EngineContext, EngineError, EngineStats
from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.kv_cache import KvCache, KvCacheStats
from workers.engines.mocker.sampling import (
    output_length,
    prompt_key,
    prompt_logprobs,
    seed_key,
)
from workers.engines.mocker.scheduler import MockerCounters, Scheduler, Sequence
from workers.engines.mocker.transfers import HeldTransfers
from workers.engines.stages import StageSpans, stage_spans

#: The shortest wait the scheduler sleeps for; shorter ones just yield (see
#: :meth:`MockerEngine._schedule_forever`).
MIN_SLEEP = 0.5e-3
#: Prompts shorter than this get their logprobs computed on the loop, longer ones in a
#: thread (tokens).
PROMPT_LOGPROBS_INLINE = 2048
#: What the simulated engine honours beyond the baseline (temperature 0 is greedy: see
#: :mod:`.sampling`), and that a decode leg may leave its prompt to the KV pull.
CAPABILITIES = Capabilities("mocker", frozenset({SEED, LOGPROBS, PROMPT_LOGPROBS, PROMPT_FROM_KV}))


@dataclass(eq=False, slots=True)
class _Request(Sequence):
    """A sequence with its consumer's side: the event it waits on, the error it gets."""

    error: EngineError | None = None
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
        self.kv_events = KvEventLog() if config.publish_kv_events else None
        self._cache = KvCache(config.num_gpu_blocks, config.block_size, self.kv_events)
        self._transfers = HeldTransfers(
            self._cache, config.kv_transfer_timeout, worker_id, self.transfer_address
        )
        self._scheduler: Scheduler[_Request] = Scheduler(
            config, self._cache, self.counters, self._transfers
        )
        self._held_added = trio.Event()
        self._pulling = 0
        self._work = trio.Event()
        self._started = False
        self._closed = False

    # ---- Engine API -------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """Seeds and logprobs (:data:`CAPABILITIES`): its simulated distribution is drawn
        from at temperature 1 (0: its most likely token), and top-k, min-p, penalties,
        biases and constrained decoding are refused, not simulated (docs/api.md,
        "Fields")."""
        return CAPABILITIES

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

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        """Serve *request*; see :meth:`Engine.generate`.

        Yields one chunk per output token (``cached_tokens`` on each, its logprobs and
        the first one the prompt's when asked: :mod:`.sampling`), the last with
        ``finish_reason``; a prefill engine yields a single token-less chunk carrying
        the :class:`KvHandle`. Raises EngineError: ``invalid_request`` (empty prompt,
        prompt larger than the cache, ``max_tokens < 1``, bad ``min_tokens`` or
        handle), ``kv_transfer_failed`` (pull failed), ``shutting_down``.
        Closing or cancelling the consumer frees the sequence's KV at once.

        A decode leg that came without its prompt (``request.prompt_in_kv``) pulls first,
        the prompt with the KV, and is checked once it has it.
        """
        pulled = request.prompt_in_kv
        spans = None
        if pulled:
            spans = stage_spans()  # None unless this request is traced
            request = await self._pull_prompt(request, spans)
        try:
            seq = self._new_sequence(request, owned=pulled)
        except BaseException:
            if spans:
                spans.close()
            raise
        if not pulled:
            spans = stage_spans()
        self.counters.requests_started += 1
        finished = failed = False
        try:
            prompt = await self._prompt_logprobs(request)
            if request.kv_handle is not None:
                if not pulled:
                    if spans:
                        spans.stage(
                            "engine.kv_pull",
                            {"headwater.kv.tokens": request.kv_handle.num_tokens},
                        )
                    await self._pull(request.kv_handle)
                seq.transferred = request.kv_handle.num_tokens
                seq.block_hashes = self._usable_hashes(request.kv_handle)
            if spans:  # the queue's wait and the prefill: the simulated scheduler's
                spans.stage("engine.prefill", {"headwater.prompt_tokens": len(request.token_ids)})
            self._enqueue(seq)
            while True:
                if seq.pending:
                    if spans and spans.name != "engine.decode":  # the first token
                        spans.current.set("headwater.cached_tokens", seq.cached_tokens or 0)
                        spans.stage("engine.decode")
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
                        logprobs=None
                        if seq.logprobs is None
                        else (seq.pending_logprobs.popleft(),),
                        prompt_logprobs=prompt,
                    )
                    prompt = None  # on the first chunk only
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
            if spans:
                spans.close()
            if not finished:
                if failed:
                    self.counters.requests_failed += 1
                else:
                    self.counters.requests_cancelled += 1
            self._discard(seq, delivered=finished)

    async def _prompt_logprobs(self, request: GenerateRequest) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, when the request asked and this engine generates. A
        long prompt's are computed in a thread: ~10 µs a token, which in-process would
        be the frontend's loop's."""
        top = request.sampling.prompt_logprobs
        if top is None or self.role is Role.PREFILL:
            return None
        cfg = self.config
        span = cfg.output_token_high - cfg.output_token_low
        work = partial(
            prompt_logprobs, copy_tokens(request.token_ids), top, cfg.output_token_low, span
        )
        if len(request.token_ids) < PROMPT_LOGPROBS_INLINE:
            return work()
        return await trio.to_thread.run_sync(work)

    async def _pull_prompt(
        self, request: GenerateRequest, spans: StageSpans | None
    ) -> GenerateRequest:
        """*request* with the prompt pulled along with its KV. A failed pull counts as a
        failed request, as it does after the prompt came with the request."""
        handle = request.kv_handle
        assert handle is not None
        if spans:
            spans.stage("engine.kv_pull", {"headwater.kv.tokens": handle.num_tokens})
        try:
            if self._closed:
                raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} is shut down")
            if self.role is Role.PREFILL:
                raise EngineError(
                    ErrorCode.INVALID_REQUEST, "a prefill engine cannot take a kv_handle"
                )
            prompt = await self._pull(handle, with_prompt=True)
            assert prompt is not None
        except BaseException as exc:
            if spans:
                spans.close()
            self.counters.requests_started += 1
            if isinstance(exc, Exception):
                self.counters.requests_failed += 1
            else:
                self.counters.requests_cancelled += 1
            raise
        return replace(request, token_ids=prompt)

    def held_prompt(self, transfer_id: str) -> IntSequence[int] | None:
        """The prompt held with *transfer_id* (:class:`~headwater.plane.kv.KvSource`)."""
        return self._transfers.prompt(transfer_id)

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
            active_requests=len(self._scheduler.running),
            waiting_requests=len(self._scheduler.waiting) + self._pulling,
            kv_blocks_used=kv.used_blocks,
            kv_blocks_total=kv.total_blocks,
            kv_transfers_held=len(self._transfers),
        )

    def kv_statistics(self) -> KvCacheStats:
        """Block usage including blocks that are free but still hold a cached prefix."""
        return self._cache.statistics()

    # ---- request side -----------------------------------------------------------

    def _new_sequence(self, request: GenerateRequest, *, owned: bool = False) -> _Request:
        """The request's sequence, once checked. *owned*: its token array is this
        engine's own (pulled with the KV), so the sequence appends to it uncopied."""
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

        if (owned or self.role is Role.PREFILL) and isinstance(prompt, array):
            tokens = prompt  # a prefill never appends: it reads the request's array
        else:
            try:
                tokens = copy_tokens(prompt)  # a memcpy for a token array
            except ValueError as exc:
                raise EngineError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
        greedy = sampling.temperature == 0
        key = seed_key(sampling.seed, request.request_id, greedy=greedy)
        stop_ids = set(sampling.stop_token_ids)
        eos_token = eos_index = None
        if not sampling.ignore_eos:
            stop_ids.update(request.eos_token_ids)
            mean = cfg.mean_output_tokens
            if mean and request.eos_token_ids:
                eos_token = request.eos_token_ids[0]
                length = output_length(
                    prompt_key(prompt) if greedy else key, mean, cfg.output_length_sigma
                )
                eos_index = max(length - 1, sampling.min_tokens)
        return _Request(
            request_id=request.request_id,
            tokens=tokens,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_ids=frozenset(stop_ids),
            eos_token=eos_token,
            eos_index=eos_index,
            seed_key=key,
            greedy=greedy,
            prefill_only=self.role is Role.PREFILL,
            logprobs=None if self.role is Role.PREFILL else sampling.logprobs,
        )

    async def _pull(self, handle: KvHandle, *, with_prompt: bool = False) -> array[int] | None:
        """Pull *handle*'s KV (and, *with_prompt*, the prompt held with it); raises
        EngineError (``kv_transfer_failed``)."""
        if self.kv_transfer is None:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED, f"{self.worker_id} has no KV transfer configured"
            )
        self._pulling += 1
        try:
            if with_prompt:
                _, prompt = await self.kv_transfer.pull_with_prompt(handle)
                return prompt
            await self.kv_transfer.pull(handle)
            return None
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

    def _enqueue(self, seq: _Request) -> None:
        if self._closed:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} is shut down")
        self._scheduler.add(seq)
        self._notify()

    def _discard(self, seq: _Request, *, delivered: bool) -> None:
        """Take *seq* out of the engine and free what it holds (the consumer is gone)."""
        self._scheduler.remove(seq)
        if seq.handle is not None and not delivered:
            # Nobody will learn the transfer id: free now rather than at expiry.
            self._transfers.release(seq.handle.transfer_id)
        self._notify()

    # ---- scheduler --------------------------------------------------------------

    def _notify(self) -> None:
        self._work.set()

    def _wake(self) -> None:
        woken = self._scheduler.woken
        for seq in woken:
            seq.ready.set()
        woken.clear()

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
        scheduler = self._scheduler
        holds = self.role is Role.PREFILL
        step_end: float | None = None  # the last step's end, while steps run back to back
        while True:
            self._work = trio.Event()
            batch, seconds = scheduler.plan()
            if scheduler.woken:  # finished while planning: outgrew the cache
                self._wake()
            if not batch:
                step_end = None
                if scheduler.replan:  # the plan itself freed or preempted something
                    await trio.lowlevel.checkpoint()
                else:
                    await self._work.wait()
                continue
            now = trio.current_time()
            step_end = (now if step_end is None else step_end) + seconds
            if step_end - now >= MIN_SLEEP:
                await trio.sleep_until(step_end)
            else:
                await trio.lowlevel.checkpoint()
            scheduler.finish(batch, trio.current_time())
            if scheduler.woken:
                self._wake()
            if holds and self._transfers:
                self._held_added.set()  # the expiry task may wait for a first hold

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
        for seq in self._scheduler.drain():
            seq.error = EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} stopped")
            seq.ready.set()
        self._transfers.clear()


def build_engine(config: MockerConfig, context: EngineContext) -> MockerEngine:
    """The registry's factory (:mod:`workers.engines.registry`)."""
    return MockerEngine(
        config,
        context.role,
        context.worker_id,
        kv_transfer=context.kv_transfer,
        transfer_address=context.transfer_address,
    )
