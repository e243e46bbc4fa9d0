"""The route stage: which worker gets the next request.

The router holds every known :class:`WorkerClient` (added and removed by discovery
or by the in-process cluster), tracks each one's in-flight requests and health, and
picks per role with one of four policies:

* ``round-robin`` — in turn;
* ``random`` — uniformly;
* ``least-loaded`` — fewest in-flight requests (ties in turn);
* ``p2c`` — power of two choices: the less loaded of two random picks.

Health: a worker that fails to ACK (:class:`CannotConnect`) is *inhibited* — skipped
by routing — for ``inhibit_s``, doubling on each consecutive failure up to
``max_inhibit_s`` and reset by a success. (Dynamo brings a worker back after a fixed
5 s; the backoff keeps a genuinely dead worker from eating a request every 5 s.)
A draining worker (announced by discovery) gets no new requests.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio
from trio_util import RepeatedEvent

from frontend.errors import NoWorkers
from headwater.plane.base import WorkerClient
from headwater.wire import Role


class Policy(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"
    P2C = "p2c"


class WorkerState(enum.StrEnum):
    HEALTHY = "healthy"
    INHIBITED = "inhibited"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A read-only snapshot of one worker, for /debug/workers, metrics and the dashboard."""

    worker_id: str
    role: Role
    model: str
    address: str
    state: WorkerState
    inflight: int
    served: int
    failures: int
    last_error: str | None
    inhibited_for_s: float


class _Entry:
    __slots__ = (
        "client",
        "draining",
        "failures",
        "inflight",
        "inhibited_until",
        "last_error",
        "served",
    )

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.inflight = 0
        self.served = 0
        self.failures = 0  # consecutive
        self.inhibited_until = 0.0
        self.last_error: str | None = None
        self.draining = False

    def state(self, now: float) -> WorkerState:
        if self.draining:
            return WorkerState.DRAINING
        if now < self.inhibited_until:
            return WorkerState.INHIBITED
        return WorkerState.HEALTHY


class Router:
    """Picks workers; see the module docstring for policies and health."""

    def __init__(
        self,
        policy: Policy | str = Policy.ROUND_ROBIN,
        *,
        inhibit_s: float = 5.0,
        max_inhibit_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = Policy(policy)
        self.inhibit_s = inhibit_s
        self.max_inhibit_s = max_inhibit_s
        self._rng = rng or random.Random()
        self._entries: dict[str, _Entry] = {}
        # One turn counter per (role, model): a shared one would lock the prefill and
        # decode legs of serial requests into the same phase on every pick.
        self._turns: dict[tuple[Role, str], itertools.count[int]] = {}
        #: Set whenever the set of workers or their routability changes; ``await
        #: router.changed.wait()`` returns at the next change.
        self.changed = RepeatedEvent()

    # -- membership (discovery's side) ------------------------------------------

    def add(self, client: WorkerClient) -> None:
        """Start routing to *client*; replaces a previous client with the same id."""
        self._entries[client.instance.worker_id] = _Entry(client)
        self._notify()

    def remove(self, worker_id: str) -> WorkerClient | None:
        """Stop routing to *worker_id*; returns its client for the caller to close."""
        entry = self._entries.pop(worker_id, None)
        self._notify()
        return entry.client if entry else None

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.draining = draining
            self._notify()

    def clients(self) -> list[WorkerClient]:
        return [e.client for e in self._entries.values()]

    def _notify(self) -> None:
        self.changed.set()

    # -- routing (the pipeline's side) --------------------------------------------

    def routable(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> int:
        """How many workers of *role* serving *model*, not in *exclude*, may be picked now."""
        now = trio.current_time()
        return sum(1 for e in self._candidates(role, model, now, exclude))

    def pick(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> WorkerClient:
        """Choose a worker for *role* serving *model*, skipping ids in *exclude*.

        Raises :class:`NoWorkers` when none is routable.
        """
        now = trio.current_time()
        candidates = list(self._candidates(role, model, now, exclude))
        if not candidates:
            raise NoWorkers(f"no routable {role.value} worker for model {model!r}")
        if self.policy is Policy.RANDOM:
            entry = self._rng.choice(candidates)
        elif self.policy is Policy.LEAST_LOADED:
            low = min(e.inflight for e in candidates)
            tied = [e for e in candidates if e.inflight == low]
            entry = tied[self._next_turn(role, model) % len(tied)]
        elif self.policy is Policy.P2C:
            a, b = (
                self._rng.sample(candidates, 2) if len(candidates) > 1 else candidates * 2
            )
            entry = a if a.inflight <= b.inflight else b
        else:
            entry = candidates[self._next_turn(role, model) % len(candidates)]
        return entry.client

    def _next_turn(self, role: Role, model: str) -> int:
        return next(self._turns.setdefault((role, model), itertools.count()))

    def _candidates(
        self, role: Role, model: str, now: float, exclude: frozenset[str]
    ) -> Iterator[_Entry]:
        for wid, e in self._entries.items():
            inst = e.client.instance
            if (
                inst.role is role
                and inst.model == model
                and wid not in exclude
                and e.state(now) is WorkerState.HEALTHY
            ):
                yield e

    @contextmanager
    def track(self, client: WorkerClient) -> Iterator[None]:
        """Count one in-flight request on *client* for the duration of the block."""
        entry = self._entries.get(client.instance.worker_id)
        if entry is None or entry.client is not client:
            yield
            return
        entry.inflight += 1
        try:
            yield
        finally:
            entry.inflight -= 1

    def report_success(self, client: WorkerClient) -> None:
        entry = self._entries.get(client.instance.worker_id)
        if entry is not None and entry.client is client:
            entry.served += 1
            entry.failures = 0

    def report_unreachable(self, client: WorkerClient, error: BaseException) -> None:
        """The worker did not ACK or could not be reached: inhibit it, with backoff."""
        entry = self._entries.get(client.instance.worker_id)
        if entry is None or entry.client is not client:
            return
        entry.failures += 1
        entry.last_error = str(error)
        backoff = min(self.max_inhibit_s, self.inhibit_s * 2 ** (entry.failures - 1))
        entry.inhibited_until = trio.current_time() + backoff
        self._notify()

    def views(self) -> list[WorkerView]:
        now = trio.current_time()
        return [
            WorkerView(
                worker_id=wid,
                role=e.client.instance.role,
                model=e.client.instance.model,
                address=e.client.instance.address,
                state=e.state(now),
                inflight=e.inflight,
                served=e.served,
                failures=e.failures,
                last_error=e.last_error,
                inhibited_for_s=max(0.0, e.inhibited_until - now),
            )
            for wid, e in sorted(self._entries.items())
        ]
