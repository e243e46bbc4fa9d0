"""Faults on demand: what goes wrong, for which requests, and where it is injected.

A test arms a fault on :class:`Faults` (``server.faults``); it hits the next ``times``
generation requests, in the order they reach a worker (admission's ``reject``: in the
order they arrive). Each is injected where the real fault would happen, so the frontend
meets it with its own code, as it would in production:

=====================  ===========================  =====================================
fault                  injected                     what the frontend does
=====================  ===========================  =====================================
``break_stream``       the worker's reply stream    the stream ends without End:
                       ends after N tokens          Disconnected, the request migrates
``malformed_answer``   the worker sends an Ack      a reply the protocol does not allow:
                       after N tokens               Disconnected, the request migrates
``kill_worker``        the worker serving it dies   its streams break (migration), it
                       after N tokens               leaves discovery
``refuse``             the workers answer Error     retries other workers, waits
                       ``overloaded``               ``queue_timeout`` for one: 503
``slow_first_token``   the worker waits before its  the client waits (TTFT)
                       first token
``stall_loop``         the event loop runs nothing  timers fire late; the loop monitor
                       for S seconds after N tokens records the stall
``reject``             admission refuses it         429 with ``Retry-After``
=====================  ===========================  =====================================

"After N tokens" is after the worker sent N output tokens for the request (0: before
the first), or before its answer's last token when the answer is not that long: an
armed fault always fires. A loop stall under a ``MockClock`` moves trio's clock on
while no task runs (``MockClock.jump``), else blocks the loop for real.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import trio
import trio.testing

from frontend.http.admission import Admission, Reason
from headwater.testing.records import Leg, current_record, plane_request
from headwater.wire import Ack, Chunk, End, Error, ErrorCode, GenerateRequest, Reply, Role
from headwater.wire.kv_events import KvEventBatch
from workers.runtime import WorkerRuntime

#: The faults that hit a request once, in its first generating leg, at a token count.
_AT_TOKENS = ("break_stream", "malformed_answer", "kill_worker", "stall_loop")


@dataclass(slots=True)
class _Armed:
    """One armed fault: its kind, its parameters, the requests it still hits."""

    kind: str
    times: int
    after_tokens: int = 0
    seconds: float = 0.0
    worker: str | None = None  # refuse: only this worker refuses


@dataclass(slots=True)
class _Claim:
    """The faults one request took, and how far it got with them."""

    faults: list[_Armed]
    fired: set[str] = field(default_factory=set)

    def pending(self, kind: str) -> _Armed | None:
        """The fault of *kind* this request took and that has not fired yet."""
        if kind in self.fired:
            return None
        return next((f for f in self.faults if f.kind == kind), None)


class Faults:
    """The fault plan of one server: arm faults here; see the module docstring.

    Every method arms a fault for the next *times* requests and returns at once, but
    :meth:`stall_loop` without ``after_tokens``, which stalls the loop there and then.
    """

    def __init__(self) -> None:
        self._armed: list[_Armed] = []
        self._claims: dict[str, _Claim] = {}
        #: Kills a worker by id (the in-process cluster's); set by the server.
        self.kill: Callable[[str], None] = _no_cluster

    # -- the test's side -------------------------------------------------------------

    def break_stream(self, after_tokens: int = 0, *, times: int = 1) -> None:
        """The worker's stream of the request ends after *after_tokens* tokens, as a
        broken connection does: no End. The frontend migrates it (attempt 2)."""
        self._arm(_Armed("break_stream", times, after_tokens=_count(after_tokens)))

    def malformed_answer(self, after_tokens: int = 0, *, times: int = 1) -> None:
        """After *after_tokens* tokens the worker sends a reply the protocol does not
        allow there (a second Ack). The frontend takes the stream as broken and migrates
        the request."""
        self._arm(_Armed("malformed_answer", times, after_tokens=_count(after_tokens)))

    def kill_worker(self, after_tokens: int = 0, *, times: int = 1) -> None:
        """The worker streaming the request dies after *after_tokens* tokens: every
        request on it breaks and it leaves the cluster. With another worker of its role
        the request migrates there; without one it waits ``queue_timeout``, then 503."""
        self._arm(_Armed("kill_worker", times, after_tokens=_count(after_tokens)))

    def refuse(self, *, times: int = 1, worker: str | None = None) -> None:
        """The workers refuse the request (``overloaded``); only *worker* does when
        given. The frontend tries the others; when none will, it waits
        ``queue_timeout`` for one, then answers 503."""
        self._arm(_Armed("refuse", times, worker=worker))

    def slow_first_token(self, seconds: float, *, times: int = 1) -> None:
        """The worker holds the request's first token back *seconds* (after its ACK);
        later tokens follow as the engine made them."""
        self._arm(_Armed("slow_first_token", times, seconds=_seconds(seconds)))

    def stall_loop(
        self, seconds: float, *, after_tokens: int | None = None, times: int = 1
    ) -> None:
        """The event loop runs nothing for *seconds*: at once without *after_tokens*
        (``times`` is then ignored), else when the request has streamed that many tokens.
        Under a MockClock trio's clock jumps *seconds* (virtual time); otherwise the loop
        is blocked for real (``time.sleep``)."""
        if after_tokens is None:
            stall(_seconds(seconds))
            return
        self._arm(
            _Armed(
                "stall_loop", times, after_tokens=_count(after_tokens), seconds=_seconds(seconds)
            )
        )

    def reject(self, *, times: int = 1) -> None:
        """Admission refuses the request as over ``max_inflight``: 429 with
        ``Retry-After``, before its body is read."""
        self._arm(_Armed("reject", times))

    @property
    def armed(self) -> list[str]:
        """The faults still armed, by name, once per request they will hit."""
        return [f.kind for f in self._armed for _ in range(f.times)]

    def clear(self) -> None:
        """Disarm every fault (those already taken by a request still fire)."""
        self._armed.clear()

    def _arm(self, fault: _Armed) -> None:
        if fault.times < 1:
            raise ValueError(f"times must be >= 1, got {fault.times}")
        self._armed.append(fault)

    # -- the server's side -----------------------------------------------------------

    def take_reject(self) -> bool:
        """Admission's question: is this request to be refused?"""
        return self._take(("reject",)) != []

    def claim(self, request_id: str) -> _Claim:
        """The faults of the request with plane id *request_id* (any of its legs'),
        taken from those armed on its first leg."""
        base, _ = plane_request(request_id)  # <id>.r1 and <id>.m1 are <id>'s legs
        claim = self._claims.get(base)
        if claim is None:
            claim = self._claims[base] = _Claim(
                self._take(
                    (
                        "break_stream",
                        "malformed_answer",
                        "kill_worker",
                        "refuse",
                        "slow_first_token",
                        "stall_loop",
                    )
                )
            )
            record = current_record.get()
            if record is not None:
                record.faults.extend(f.kind for f in claim.faults)
        return claim

    def _take(self, kinds: tuple[str, ...]) -> list[_Armed]:
        taken: list[_Armed] = []
        for fault in list(self._armed):
            if fault.kind in kinds and fault.kind not in {f.kind for f in taken}:
                taken.append(fault)
                fault.times -= 1
                if fault.times == 0:
                    self._armed.remove(fault)
        return taken


class FaultyAdmission(Admission):
    """Admission with :meth:`Faults.reject` on top: what the in-process server's
    frontend is built with (``Frontend(admission=FaultyAdmission)``)."""

    faults: Faults | None = None

    def admit(self) -> Reason | None:
        if self.faults is not None and self.faults.take_reject():
            self._rejected += 1
            record = current_record.get()
            if record is not None:
                record.faults.append("reject")
            return Reason.MAX_INFLIGHT
        return super().admit()


class ObservedRuntime:
    """A worker runtime as the frontend's in-process client reaches it, with each
    request recorded as a :class:`Leg` and the fault plan applied; see the module
    docstring. Everything else is the runtime's."""

    def __init__(
        self, runtime: WorkerRuntime, role: Role, faults: Faults, nursery: trio.Nursery
    ) -> None:
        self.runtime = runtime
        self.role = role
        self.faults = faults
        self._nursery = nursery

    @property
    def worker_id(self) -> str:
        return self.runtime.worker_id

    @property
    def engine(self) -> object:
        return self.runtime.engine

    def submit(self, request: GenerateRequest, replies: trio.abc.SendChannel[Reply]) -> None:
        leg = Leg(self.worker_id, self.role.value, request.request_id, trio.current_time())
        record = current_record.get()
        if record is not None:
            record.legs.append(leg)
        claim = self.faults.claim(request.request_id)
        refusal = claim.pending("refuse")
        if refusal is not None and refusal.worker in (None, self.worker_id):
            leg.faults.append("refuse")
            leg.outcome, leg.error_code = "refused", ErrorCode.OVERLOADED.value
            leg.ended = trio.current_time()
            leg.finished.set()
            self._nursery.start_soon(_refuse, replies, request.request_id)
            return
        generating = self.role is not Role.PREFILL
        kill = partial(self.faults.kill, self.worker_id)
        try:
            self.runtime.submit(
                request, _LegReplies(replies, leg, claim if generating else None, kill)
            )
        except RuntimeError:  # the worker stopped: the client reports it unreachable
            leg.outcome, leg.ended = "unreachable", trio.current_time()
            leg.finished.set()
            raise

    def cancel(self, request_id: str) -> None:
        self.runtime.cancel(request_id)

    def kv_events(self, since: int, limit: int) -> KvEventBatch | None:
        return self.runtime.kv_events(since, limit)

    def release_kv(self, transfer_id: str) -> None:
        self.runtime.release_kv(transfer_id)


class _LegReplies(trio.abc.SendChannel[Reply]):
    """A worker's replies to one leg, on their way to the frontend: counted into the
    leg, with the request's faults injected (*claim*: None for a prefill leg)."""

    def __init__(
        self,
        inner: trio.abc.SendChannel[Reply],
        leg: Leg,
        claim: _Claim | None,
        kill: Callable[[], None],
    ) -> None:
        self._inner = inner
        self._leg = leg
        self._claim = claim
        self._kill = kill
        self._broken = False

    async def send(self, value: Reply) -> None:
        if self._broken:
            raise trio.BrokenResourceError("the stream was broken by a fault")
        leg = self._leg
        if isinstance(value, Chunk) and value.token_ids and self._claim is not None:
            await self._send_tokens(value, self._claim)
            return
        if isinstance(value, Chunk):
            leg.tokens += len(value.token_ids)
            if value.finish_reason is not None:
                leg.finish_reason = value.finish_reason.value
        elif isinstance(value, End):
            leg.outcome = "finished"
        elif isinstance(value, Error):
            leg.outcome, leg.error_code = "error", value.code.value
        await self._inner.send(value)

    async def _send_tokens(self, chunk: Chunk, claim: _Claim) -> None:
        leg = self._leg
        slow = claim.pending("slow_first_token")
        if slow is not None:
            claim.fired.add("slow_first_token")
            leg.faults.append("slow_first_token")
            await trio.sleep(slow.seconds)
        tokens = list(chunk.token_ids)
        for kind in _AT_TOKENS:
            fault = claim.pending(kind)
            if fault is None:
                continue
            last = chunk.finish_reason is not None
            # After `after_tokens` tokens, or before the answer's last one.
            cut = min(fault.after_tokens, leg.tokens + len(tokens) - 1 if last else math.inf)
            if cut >= leg.tokens + len(tokens):
                continue  # further on
            claim.fired.add(kind)
            leg.faults.append(kind)
            head = int(cut) - leg.tokens
            if head:
                await self._forward(replace(chunk, token_ids=tokens[:head], finish_reason=None))
            tokens = tokens[head:]
            if kind == "stall_loop":
                stall(fault.seconds)
                continue
            await self._fail(kind, chunk.request_id)
        await self._forward(replace(chunk, token_ids=tokens))

    async def _forward(self, chunk: Chunk) -> None:
        self._leg.tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self._leg.finish_reason = chunk.finish_reason.value
        await self._inner.send(chunk)

    async def _fail(self, kind: str, request_id: str) -> None:
        """End the leg as *kind* says; raises into the runtime as a peer that left would
        (or as the worker's own death: Cancelled)."""
        leg = self._leg
        leg.ended = trio.current_time()
        if kind == "kill_worker":
            leg.outcome = "killed"
            self._kill()
            await trio.lowlevel.checkpoint()  # the runtime's scope is cancelled: raises
        if kind == "malformed_answer":
            leg.outcome = "malformed"
            await self._inner.send(Ack(request_id))  # not allowed after the first reply
        else:
            leg.outcome = "broken"
        self._broken = True
        await self._inner.aclose()
        raise trio.BrokenResourceError(f"{kind} (headwater.testing)")

    async def aclose(self) -> None:
        leg = self._leg
        if leg.outcome == "running":
            leg.outcome = "cancelled"
        if leg.ended is None:
            leg.ended = trio.current_time()
        leg.finished.set()
        await self._inner.aclose()


async def _refuse(replies: trio.abc.SendChannel[Reply], request_id: str) -> None:
    async with replies:
        await replies.send(Error(request_id, ErrorCode.OVERLOADED, "refused (headwater.testing)"))


def stall(seconds: float) -> None:
    """Run nothing on this loop for *seconds*: jump a MockClock, else block for real."""
    clock = trio.lowlevel.current_clock()
    if isinstance(clock, trio.testing.MockClock):
        clock.jump(seconds)
    else:
        time.sleep(seconds)  # blocking the loop is the point


def _no_cluster(worker_id: str) -> None:
    raise RuntimeError(f"cannot kill {worker_id}: no in-process cluster")


def _count(n: int) -> int:
    if n < 0:
        raise ValueError(f"after_tokens must be >= 0, got {n}")
    return n


def _seconds(s: float) -> float:
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"seconds must be >= 0, got {s}")
    return s
