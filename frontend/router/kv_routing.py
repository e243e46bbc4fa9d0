"""KV-aware routing (``--router kv``): the cost, approximate mode, the event feed.

* :class:`KvConfig` — every knob, with its default (docs/routing.md sets them beside
  Dynamo's, SGLang's and llm-d's).
* :func:`choose` — for each candidate worker, ``prefill_load_scale`` × the blocks it
  would have to prefill (the prompt minus its cached overlap) + the blocks its requests
  in flight hold (Dynamo's cost); the lowest wins, ties at random; with a temperature, a
  softmax over the normalised costs samples instead.
* :class:`ApproxIndex` — without events (``--kv-events off``, or an engine that
  publishes none), where the router itself sent each prefix, for ``approx_ttl`` seconds.
* :class:`KvSubscriber` — one task per worker the router routes to, reading its KV
  events from where it left off, dumping after a gap or when new; a worker that leaves
  takes its blocks with it.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from frontend.choices import KvEvents
from frontend.router.kv_index import KvIndex, walk
from headwater.config_fields import non_negative_float, option, positive_float, positive_int
from headwater.plane.base import PlaneError, WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvConfig:
    """``--router kv``'s knobs; units next to each. The fields with a help are
    ``headwater serve`` options (headwater/config_fields.py)."""

    #: The engines' block size: the in-process engine's when unset (vLLM's --block-size).
    block_size: int = option(
        64,
        flags=("--kv-block-size",),
        type=positive_int,
        from_model=True,
        help="--router kv: tokens per block, the engines' block size (default: the "
        "in-process engine's, else 64)",
    )
    #: Dynamo's ``--kv-overlap-score-weight``, 1.0.
    prefill_load_scale: float = option(
        1.0,
        flags=("--kv-prefill-load-scale",),
        type=non_negative_float,
        help="--router kv: weight of uncached prefill blocks against blocks in flight",
    )
    #: Softmax over normalised costs above 0; Dynamo's ``--router-temperature``, 0.
    temperature: float = option(
        0.0,
        flags=("--kv-temperature",),
        type=non_negative_float,
        help="--router kv: 0 picks the lowest cost; above, softmax sampling",
    )
    events: KvEvents = option(
        KvEvents.ON,
        flags=("--kv-events",),
        help="--router kv: follow the workers' KV events, or (off) remember where "
        "prefixes were sent",
    )
    #: Dynamo's 120 s.
    approx_ttl: float = option(
        120.0,
        flags=("--kv-approx-ttl",),
        type=positive_float,
        help="--router kv: seconds approximate mode remembers a routed prefix",
    )
    #: Seconds between polls of a worker whose last poll emptied its feed.
    poll_interval: float = 0.05
    #: Most events per poll.
    poll_limit: int = 512

    @property
    def uses_events(self) -> bool:
        """Whether the index follows the workers' events (else approximate mode)."""
        return self.events is KvEvents.ON

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", KvEvents(self.events))
        if self.block_size < 1 or self.poll_limit < 1:
            raise ValueError("block_size and poll_limit must be >= 1")
        if self.prefill_load_scale < 0 or self.temperature < 0 or self.approx_ttl <= 0:
            raise ValueError("prefill_load_scale, temperature >= 0 and approx_ttl > 0")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as :func:`choose` weighs it."""

    worker_id: str
    overlap: int  # leading prompt blocks it holds
    active_blocks: int  # blocks its requests in flight from here hold


def cost(c: Candidate, prompt_blocks: int, prefill_load_scale: float) -> float:
    """Dynamo's: prefill_load_scale × uncached prompt blocks + active decode blocks."""
    return prefill_load_scale * max(0, prompt_blocks - c.overlap) + c.active_blocks


def choose(
    candidates: Sequence[Candidate],
    prompt_blocks: int,
    config: KvConfig,
    rng: random.Random,
) -> Candidate:
    """The candidate to route to (module docstring). *candidates* is not empty."""
    costs = [cost(c, prompt_blocks, config.prefill_load_scale) for c in candidates]
    if config.temperature <= 0:
        low = min(costs)
        return rng.choice([c for c, x in zip(candidates, costs, strict=True) if x == low])
    top = max(costs) or 1.0
    logits = [-x / top / config.temperature for x in costs]
    peak = max(logits)
    weights = [math.exp(v - peak) for v in logits]
    return rng.choices(list(candidates), weights)[0]


class ApproxIndex:
    """Where this router sent each prefix, remembered for ``ttl`` seconds (trio time).

    Each routed prompt refreshes its blocks on its worker. Expired entries are dropped
    as time passes (on each record), and never counted by a lookup.
    """

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._holders: dict[int, dict[str, float]] = {}
        self._expiry: deque[tuple[float, str, tuple[int, ...]]] = deque()

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        now = trio.current_time()
        self._expire(now)
        until = now + self.ttl
        for h in hashes:
            self._holders.setdefault(h, {})[worker_id] = until
        self._expiry.append((until, worker_id, tuple(hashes)))

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        now = trio.current_time()

        def live(h: int) -> set[str] | None:
            held = self._holders.get(h)
            return {w for w, until in held.items() if until > now} if held else None

        return walk(live, hashes)

    def remove_worker(self, worker_id: str) -> None:
        for held in self._holders.values():
            held.pop(worker_id, None)

    def blocks_of(self, worker_id: str) -> int:
        now = trio.current_time()
        return sum(1 for held in self._holders.values() if held.get(worker_id, 0) > now)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            until, wid, hashes = expiry.popleft()
            for h in hashes:
                held = self._holders.get(h)
                if held is not None and held.get(wid) == until:
                    del held[wid]
                    if not held:
                        del self._holders[h]


@dataclass(slots=True)
class SubscriberStats:
    events: int = 0  # KV events received
    dumps: int = 0  # full dumps requested
    gaps: int = 0  # gaps in a worker's numbering seen


class KvSubscriber:
    """Reads every routed worker's KV events into *index* (module docstring).

    *clients* lists the workers to follow now; *changed* waits for that list to
    change. A worker whose engine publishes none is left to approximate mode
    (:attr:`without_events`).
    """

    def __init__(
        self,
        index: KvIndex,
        config: KvConfig,
        clients: Callable[[], list[WorkerClient]],
        changed: Callable[[], object],
    ) -> None:
        self.index = index
        self.config = config
        self._clients = clients
        self._changed = changed
        self._tasks: dict[str, tuple[WorkerClient, trio.CancelScope]] = {}
        self.without_events: set[str] = set()
        self.stats = SubscriberStats()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._sync(nursery)
                await self._changed()  # type: ignore[misc]

    def _sync(self, nursery: trio.Nursery) -> None:
        live = {c.instance.worker_id: c for c in self._clients()}
        for wid, (client, scope) in list(self._tasks.items()):
            if live.get(wid) is not client:
                scope.cancel()
                del self._tasks[wid]
                self.index.remove_worker(wid)
                self.without_events.discard(wid)
        for wid, client in live.items():
            if wid not in self._tasks:
                scope = trio.CancelScope()
                self._tasks[wid] = (client, scope)
                nursery.start_soon(self._follow, client, scope)

    async def _follow(self, client: WorkerClient, scope: trio.CancelScope) -> None:
        wid = client.instance.worker_id
        cfg = self.config
        with scope:
            while True:
                since = self.index.next_seq(wid)
                try:
                    batch = await client.poll_kv_events(since, cfg.poll_limit)
                except PlaneError as exc:
                    log.debug("KV events of %s: %s", wid, exc)
                    await trio.sleep(max(cfg.poll_interval, 0.5))
                    continue
                if batch is None:
                    self.without_events.add(wid)
                    return
                if since < 0:
                    self.stats.dumps += 1
                self.stats.events += len(batch.events)
                if not self.index.apply(wid, batch):
                    self.stats.gaps += 1
                    continue  # the next poll dumps
                if len(batch.events) < cfg.poll_limit:
                    await trio.sleep(cfg.poll_interval)
