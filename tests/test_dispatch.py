"""Dispatch: route, retry and migration of one request's stream, on virtual time.

Fake workers (:class:`FakeWorker`) play a script per request: refuse to connect,
answer with an error, stream tokens and finish, break after some tokens, or answer a
prefill with a KV handle. Their tokens are a function of the absolute position in
the sequence (:func:`token_at`), as a real engine's greedy output would be, so a
migrated stream can be checked token for token against the one that never broke.
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import trio

from frontend.errors import InvalidRequest, NoCapacity, NoWorkers, WorkerFailed
from frontend.metrics import FrontendMetrics
from frontend.router import DispatchConfig, Dispatcher, Router, WorkerState
from headwater.plane.base import (
    CannotConnect,
    Disconnected,
    ResponseStream,
    WorkerClient,
    WorkerError,
    WorkerInstance,
)
from headwater.wire import (
    Chunk,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Role,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
    WorkerLoad,
)

MODEL = "m"
PROMPT = list(range(10, 30))  # 20 tokens


def token_at(position: int) -> int:
    """The token a deterministic engine produces at *position* of the sequence."""
    return 1000 + position


@dataclass(frozen=True)
class Refuse:
    """No connection / no ACK; ``excused``: while the caller's own loop was stalled."""

    excused: bool = False


@dataclass(frozen=True)
class Reject:
    """An Error message instead of an ACK."""

    code: ErrorCode


@dataclass(frozen=True)
class Stream:
    """ACK, then tokens; ``break_after`` tokens then a broken stream, if set;
    ``fail_after`` tokens then an Error of code ``fail_code``, if set."""

    break_after: int | None = None
    fail_after: int | None = None
    fail_code: ErrorCode = ErrorCode.SHUTTING_DOWN


@dataclass(frozen=True)
class Prefill:
    """ACK, then one chunk carrying a KV handle."""

    break_first: bool = False


Behaviour = Refuse | Reject | Stream | Prefill


@dataclass
class FakeWorker(WorkerClient):
    worker_id: str
    role: Role
    script: list[Behaviour]
    received: list[GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # transfer ids

    def __post_init__(self) -> None:
        self.instance = WorkerInstance(self.worker_id, self.role, MODEL, f"fake://{self.worker_id}")
        self.reported: WorkerLoad | None = None

    @property
    def load(self) -> WorkerLoad | None:
        return self.reported

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[ResponseStream]:
        await trio.sleep(0.001)
        self.received.append(request)
        behaviour = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(behaviour, Refuse):
            raise CannotConnect(f"{self.worker_id} refused", excused=behaviour.excused)
        if isinstance(behaviour, Reject):
            raise WorkerError(behaviour.code, f"{self.worker_id} says no")
        async with aclosing(self._chunks(request, behaviour)) as chunks:
            replies = _Replies(chunks)
            try:
                yield replies
            finally:
                if not replies.finished:
                    self.cancelled.append(request.request_id)

    async def _chunks(
        self, request: GenerateRequest, behaviour: Behaviour
    ) -> AsyncGenerator[Chunk, None]:
        rid = request.request_id
        if isinstance(behaviour, Prefill):
            await trio.sleep(0.01)
            if behaviour.break_first:
                raise Disconnected(f"{self.worker_id} died while prefilling")
            yield Chunk(
                rid,
                [],
                kv_handle=KvHandle(
                    self.worker_id, self.instance.address, f"kv-{rid}", len(request.token_ids)
                ),
            )
            return
        assert isinstance(behaviour, Stream)
        start, n = len(request.token_ids), request.sampling.max_tokens
        for i in range(n):
            if behaviour.break_after is not None and i == behaviour.break_after:
                raise Disconnected(f"{self.worker_id} died after {i} tokens")
            if behaviour.fail_after is not None and i == behaviour.fail_after:
                raise WorkerError(behaviour.fail_code, f"{self.worker_id}'s engine died")
            await trio.sleep(0.01)
            last = i == n - 1
            yield Chunk(rid, [token_at(start + i)], FinishReason.LENGTH if last else None)

    def release_kv(self, handle: KvHandle) -> None:
        self.released.append(handle.transfer_id)

    async def probe(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class _Replies(ResponseStream):
    def __init__(self, chunks: AsyncIterator[Chunk]) -> None:
        self._chunks = chunks

    async def _receive(self) -> Chunk:
        raise NotImplementedError

    async def __anext__(self) -> Chunk:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise
        except (Disconnected, WorkerError):
            self.finished = True
            raise


def cluster(*workers: FakeWorker) -> Router:
    router = Router("round-robin", rng=random.Random(1))
    for worker in workers:
        router.add(worker)
    return router


def request(max_tokens: int = 8, min_tokens: int = 0) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=True)
    return GenerateRequest("r", MODEL, PROMPT, sampling)


async def run(
    router: Router, req: GenerateRequest, *, stop_after: int | None = None, **config: Any
) -> tuple[list[Chunk], FrontendMetrics]:
    metrics = FrontendMetrics()
    dispatcher = Dispatcher(router, MODEL, config=DispatchConfig(**config), metrics=metrics)
    chunks: list[Chunk] = []
    async with aclosing(dispatcher.stream(req)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
            if stop_after is not None and len(chunks) == stop_after:
                break
    return chunks, metrics


def tokens(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def expected(n: int) -> list[int]:
    return [token_at(len(PROMPT) + i) for i in range(n)]


def migrations(metrics: FrontendMetrics) -> float:
    total: float = sum(
        metrics.model_migration_total.labels(kind)._value.get()
        for kind in ("new_request", "ongoing_request")
    )
    return total


def used(*workers: FakeWorker) -> list[str]:
    return [w.worker_id for w in workers if w.received]


async def test_an_aggregated_stream_passes_through(autojump_clock: object) -> None:
    a = FakeWorker("a", Role.AGG, [Stream()])
    router = cluster(a)
    chunks, metrics = await run(router, request(5))
    assert tokens(chunks) == expected(5)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert [r.request_id for r in a.received] == ["r"]
    assert router.views()[0].served == 1
    assert migrations(metrics) == 0


async def test_migration_carries_the_generated_tokens_over_exactly(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Stream(break_after=3)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    chunks, metrics = await run(cluster(a, b), request(max_tokens=8, min_tokens=5))
    assert tokens(chunks) == expected(8)  # no token twice, none missing
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    (moved,) = b.received
    assert moved.request_id == "r.m1"
    assert list(moved.token_ids) == PROMPT + expected(3)
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (5, 2)
    assert migrations(metrics) == 1
    assert a.received[0].sampling.max_tokens == 8  # the first leg asked for everything


async def test_a_retryable_error_mid_stream_migrates_with_the_tokens_so_far(
    autojump_clock: object,
) -> None:
    # An engine behind its worker went down after 3 tokens (vLLM died): the worker
    # answers shutting_down; the request continues elsewhere, nothing twice.
    a = FakeWorker("a", Role.AGG, [Stream(fail_after=3)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    chunks, metrics = await run(cluster(a, b), request(max_tokens=8))
    assert tokens(chunks) == expected(8)
    (moved,) = b.received
    assert moved.request_id == "r.m1"
    assert list(moved.token_ids) == PROMPT + expected(3)
    assert migrations(metrics) == 1


async def test_a_constrained_answer_migrates_only_before_its_first_token(
    autojump_clock: object,
) -> None:
    # Its grammar cannot resume on tokens fed back as prompt: after the first token a
    # broken stream fails the request rather than continue it unconstrained.
    structured = StructuredOutput(StructuredKind.JSON_OBJECT)
    constrained = replace(
        request(max_tokens=8),
        sampling=replace(request().sampling, max_tokens=8, structured=structured),
    )
    a = FakeWorker("a", Role.AGG, [Stream(break_after=3)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    with pytest.raises(WorkerFailed, match="constrained answer cannot continue"):
        await run(cluster(a, b), constrained)
    assert b.received == []
    before = FakeWorker("c", Role.AGG, [Stream(break_after=0)])
    d = FakeWorker("d", Role.AGG, [Stream()])
    chunks, _ = await run(cluster(before, d), constrained)
    assert tokens(chunks) == expected(8)
    (moved,) = d.received
    assert moved.sampling.structured == structured  # started over, constraint and all


async def test_a_non_retryable_error_mid_stream_fails_the_request(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Stream(fail_after=3, fail_code=ErrorCode.INTERNAL)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    with pytest.raises(WorkerFailed):
        await run(cluster(a, b), request(max_tokens=8))
    assert not b.received


async def test_a_worker_that_failed_the_request_is_not_picked_again(
    autojump_clock: object,
) -> None:
    # Round-robin's turns over all three would go a, b, c; among the workers that have
    # not failed this request they go a, then c (second of b, c), then b.
    a = FakeWorker("a", Role.AGG, [Stream(break_after=2)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    c = FakeWorker("c", Role.AGG, [Stream(break_after=1)])
    chunks, metrics = await run(cluster(a, b, c), request(6))
    assert tokens(chunks) == expected(6)
    assert [len(w.received) for w in (a, b, c)] == [1, 1, 1]
    assert [r.request_id for r in c.received] == ["r.m1"]
    assert [r.request_id for r in b.received] == ["r.m2"]
    assert list(b.received[0].token_ids) == PROMPT + expected(3)
    assert migrations(metrics) == 2


async def test_when_every_worker_broke_the_stream_it_goes_back_to_one(
    autojump_clock: object,
) -> None:
    # d1 breaks, then d2; by then d1 is a new process under the same id (restarted by
    # its supervisor) and takes the rest, instead of the request failing with nothing
    # left to pick.
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d1 = FakeWorker("d1", Role.DECODE, [Stream(break_after=2), Stream()])
    d2 = FakeWorker("d2", Role.DECODE, [Stream(break_after=1)])
    chunks, metrics = await run(cluster(p, d1, d2), request(6))
    assert tokens(chunks) == expected(6)
    assert [r.request_id for r in d1.received] == ["r", "r.m2"]
    assert [r.request_id for r in d2.received] == ["r.m1"]
    assert list(d1.received[1].token_ids) == PROMPT + expected(3)
    assert migrations(metrics) == 2


async def test_an_aggregated_worker_that_broke_leaves_the_rest_to_a_decode_worker(
    autojump_clock: object,
) -> None:
    # The only aggregated worker fails the request mid-stream (its vLLM died); a decode
    # worker, which prefills locally when alone, takes the rest rather than the request
    # going back to the worker that broke it (and failing when that one leaves routing).
    a = FakeWorker("a", Role.AGG, [Stream(fail_after=3), Stream()])
    d = FakeWorker("d", Role.DECODE, [Stream()])
    chunks, metrics = await run(cluster(a, d), request(8))
    assert tokens(chunks) == expected(8)
    assert [r.request_id for r in a.received] == ["r"]
    assert [r.request_id for r in d.received] == ["r.m1"]
    assert list(d.received[0].token_ids) == PROMPT + expected(3)
    assert migrations(metrics) == 1


async def test_a_worker_that_refused_is_not_asked_again_even_when_alone(
    autojump_clock: object,
) -> None:
    busy = FakeWorker("a", Role.AGG, [Reject(ErrorCode.OVERLOADED), Stream()])
    with pytest.raises(NoCapacity):  # retry later (503), not the same worker at once
        await run(cluster(busy), request(3))
    assert len(busy.received) == 1


async def test_an_unreachable_worker_is_skipped_then_inhibited(autojump_clock: object) -> None:
    a = FakeWorker("a", Role.AGG, [Refuse()])
    b = FakeWorker("b", Role.AGG, [Stream()])
    router = cluster(a, b)
    chunks, metrics = await run(router, request(4))
    assert tokens(chunks) == expected(4)
    assert [r.request_id for r in b.received] == ["r.r1"]  # a retry, not a migration
    assert migrations(metrics) == 0
    view = {v.worker_id: v for v in router.views()}["a"]
    assert (view.state, view.failures) == (WorkerState.HEALTHY, 1)  # one fault: still in
    while len(a.received) < 2:  # round-robin comes back to it
        await run(router, request(1))
    states = {v.worker_id: v.state for v in router.views()}
    assert states == {"a": WorkerState.INHIBITED, "b": WorkerState.HEALTHY}


async def test_route_attempts_bound_the_workers_tried(autojump_clock: object) -> None:
    workers = [FakeWorker(w, Role.AGG, [Refuse()]) for w in "abc"]
    with pytest.raises(NoCapacity, match="no worker could take"):
        await run(cluster(*workers), request(), route_attempts=2)
    assert sum(len(w.received) for w in workers) == 2


async def test_the_migration_limit_bounds_the_attempts(autojump_clock: object) -> None:
    workers = [FakeWorker(w, Role.AGG, [Stream(break_after=1)]) for w in "abcd"]
    with pytest.raises(WorkerFailed, match="broke"):
        await run(cluster(*workers), request(), migration_limit=2)
    assert sum(len(w.received) for w in workers) == 3  # the first attempt and two more


async def test_overloaded_moves_on_and_internal_errors_stop(autojump_clock: object) -> None:
    busy = FakeWorker("a", Role.AGG, [Reject(ErrorCode.OVERLOADED)])
    fine = FakeWorker("b", Role.AGG, [Stream()])
    chunks, _ = await run(cluster(busy, fine), request(3))
    assert tokens(chunks) == expected(3)
    broken = FakeWorker("a", Role.AGG, [Reject(ErrorCode.INTERNAL)])
    spare = FakeWorker("b", Role.AGG, [Stream()])
    with pytest.raises(WorkerFailed, match="internal"):
        await run(cluster(broken, spare), request(3))
    assert spare.received == []


async def test_an_invalid_request_is_the_clients_error_not_the_workers(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Reject(ErrorCode.INVALID_REQUEST)])
    b = FakeWorker("b", Role.AGG, [Stream()])
    router = cluster(a, b)
    with pytest.raises(InvalidRequest, match="says no"):
        await run(router, request())
    assert b.received == []  # not tried elsewhere: it would be refused there too
    view = next(v for v in router.views() if v.worker_id == "a")
    assert (view.state, view.failures) == (WorkerState.HEALTHY, 0)


async def test_a_failed_prefill_leg_is_retried_on_another_prefill_worker(
    autojump_clock: object,
) -> None:
    p1 = FakeWorker("p1", Role.PREFILL, [Refuse()])
    p2 = FakeWorker("p2", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Stream()])
    chunks, metrics = await run(cluster(p1, p2, d), request(4))
    assert tokens(chunks) == expected(4)
    (leg,) = d.received
    assert leg.kv_handle is not None
    assert leg.kv_handle.worker_id == "p2"
    assert migrations(metrics) == 0


async def test_a_prefill_that_breaks_moves_to_another_prefill_worker(
    autojump_clock: object,
) -> None:
    p1 = FakeWorker("p1", Role.PREFILL, [Prefill(break_first=True)])
    p2 = FakeWorker("p2", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Stream()])
    chunks, metrics = await run(cluster(p1, p2, d), request(4))
    assert tokens(chunks) == expected(4)
    assert [r.request_id for r in p2.received] == ["r.m1"]
    (leg,) = d.received
    assert leg.kv_handle is not None
    assert leg.kv_handle.worker_id == "p2"
    assert migrations(metrics) == 1


async def test_a_broken_decode_continues_on_another_decode_worker(
    autojump_clock: object,
) -> None:
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d1 = FakeWorker("d1", Role.DECODE, [Stream(break_after=2)])
    d2 = FakeWorker("d2", Role.DECODE, [Stream()])
    chunks, _ = await run(cluster(p, d1, d2), request(6))
    assert tokens(chunks) == expected(6)
    # The continuation is prefilled again (prompt + the two tokens), then decoded on d2.
    assert [len(r.token_ids) for r in p.received] == [20, 22]
    (moved,) = d2.received
    assert moved.kv_handle is not None
    assert moved.kv_handle.transfer_id == "kv-r.m1"
    assert moved.sampling.max_tokens == 4


async def test_a_kv_pull_that_fails_prefills_again(autojump_clock: object) -> None:
    p1 = FakeWorker("p1", Role.PREFILL, [Prefill()])
    p2 = FakeWorker("p2", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Reject(ErrorCode.KV_TRANSFER_FAILED), Stream()])
    chunks, metrics = await run(cluster(p1, p2, d), request(3))
    assert tokens(chunks) == expected(3)
    first, second = d.received
    assert first.kv_handle is not None
    assert second.kv_handle is not None
    assert second.kv_handle.transfer_id == "kv-r.m1"  # a new prefill's KV
    assert migrations(metrics) == 1


async def test_kv_nobody_will_pull_is_released_on_its_prefill_worker(
    autojump_clock: object,
) -> None:
    # Served: the decode worker pulled it, nothing to release.
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Stream()])
    await run(cluster(p, d), request(3))
    assert p.released == []
    # The decode worker broke before its first token: this KV is released, the
    # continuation's is pulled by the next one.
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d1 = FakeWorker("d1", Role.DECODE, [Stream(break_after=0)])
    d2 = FakeWorker("d2", Role.DECODE, [Stream()])
    chunks, _ = await run(cluster(p, d1, d2), request(3))
    assert tokens(chunks) == expected(3)
    assert p.released == ["kv-r"]
    # No decode worker could take it: released before the error reaches the caller.
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Refuse()])
    with pytest.raises(NoCapacity):
        await run(cluster(p, d), request(3), route_attempts=1)
    assert p.released == ["kv-r"]


async def test_kv_is_released_when_the_caller_leaves_before_the_decode_starts(
    autojump_clock: object,
) -> None:
    p = FakeWorker("p", Role.PREFILL, [Prefill()])
    d = FakeWorker("d", Role.DECODE, [Stream()])
    with trio.move_on_after(0.015):  # prefilled at 0.011, first token at 0.022
        await run(cluster(p, d), request(3))
    assert len(d.received) == 1
    assert d.cancelled == ["r"]
    assert p.released == ["kv-r"]


async def test_leaving_early_cancels_the_request_on_its_worker(autojump_clock: object) -> None:
    a = FakeWorker("a", Role.AGG, [Stream()])
    router = cluster(a)
    chunks, _ = await run(router, request(50), stop_after=2)
    assert tokens(chunks) == expected(2)
    assert a.cancelled == ["r"]
    assert router.views()[0].inflight == 0
    assert router.views()[0].served == 0


async def test_no_worker_of_the_role_is_no_capacity_after_the_queue_timeout(
    autojump_clock: object,
) -> None:
    start = trio.current_time()
    with pytest.raises(NoWorkers):
        await run(cluster(), request(), queue_timeout=2.0)
    assert trio.current_time() - start == pytest.approx(2.0, abs=0.2)


async def test_a_migration_waits_for_a_worker_that_is_about_to_join(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Stream(break_after=2), Refuse()])  # it died
    b = FakeWorker("b", Role.AGG, [Stream()])
    router = cluster(a)

    async def join_later() -> None:
        await trio.sleep(1.0)
        router.add(b)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(join_later)
        chunks, metrics = await run(router, request(5), queue_timeout=5.0)
    # a broke; asked again (nobody else yet), it refused; b joined and finished.
    assert tokens(chunks) == expected(5)
    assert [r.request_id for r in b.received] == ["r.m1.r1"]  # its second try
    assert migrations(metrics) == 1


def migration_kinds(metrics: FrontendMetrics) -> dict[str, float]:
    return {
        kind: metrics.model_migration_total.labels(kind)._value.get()
        for kind in ("new_request", "ongoing_request")
    }


async def test_migrations_are_counted_by_whether_tokens_had_reached_the_client(
    autojump_clock: object,
) -> None:
    p1 = FakeWorker("p1", Role.PREFILL, [Prefill(break_first=True)])
    p2 = FakeWorker("p2", Role.PREFILL, [Prefill()])
    d1 = FakeWorker("d1", Role.DECODE, [Stream(break_after=2)])
    d2 = FakeWorker("d2", Role.DECODE, [Stream()])
    chunks, metrics = await run(cluster(p1, p2, d1, d2), request(5))
    assert tokens(chunks) == expected(5)
    # The prefill broke before any token (new), d1 after two of them (ongoing).
    assert migration_kinds(metrics) == {"new_request": 1, "ongoing_request": 1}


async def test_an_excused_miss_is_retried_and_not_held_against_the_worker(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Refuse(excused=True), Stream()])
    router = cluster(a)
    chunks, metrics = await run(router, request(3), route_attempts=2)
    assert tokens(chunks) == expected(3)
    # The same worker again, under a new id: a late ACK of the first try is not the second's.
    assert [r.request_id for r in a.received] == ["r", "r.r1"]
    view = router.views()[0]
    assert (view.state, view.failures) == (WorkerState.HEALTHY, 0)
    assert migrations(metrics) == 0


async def test_when_every_worker_is_busy_a_request_waits_for_one(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Stream()])
    a.reported = WorkerLoad(active=10, waiting=500, kv_usage=0.5)  # busy: waiting >= 64
    router = cluster(a)

    async def relieve() -> None:
        await trio.sleep(2.0)
        a.reported = WorkerLoad(active=10, waiting=0, kv_usage=0.5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relieve)
        start = trio.current_time()
        chunks, _ = await run(router, request(2), queue_timeout=5.0)
    assert tokens(chunks) == expected(2)
    assert len(a.received) == 1
    waited = trio.current_time() - start
    assert 2.0 <= waited < 2.5  # it went as soon as the worker reported room


async def test_a_request_that_finds_every_worker_busy_too_long_gets_no_capacity(
    autojump_clock: object,
) -> None:
    a = FakeWorker("a", Role.AGG, [Stream()])
    a.reported = WorkerLoad(active=10, waiting=0, kv_usage=0.99)  # busy: KV nearly full
    start = trio.current_time()
    with pytest.raises(NoCapacity, match="All workers are busy") as info:
        await run(cluster(a), request(), queue_timeout=3.0)
    assert info.value.code == "all_busy"
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.2)
    assert a.received == []
    # Without a queue the request goes to the busy worker at once.
    chunks, _ = await run(cluster(a), request(2), queue_timeout=0.0)
    assert tokens(chunks) == expected(2)


async def test_the_streams_of_one_request_prefer_the_worker_the_first_picked(
    autojump_clock: object,
) -> None:
    # Round-robin would spread three streams over three workers; sharing an affinity
    # (the choices of one request, n > 1), they all go where the first went.
    a, b, c = (FakeWorker(w, Role.AGG, [Stream()]) for w in "abc")
    router = cluster(a, b, c)
    dispatcher = Dispatcher(router, MODEL)
    affinity: dict[Role, str] = {}
    for i in range(3):
        req = GenerateRequest(f"r.c{i}", MODEL, PROMPT, request(2).sampling)
        async with aclosing(dispatcher.stream(req, affinity)) as chunks:
            assert len(tokens([chunk async for chunk in chunks])) == 2
    assert affinity == {Role.AGG: "a"}
    assert used(a, b, c) == ["a"]
    assert len(a.received) == 3
    # A preferred worker that is busy while another is not is passed over.
    a.reported = WorkerLoad(active=10, waiting=500, kv_usage=0.5)
    async with aclosing(dispatcher.stream(request(2), affinity)) as chunks:
        assert len(tokens([chunk async for chunk in chunks])) == 2
    assert len(a.received) == 3
    assert affinity == {Role.AGG: "a"}


async def test_prompt_logprobs_are_asked_again_only_until_the_first_token_arrived(
    autojump_clock: object,
) -> None:
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    early = FakeWorker("a", Role.AGG, [Stream(break_after=0)])
    fine = FakeWorker("b", Role.AGG, [Stream()])
    await run(cluster(early, fine), GenerateRequest("r", MODEL, PROMPT, sampling))
    (moved,) = fine.received  # nothing delivered yet: the prompt's are still wanted
    assert moved.sampling.prompt_logprobs == 2
    late = FakeWorker("a", Role.AGG, [Stream(break_after=3)])
    fine = FakeWorker("b", Role.AGG, [Stream()])
    await run(cluster(late, fine), GenerateRequest("r", MODEL, PROMPT, sampling))
    (moved,) = fine.received  # they came with the first token: not again
    assert (moved.sampling.prompt_logprobs, moved.sampling.logprobs) == (None, 1)
