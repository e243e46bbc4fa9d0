"""The route stage: which worker gets the next request.

The router holds every known :class:`WorkerClient` (added and removed by discovery,
:mod:`frontend.discovery`), tracks each one's in-flight requests and health, and picks
per role with one of four policies:

* ``round-robin`` — in turn;
* ``random`` — uniformly;
* ``least-loaded`` — fewest in-flight requests (ties in turn);
* ``p2c`` — power of two choices: the less loaded of two random picks;
* ``kv`` — where the prompt's prefix is cached, weighed against load
  (:mod:`frontend.router.kv_routing`, docs/routing.md).

Health is a circuit per worker (:mod:`frontend.router.health`): a worker that fails
``inhibit_after`` requests in a row is inhibited, probed after a backoff, and let back
once it answers probes; :meth:`Router.run` runs the probes. A draining worker (announced
by discovery) gets no new requests. A busy worker (as many requests in flight from
here as it advertises, or a load it reported over the ``busy`` thresholds) is skipped
while another can take the request.

Every state change is logged once, with its reason, and passed to ``on_transition``
(the frontend counts them in ``headwater_frontend_worker_state_transitions_total``);
:meth:`Router.views` shows each worker's state, reason and load on ``/debug/workers``
and the dashboard.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import trio
from trio_util import RepeatedEvent

from frontend.choices import Policy as Policy  # re-exported: the router's own choice
from frontend.errors import NoWorkers
from frontend.router.health import Circuit, HealthConfig, Transition, WorkerState
from frontend.router.kv_index import KvIndex
from frontend.router.kv_routing import ApproxIndex, Candidate, KvConfig, KvSubscriber, choose
from headwater.config_fields import option, positive_float, positive_int
from headwater.plane.base import PlaneError, WorkerClient
from headwater.wire import Role
from headwater.wire.capabilities import Capabilities

log = logging.getLogger(__name__)

#: Called with (worker id, transition) on every state change.
TransitionHook = Callable[[str, Transition], None]


@dataclass(frozen=True, slots=True)
class Prompt:
    """What ``--router kv`` needs of a request: its length and its block hashes
    (``frontend.router.kv_index.prompt_hashes``)."""

    num_tokens: int
    hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class KvStats:
    """``--router kv``'s counters."""

    routed: int  # requests routed by cached overlap
    overlap_blocks: int  # their leading blocks found cached on the chosen worker, summed
    prompt_blocks: int  # their prompts' blocks, summed: overlap ÷ this is the hit rate
    prefill_tokens_saved: int  # overlap_blocks × block size
    events: int  # KV events received
    dumps: int  # full dumps requested
    gaps: int  # gaps seen in a worker's event numbers


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """When a worker counts as busy: it is skipped while another can take the request.
    Both are ``headwater serve`` options (headwater/config_fields.py)."""

    kv_usage: float = option(
        0.95,
        flags=("--busy-kv-usage",),
        type=positive_float,
        help="a worker with this share of its KV cache in use is busy: skipped while "
        "another can take the request",
    )
    waiting: int = option(
        64,
        flags=("--busy-waiting",),
        type=positive_int,
        help="a worker with this many requests waiting in its engine is busy",
    )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A read-only snapshot of one worker, for /debug/workers, metrics and the dashboard."""

    worker_id: str
    role: Role
    model: str
    address: str
    state: WorkerState
    #: Why it is in that state (the last transition's reason); None if it never changed.
    reason: str | None
    #: Unix time at which it entered that state (or joined the router).
    since: float
    inflight: int
    busy: bool
    served: int
    #: Consecutive faults (while healthy).
    failures: int
    last_error: str | None
    #: Seconds until the next probe, while inhibited or probing; else 0.
    probe_in_s: float
    #: Blocks of its prefix cache the router knows of (``--router kv``; else 0).
    cached_blocks: int = 0
    #: Where that knowledge comes from: "events", "approximate" or "" (not kv routing).
    cache_view: str = ""


class _Entry:
    __slots__ = (
        "active_blocks",
        "circuit",
        "client",
        "draining",
        "inflight",
        "last_error",
        "probing",
        "served",
        "since",
    )

    def __init__(self, client: WorkerClient, circuit: Circuit) -> None:
        self.client = client
        self.circuit = circuit
        self.inflight = 0
        self.active_blocks = 0  # prompt blocks of its requests in flight from here
        self.served = 0
        self.last_error: str | None = None
        self.draining = False
        self.probing = False  # a probe task is running for it
        self.since = time.time()  # wall clock of its last state change, for the views

    @property
    def state(self) -> WorkerState:
        return WorkerState.DRAINING if self.draining else self.circuit.state


class Router:
    """Picks workers; see the module docstring for policies and health."""

    def __init__(
        self,
        policy: Policy | str = Policy.ROUND_ROBIN,
        *,
        health: HealthConfig | None = None,
        busy: BusyThresholds | None = None,
        on_transition: TransitionHook | None = None,
        rng: random.Random | None = None,
        kv: KvConfig | None = None,
    ) -> None:
        self.policy = Policy(policy)
        self.kv = kv or KvConfig()
        self.kv_index = KvIndex(self.kv.block_size)
        self.kv_approx = ApproxIndex(self.kv.approx_ttl)
        self._kv_routed = self._kv_overlap = self._kv_prompt_blocks = 0
        self.health = health or HealthConfig()
        self.busy = busy or BusyThresholds()
        self.on_transition = on_transition
        self._rng = rng or random.Random()
        self._entries: dict[str, _Entry] = {}
        # One turn counter per (role, model): a shared one would lock the prefill and
        # decode legs of serial requests into the same phase on every pick.
        self._turns: dict[tuple[Role, str], itertools.count[int]] = {}
        #: Set whenever the set of workers, their routability or their load changes;
        #: ``await router.changed.wait()`` returns at the next change.
        self.changed = RepeatedEvent()
        self.kv_subscriber = KvSubscriber(self.kv_index, self.kv, self.clients, self.changed.wait)

    # -- membership (discovery's side) ------------------------------------------

    def add(self, client: WorkerClient) -> None:
        """Start routing to *client*; replaces a previous client with the same id."""
        circuit = Circuit(self.health, self._rng)
        self._entries[client.instance.worker_id] = _Entry(client, circuit)
        self._notify()

    def remove(self, worker_id: str) -> WorkerClient | None:
        """Stop routing to *worker_id*; returns its client for the caller to close."""
        entry = self._entries.pop(worker_id, None)
        self.kv_approx.remove_worker(worker_id)
        if entry is not None:
            self._transition(worker_id, Transition(entry.state, WorkerState.REMOVED, "removed"))
        self._notify()
        return entry.client if entry else None

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None and entry.draining != draining:
            old = entry.state
            entry.draining = draining
            why = "draining (announced by the worker)" if draining else "ready again"
            self._transition(worker_id, Transition(old, entry.state, why), entry)
            self._notify()

    def clients(self) -> list[WorkerClient]:
        return [e.client for e in self._entries.values()]

    def _notify(self) -> None:
        self.changed.set()

    # -- routing (the pipeline's side) --------------------------------------------

    def routable(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> int:
        """How many workers of *role* serving *model*, not in *exclude*, are healthy
        (busy or not)."""
        return sum(1 for _ in self._candidates(role, model, exclude))

    def pick(
        self,
        role: Role,
        model: str,
        exclude: frozenset[str] = frozenset(),
        prompt: Prompt | None = None,
        *,
        prefer: str | None = None,
    ) -> WorkerClient:
        """Choose a worker for *role* serving *model*, skipping ids in *exclude*; a busy
        one only if every candidate is busy (:meth:`all_busy` tells the caller).
        ``kv`` weighs *prompt*'s cached overlap for prefill and aggregated workers and
        the load alone for decode workers (:mod:`frontend.router.kv_routing`). The
        worker *prefer* names comes first, if it is a candidate and not busy while
        another is not (the choices of one request go where its prompt's KV is).

        Raises :class:`NoWorkers` when none is routable.
        """
        candidates = list(self._candidates(role, model, exclude))
        if not candidates:
            raise NoWorkers(f"no routable {role.value} worker for model {model!r}")
        free = [e for e in candidates if not self._busy(e)]
        candidates = free or candidates
        if prefer is not None:
            for entry in candidates:
                if entry.client.instance.worker_id == prefer:
                    return entry.client
        if self.policy is Policy.KV:
            entry = self._pick_kv(candidates, role, prompt)
        elif self.policy is Policy.RANDOM:
            entry = self._rng.choice(candidates)
        elif self.policy is Policy.LEAST_LOADED:
            low = min(e.inflight for e in candidates)
            tied = [e for e in candidates if e.inflight == low]
            entry = tied[self._next_turn(role, model) % len(tied)]
        elif self.policy is Policy.P2C:
            a, b = self._rng.sample(candidates, 2) if len(candidates) > 1 else candidates * 2
            entry = a if a.inflight <= b.inflight else b
        else:
            entry = candidates[self._next_turn(role, model) % len(candidates)]
        return entry.client

    def lacking(self, model: str, feature: str) -> Capabilities | None:
        """The declaration of a worker serving *model* (of any role, in any state) that
        does not honour *feature*; None when every one does, or none is known.

        A request may go to any of them (a prefill samples its first token too), so it
        asks only for what all of them declare (:mod:`headwater.wire.capabilities`)."""
        for entry in self._entries.values():
            client = entry.client
            if client.instance.model == model and not client.capabilities.honours(feature):
                return client.capabilities
        return None

    def _pick_kv(self, candidates: list[_Entry], role: Role, prompt: Prompt | None) -> _Entry:
        by_id = {e.client.instance.worker_id: e for e in candidates}
        overlaps: dict[str, int] = {}
        blocks = 0
        if prompt is not None and role is not Role.DECODE:
            blocks = -(-prompt.num_tokens // self.kv.block_size)
            hashes = prompt.hashes
            approx = self.kv_approx.overlaps(hashes)
            exact = self.kv_index.overlaps(hashes) if self.kv.uses_events else {}
            for wid in by_id:
                use_approx = not self.kv.uses_events or wid in self.kv_subscriber.without_events
                overlaps[wid] = (approx if use_approx else exact).get(wid, 0)
        chosen = choose(
            [Candidate(wid, overlaps.get(wid, 0), e.active_blocks) for wid, e in by_id.items()],
            blocks,
            self.kv,
            self._rng,
        )
        if prompt is not None and role is not Role.DECODE:
            self._kv_routed += 1
            self._kv_overlap += chosen.overlap
            self._kv_prompt_blocks += blocks
            self.kv_approx.record(chosen.worker_id, prompt.hashes)
        return by_id[chosen.worker_id]

    def kv_statistics(self) -> KvStats:
        sub = self.kv_subscriber.stats
        return KvStats(
            routed=self._kv_routed,
            overlap_blocks=self._kv_overlap,
            prompt_blocks=self._kv_prompt_blocks,
            prefill_tokens_saved=self._kv_overlap * self.kv.block_size,
            events=sub.events,
            dumps=sub.dumps,
            gaps=sub.gaps,
        )

    def all_busy(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> bool:
        """There are healthy workers of *role*, and every one of them is busy."""
        candidates = list(self._candidates(role, model, exclude))
        return bool(candidates) and all(self._busy(e) for e in candidates)

    def _busy(self, entry: _Entry) -> bool:
        if entry.inflight >= entry.client.instance.capacity:
            return True
        load = entry.client.load
        return load is not None and (
            load.kv_usage >= self.busy.kv_usage or load.waiting >= self.busy.waiting
        )

    def _next_turn(self, role: Role, model: str) -> int:
        return next(self._turns.setdefault((role, model), itertools.count()))

    def _candidates(self, role: Role, model: str, exclude: frozenset[str]) -> Iterator[_Entry]:
        for wid, e in self._entries.items():
            inst = e.client.instance
            if (
                inst.role is role
                and inst.model == model
                and wid not in exclude
                and not e.draining
                and e.circuit.state is WorkerState.HEALTHY
            ):
                yield e

    @contextmanager
    def track(self, client: WorkerClient, blocks: int = 0) -> Iterator[None]:
        """Count one in-flight request on *client*, holding *blocks* KV blocks, for the
        duration of the block."""
        entry = self._entries.get(client.instance.worker_id)
        if entry is None or entry.client is not client:
            yield
            return
        entry.inflight += 1
        entry.active_blocks += blocks
        try:
            yield
        finally:
            entry.inflight -= 1
            entry.active_blocks -= blocks
            if entry.inflight + 1 >= client.instance.capacity:
                self._notify()  # it may no longer be busy: a waiting request can go

    # -- health (dispatch's reports, and the probes) ---------------------------------

    def report_success(self, client: WorkerClient) -> None:
        """*client* served a request to the end."""
        entry = self._entry_of(client)
        if entry is not None:
            entry.served += 1
            entry.circuit.success()

    def report_failure(self, client: WorkerClient, error: BaseException) -> None:
        """*client*'s worker failed a request by its own fault (see frontend.router.health)."""
        entry = self._entry_of(client)
        if entry is None:
            return
        entry.last_error = str(error)
        change = entry.circuit.failure(trio.current_time(), str(error))
        if change is not None:
            self._transition(client.instance.worker_id, change, entry)
            self._notify()

    def _entry_of(self, client: WorkerClient) -> _Entry | None:
        entry = self._entries.get(client.instance.worker_id)
        return entry if entry is not None and entry.client is client else None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe inhibited workers when their backoff is over, until cancelled."""
        async with trio.open_nursery() as nursery:
            if self.policy is Policy.KV and self.kv.uses_events:
                await nursery.start(self.kv_subscriber.run)
            task_status.started()
            while True:
                now = trio.current_time()
                for entry in list(self._entries.values()):
                    if not entry.probing and entry.circuit.due(now):
                        entry.probing = True
                        nursery.start_soon(self._probe, entry)
                next_probe = min(
                    (
                        e.circuit.probe_at
                        for e in self._entries.values()
                        if not e.probing and e.circuit.state is not WorkerState.HEALTHY
                    ),
                    default=math.inf,
                )
                with trio.move_on_at(next_probe):
                    await self.changed.wait()

    async def _probe(self, entry: _Entry) -> None:
        wid = entry.client.instance.worker_id
        try:
            if (change := entry.circuit.probing(trio.current_time())) is not None:
                self._transition(wid, change, entry)
            try:
                with trio.fail_after(self.health.probe_timeout):
                    await entry.client.probe()
            except (PlaneError, trio.TooSlowError) as exc:
                why = "no answer in time" if isinstance(exc, trio.TooSlowError) else str(exc)
                entry.last_error = why
                change = entry.circuit.probe_failed(trio.current_time(), why)
            else:
                change = entry.circuit.probe_answered(trio.current_time())
            if change is not None and self._entries.get(wid) is entry:
                self._transition(wid, change, entry)
        finally:
            entry.probing = False
            self._notify()

    def _transition(self, worker_id: str, change: Transition, entry: _Entry | None = None) -> None:
        if change.old is change.new:
            return
        if entry is not None:
            entry.since = time.time()
        level = logging.WARNING if change.new is WorkerState.INHIBITED else logging.INFO
        log.log(
            level,
            "worker %s: %s -> %s (%s)",
            worker_id,
            change.old.value,
            change.new.value,
            change.reason,
        )
        if self.on_transition is not None:
            self.on_transition(worker_id, change)

    def _cache_view(self, worker_id: str) -> str:
        if self.policy is not Policy.KV:
            return ""
        exact = self.kv.uses_events and worker_id not in self.kv_subscriber.without_events
        return "events" if exact else "approximate"

    def _cached_blocks(self, worker_id: str) -> int:
        view = self._cache_view(worker_id)
        if view == "events":
            return self.kv_index.blocks_of(worker_id)
        return self.kv_approx.blocks_of(worker_id) if view else 0

    def views(self) -> list[WorkerView]:
        now = trio.current_time()
        return [
            WorkerView(
                worker_id=wid,
                role=e.client.instance.role,
                model=e.client.instance.model,
                address=e.client.instance.address,
                state=e.state,
                reason=e.circuit.reason if not e.draining else "draining",
                since=e.since,
                inflight=e.inflight,
                busy=self._busy(e),
                served=e.served,
                failures=e.circuit.failures,
                last_error=e.last_error,
                probe_in_s=(
                    max(0.0, e.circuit.probe_at - now)
                    if e.circuit.state is not WorkerState.HEALTHY
                    else 0.0
                ),
                cached_blocks=self._cached_blocks(wid),
                cache_view=self._cache_view(wid),
            )
            for wid, e in sorted(self._entries.items())
        ]
