"""Dispatch: one request's token stream, from whichever workers can produce it.

The pipeline hands :meth:`Dispatcher.stream` a :class:`~headwater.wire.GenerateRequest`
and consumes :class:`~headwater.wire.Chunk`\\ s; where they come from is decided here,
in three nested loops:

* **route** — per attempt, the layout: a prefill leg (which answers with a
  :class:`~headwater.wire.KvHandle`) then a decode leg carrying the handle, when both
  roles are routable; else one aggregated leg; else a decode worker alone (it
  prefills locally).
* **retry** — per leg, another worker of the role when one cannot take the request
  (no connection or no ACK: :class:`~headwater.plane.CannotConnect`, which the router
  also counts against that worker's health; or a retryable refusal: overloaded,
  draining), up to ``route_attempts`` workers per leg, each try under its own request
  id (``<id>.r<n>``). While no worker of the role can
  take it (none routable, or all busy) the request waits, up to ``queue_timeout``.
* **migrate** — when a stream breaks after its ACK (:class:`~headwater.plane.Disconnected`),
  a worker fails it retryably after some of its tokens were relayed (its engine went
  down mid-stream), or a decode worker could not pull the prefill's KV, the request
  starts again on other workers with the tokens generated so far appended to the
  prompt and ``max_tokens`` / ``min_tokens`` reduced by as many, under a new request id
  (``<id>.m<n>``), up to ``migration_limit`` times. The consumer sees one stream: no
  token twice, none missing. A constrained answer (structured outputs) migrates only
  before its first token: its grammar cannot resume on the tokens so far.

A worker that could not take a request (unreachable, or refused it retryably) is not
picked again for that request. One whose stream of it broke (or that failed it
mid-stream) is not picked again while another worker of the role is routable: its id
may well be a new process by then (``headwater launch`` restarts a worker under its id
and port), and when every worker of the role has broken the request once, such as
when all of them were restarted in turn during a long stream, going back to one beats
failing a request the cluster could serve. Errors come out as the frontend's own
(:mod:`frontend.errors`): a worker's ``invalid_request`` refusal is the client's
:class:`~frontend.errors.InvalidRequest` and never counts against the worker; no
worker to try is :class:`~frontend.errors.NoCapacity`; anything else the workers do
wrong, once retries are spent, is :class:`~frontend.errors.WorkerFailed`.

**Affinity.** The choices of one request (``n`` > 1) are streams of their own, which
share an ``affinity``: the worker the first of them picked for a role is preferred by
the others (unless it is busy while another is not), so their prompt's KV is computed
once and found in that worker's prefix cache by the rest.

Structured concurrency: :meth:`Dispatcher.stream` is an async generator consumed in
the request's own task and closed with ``aclosing``; it holds no cancel scope across
a ``yield``. Closing it (the client left, a stop string matched) leaves the current
``client.stream(...)`` block, which cancels the request on its worker.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from frontend.errors import InvalidRequest, NoCapacity, NoWorkers, WorkerFailed
from frontend.router.kv_index import prompt_hashes
from frontend.router.router import Policy, Prompt, Router
from headwater.plane import CannotConnect, Disconnected, WorkerClient, WorkerError
from headwater.tracing import NULL_SPAN, Span, SpanKind, current_trace, tracer
from headwater.wire import Chunk, ErrorCode, GenerateRequest, KvHandle, Role
from headwater.wire.tokens import token_array

if TYPE_CHECKING:
    from frontend.metrics import FrontendMetrics

log = logging.getLogger(__name__)

_BUSY_RECHECK_S = 0.1  # how often a queued request looks at the workers' reported load
#: Prompts at least this long are hashed for ``--router kv`` in a thread (~0.3 ms of
#: hashing at 64 tokens a block); shorter ones inline, cheaper than the thread hop.
_HASH_INLINE_MAX_TOKENS = 4096

#: Runs a function with its arguments off the loop and returns its result.
Offload = Callable[..., Awaitable[Any]]


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """How hard dispatch tries before it gives up on a request."""

    #: Times a broken stream (or a failed KV pull) may move to other workers.
    migration_limit: int = 3
    #: Workers tried per leg when one cannot take the request.
    route_attempts: int = 3
    #: Seconds a request waits for a worker that is not busy when all are, before it
    #: gets 503 "all workers are busy"; 0 sends it to a busy one at once.
    queue_timeout: float = 10.0
    #: Requests that may wait so at once; beyond, 503 at once.
    queue_size: int = 1024
    #: Conditional disaggregation: a request whose prompt has at most this many tokens
    #: not cached (on the decode workers, as far as ``--router kv``'s index knows; else
    #: the whole prompt) runs whole on a decode worker, which prefills it itself: a short
    #: prefill costs less there than a KV transfer. 0: always disaggregate.
    local_prefill_max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class _HeldKv:
    """KV a prefill worker holds for this request, and that worker's client."""

    holder: WorkerClient
    handle: KvHandle


class _Migrate(Exception):
    """This attempt's output cannot continue where it is; start over elsewhere."""


@dataclass(slots=True)
class _Attempts:
    """One request's dispatch state across its attempts."""

    #: Workers that could not take this request (unreachable, refused it retryably):
    #: not picked for it again.
    refused: set[str] = field(default_factory=set)
    #: Workers whose stream of this request broke, or that failed it mid-stream
    #: (retryably, after tokens were relayed): not picked again while another
    #: worker of the role is routable.
    broke: set[str] = field(default_factory=set)
    migrations: int = 0
    #: Tokens delivered to the caller so far.
    delivered: int = 0
    #: The worker whose stream the current leg relays.
    serving: WorkerClient | None = None
    #: The worker per role that the streams of this request prefer (shared by them).
    affinity: dict[Role, str] | None = None
    #: The request's "dispatch" span: each leg's is its child.
    span: Span = NULL_SPAN
    #: The prompt as ``--router kv`` weighs it (None under the other policies).
    prompt: Prompt | None = None
    #: Prompt tokens the current attempt's prefill worker found cached.
    prefill_cached: int = 0

    def failed(self) -> frozenset[str]:
        """Every worker that failed this request (to reach one that has not)."""
        return frozenset(self.refused | self.broke)

    def excluded(self, router: Router, role: Role, model: str) -> frozenset[str]:
        """The workers of *role* not to pick for this request now."""
        both = self.failed()
        if self.broke and not router.routable(role, model, both):
            return frozenset(self.refused)  # every other one is gone: back to those
        return both


class Dispatcher:
    """Routes, retries and migrates requests for one model; see the module docstring."""

    def __init__(
        self,
        router: Router,
        model: str,
        *,
        config: DispatchConfig | None = None,
        metrics: FrontendMetrics | None = None,
        offload: Offload | None = None,
    ) -> None:
        """*offload* runs CPU work off the loop (a long prompt's block hashes); by
        default in a thread (the pipeline's: its tokenizer pool's ``offload``)."""
        self.router = router
        self.model = model
        self.config = config or DispatchConfig()
        self.metrics = metrics
        self.offload: Offload = offload or _in_thread
        self._queued = 0  # requests waiting for a worker that is not busy

    def ready(self) -> bool:
        """A request could be served now: prefill + decode, or an aggregated worker."""
        r, m = self.router, self.model
        disagg = r.routable(Role.PREFILL, m) > 0 and r.routable(Role.DECODE, m) > 0
        return disagg or r.routable(Role.AGG, m) > 0

    async def stream(
        self,
        request: GenerateRequest,
        affinity: dict[Role, str] | None = None,
        *,
        hashes: Sequence[int] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """The request's chunks, from one or more workers; the last carries
        ``finish_reason`` (unless the caller stops reading first). *affinity*: shared
        by the streams of one request (see the module docstring). *hashes*: the
        prompt's block hashes for ``--router kv`` when preprocess computed them (else
        they are computed here).

        Raises InvalidRequest, NoCapacity or WorkerFailed (see the module docstring).
        """
        generated = token_array()
        state = _Attempts(affinity=affinity)
        if self.router.policy is Policy.KV:
            state.prompt = (
                await self._prompt(request)
                if hashes is None
                else Prompt(len(request.token_ids), hashes)
            )
        with tracer().span("dispatch", parent=current_trace().span) as state.span:
            while True:
                attempt = self._continuation(request, generated, state.migrations)
                try:
                    async with aclosing(self._attempt(attempt, state)) as chunks:
                        async for chunk in chunks:
                            generated.extend(chunk.token_ids)
                            state.delivered = len(generated)
                            yield chunk
                    return
                except _Migrate as exc:
                    if state.migrations >= self.config.migration_limit:
                        raise WorkerFailed(f"the worker's stream broke ({exc})") from exc
                    if generated and request.sampling.structured is not None:
                        # The constraint's grammar would start over on the tokens so far,
                        # as if they were prompt: the answer would no longer be what it asked.
                        raise WorkerFailed(
                            f"the worker's stream broke ({exc}), and a "
                            "constrained answer cannot continue elsewhere"
                        ) from exc
                    state.migrations += 1
                    # As Dynamo counts them: before any token reached the caller, or after.
                    kind = "ongoing_request" if generated else "new_request"
                    if self.metrics is not None:
                        self.metrics.model_migration_total.labels(kind).inc()
                    state.span.event(
                        "migration",
                        {
                            "headwater.migration": state.migrations,
                            "headwater.migration.kind": kind,
                            "headwater.tokens_delivered": len(generated),
                            "reason": str(exc),
                        },
                    )
                    log.warning(
                        "request %s: %s; migrating with %d tokens",
                        request.request_id,
                        exc,
                        len(generated),
                    )

    async def _prompt(self, request: GenerateRequest) -> Prompt:
        """The request's block hashes for ``--router kv``: in a thread for a long
        prompt (~0.5 µs per block; docs/routing.md), so the loop stays free."""
        tokens, size = request.token_ids, self.router.kv.block_size
        if len(tokens) >= _HASH_INLINE_MAX_TOKENS:
            hashes = await self.offload(prompt_hashes, tokens, size)
        else:
            hashes = prompt_hashes(tokens, size)
        return Prompt(len(tokens), hashes)

    @staticmethod
    def _continuation(
        request: GenerateRequest, generated: array[int], migrations: int
    ) -> GenerateRequest:
        """*request* as it continues after *migrations* migrations with *generated*
        tokens already delivered: the request itself until then (its token array as
        it is: nothing downstream writes to it). The prompt's logprobs came with the
        first token: once that is delivered they are not asked again."""
        if migrations == 0:
            return request
        sampling = request.sampling
        return replace(
            request,
            request_id=f"{request.request_id}.m{migrations}",
            token_ids=token_array(request.token_ids) + generated,
            sampling=replace(
                sampling,
                max_tokens=sampling.max_tokens - len(generated),
                min_tokens=max(0, sampling.min_tokens - len(generated)),
                prompt_logprobs=None if generated else sampling.prompt_logprobs,
            ),
            kv_handle=None,
        )

    async def _attempt(
        self, request: GenerateRequest, state: _Attempts
    ) -> AsyncGenerator[Chunk, None]:
        """One attempt: disaggregated when both roles are routable (the prefill leg
        runs here and the request gains its KV handle), else aggregated."""
        r, m = self.router, self.model

        def routable(role: Role) -> int:
            return r.routable(role, m, state.excluded(r, role, m))

        if not any(routable(role) for role in Role):
            # Nobody left for this request (its last worker just failed): wait a while
            # for one to join or come back before giving up.
            with trio.move_on_after(self.config.queue_timeout):
                while not any(routable(role) for role in Role):
                    await r.changed.wait()
            if not any(routable(role) for role in Role):
                raise NoWorkers(f"no routable worker for model {m!r}")
        prefill, decode = routable(Role.PREFILL), routable(Role.DECODE)
        role = Role.DECODE  # a decode worker can prefill locally when alone
        held: _HeldKv | None = None  # the prefill's KV, until a decode worker has it
        try:
            if prefill and decode and not self._prefill_locally(request, state):
                held = await self._prefill(request, state)
                request = replace(request, kv_handle=held.handle)
            elif routable(Role.AGG) and (
                r.routable(Role.AGG, m, failed := state.failed())
                or not r.routable(Role.DECODE, m, failed)
            ):
                # An aggregated worker, unless the only ones left broke this request and
                # a decode worker that did not is there to prefill it locally.
                role = Role.AGG
            state.prefill_cached = state.prefill_cached if held is not None else 0
            cap = len(request.token_ids)
            async with aclosing(self._leg(role, request, state)) as chunks:
                async for chunk in chunks:
                    held = None  # a decode worker's first chunk comes after its pull
                    if state.prefill_cached:
                        # The prompt tokens the prefill worker did not compute, plus any
                        # the decode worker found cached past what it pulled.
                        cached = min(cap, state.prefill_cached + chunk.cached_tokens)
                        chunk = replace(chunk, cached_tokens=cached)
                    yield chunk
        finally:
            if held is not None:
                # No decode worker got as far as a token (the request ended, or this
                # attempt failed and the next one prefills again): nobody will pull
                # this KV, so free it now rather than at the prefill's timeout.
                held.holder.release_kv(held.handle)

    def _prefill_locally(self, request: GenerateRequest, state: _Attempts) -> bool:
        """Conditional disaggregation (:attr:`DispatchConfig.local_prefill_max_tokens`):
        the prompt's uncached part is short enough for a decode worker to prefill."""
        limit = self.config.local_prefill_max_tokens
        if limit <= 0:
            return False
        uncached = len(request.token_ids)
        if state.prompt is not None and self.router.kv.uses_events:
            decode = {
                c.instance.worker_id
                for c in self.router.clients()
                if c.instance.role is Role.DECODE
            }
            found = self.router.kv_index.overlaps(state.prompt.hashes)
            cached = max((n for wid, n in found.items() if wid in decode), default=0)
            uncached -= cached * self.router.kv.block_size
        local = uncached <= limit
        if local:
            state.span.event("local_prefill", {"headwater.uncached_tokens": uncached})
        return local

    async def _prefill(self, request: GenerateRequest, state: _Attempts) -> _HeldKv:
        held = None
        state.prefill_cached = 0
        try:
            async with aclosing(self._leg(Role.PREFILL, request, state)) as chunks:
                async for chunk in chunks:
                    state.prefill_cached = max(state.prefill_cached, chunk.cached_tokens)
                    if chunk.kv_handle is not None and state.serving is not None:
                        held = _HeldKv(state.serving, chunk.kv_handle)
        except BaseException:
            if held is not None:  # the leg broke (or was cancelled) after the handle
                held.holder.release_kv(held.handle)
            raise
        if held is None:
            raise WorkerFailed("the prefill worker returned no KV handle")
        return held

    async def _leg(
        self, role: Role, request: GenerateRequest, state: _Attempts
    ) -> AsyncGenerator[Chunk, None]:
        """Route to a worker of *role* and relay its chunks, trying another worker
        (up to ``route_attempts``) when one cannot take the request."""
        tried = 0
        while True:
            await self._wait_for_worker(role, state)
            client = self._pick(role, state)
            tried += 1
            wid = client.instance.worker_id
            # Each try has its own id: a late ACK or reply of an earlier try (the same
            # worker may be picked again) can never be taken for this one's.
            leg = (
                request
                if tried == 1
                else replace(request, request_id=f"{request.request_id}.r{tried - 1}")
            )
            # The consumer closes this generator at the yield of the final chunk, so
            # success is booked in `finally`, from what was seen, not after the loop.
            finished = False
            relayed = False  # a chunk of this leg reached the caller
            t = tracer()
            attributes = (
                {
                    "headwater.worker.id": wid,
                    "headwater.plane.request_id": leg.request_id,
                    "headwater.router.policy": self.router.policy.value,
                    "headwater.attempt": tried,
                    "headwater.migration": state.migrations,
                }
                if t.enabled
                else None
            )
            with t.span(
                f"leg {role.value}", parent=state.span, kind=SpanKind.CLIENT, attributes=attributes
            ) as span:
                if span.recording:  # the worker's spans become this leg's children
                    leg = replace(leg, traceparent=span.traceparent, tracestate=span.tracestate)
                blocks = 0
                if state.prompt is not None:
                    blocks = -(-state.prompt.num_tokens // self.router.kv.block_size)
                try:
                    with self.router.track(client, blocks):
                        state.serving = client
                        async with client.stream(leg) as replies:
                            span.event("ack")
                            async for chunk in replies:
                                finished = chunk.finish_reason is not None
                                relayed = True
                                yield chunk
                    finished = True  # End received (a prefill leg has no finish reason)
                    return
                except CannotConnect as exc:
                    span.fail(f"no ACK: {exc}")
                    if exc.excused:
                        # Our own loop stalled through the ACK window: not the worker's
                        # fault (headwater.instrumentation.attribution). Try again.
                        log.warning(
                            "worker %s: ACK missed while this loop was stalled; "
                            "not counted against it",
                            wid,
                        )
                    else:
                        state.refused.add(wid)
                        self.router.report_failure(client, exc)
                        log.warning("worker %s unreachable: %s", wid, exc)
                    if tried >= self.config.route_attempts:
                        raise NoCapacity("no worker could take the request") from exc
                except Disconnected as exc:
                    state.broke.add(wid)
                    self.router.report_failure(client, exc)
                    raise _Migrate(f"{role.value} worker {wid}: {exc}") from exc
                except WorkerError as exc:
                    if relayed and exc.retryable:
                        # Failed mid-stream (its engine went down): the tokens so far
                        # stand, the rest comes from elsewhere, as after a broken stream.
                        state.broke.add(wid)
                        raise _Migrate(f"{role.value} worker {wid}: {exc.message}") from exc
                    span.fail(f"refused: {exc.code.value}")
                    self._refused(role, client, exc, state, tried)
                finally:
                    if finished:
                        self.router.report_success(client)

    def _refused(
        self, role: Role, client: WorkerClient, exc: WorkerError, state: _Attempts, tried: int
    ) -> None:
        """A worker answered with an Error: decide what that means for the request.

        Returns to try another worker of the role; raises otherwise.
        """
        wid = client.instance.worker_id
        if exc.code is ErrorCode.INVALID_REQUEST:
            raise InvalidRequest(exc.message) from exc
        if exc.code is ErrorCode.KV_TRANSFER_FAILED and role is Role.DECODE:
            # The prefill's KV is gone (expired, its worker died): prefill again.
            raise _Migrate(f"decode worker {wid} could not pull the KV: {exc.message}") from exc
        if not exc.retryable or tried >= self.config.route_attempts:
            raise WorkerFailed(f"the worker failed the request ({exc.code.value})") from exc
        state.refused.add(wid)

    async def _wait_for_worker(self, role: Role, state: _Attempts) -> None:
        """Wait, in a bounded queue and up to ``queue_timeout``, while no worker of *role*
        can take the request: none is routable (the last one just failed, the next has
        not joined yet) or every routable one is busy. Raises NoWorkers or NoCapacity
        ("all workers are busy") when the wait is over and nothing changed."""
        cfg, router, model = self.config, self.router, self.model

        def blocked() -> bool:
            exclude = state.excluded(router, role, model)
            return not router.routable(role, model, exclude) or router.all_busy(
                role, model, exclude
            )

        if cfg.queue_timeout <= 0 or not blocked():
            return
        if self._queued >= cfg.queue_size:
            raise self._none_free(role, state.excluded(router, role, model))
        self._queued += 1
        try:
            with trio.move_on_after(cfg.queue_timeout):
                while blocked():
                    # A worker's load comes with its heartbeats too, which do not notify
                    # the router: look again now and then as well.
                    with trio.move_on_after(_BUSY_RECHECK_S):
                        await router.changed.wait()
                return
            raise self._none_free(role, state.excluded(router, role, model))
        finally:
            self._queued -= 1

    def _none_free(self, role: Role, exclude: frozenset[str]) -> NoCapacity:
        if self.router.routable(role, self.model, exclude):
            return NoCapacity("All workers are busy, please retry later", code="all_busy")
        return NoWorkers(f"no routable {role.value} worker for model {self.model!r}")

    def _pick(self, role: Role, state: _Attempts) -> WorkerClient:
        """A worker of *role* for this request (see :meth:`_Attempts.excluded`), the
        one its affinity names if it can; raises NoWorkers."""
        affinity = state.affinity
        exclude = state.excluded(self.router, role, self.model)
        if affinity is None:
            return self.router.pick(role, self.model, exclude, state.prompt)
        client = self.router.pick(
            role, self.model, exclude, state.prompt, prefer=affinity.get(role)
        )
        affinity.setdefault(role, client.instance.worker_id)
        return client
