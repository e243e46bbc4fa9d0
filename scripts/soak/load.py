"""The load: a fixed number of clients drawing from the mix, and periodic disconnect storms.

Each of ``concurrency`` client tasks sends one request of the mix at a time, back to
back, on kept-alive connections from one pool, until the phase's time is up; a request
under way then runs to its end (bounded by its deadline), so a phase ends with nothing
in flight and every connection closed. Every ``storm_every_s`` seconds a storm resets
every connection with a request on it at that moment (RST, as if the client machine
died): those requests end ``disconnected``, whatever they were.

Everything runs in the soak's own trio loop; the load is light enough (tens of
requests a second, each a few sends and receives) that it is not what limits the
server on a two-core machine, and the sampler beside it keeps its schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from scripts.soak.client import ConnectionPool, InFlight, PoolStatistics, Result, perform
from scripts.soak.mix import Mix


@dataclass(slots=True)
class Storms:
    """When each storm struck (trio time) and how many requests it reset."""

    times: list[float] = field(default_factory=list)
    reset: list[int] = field(default_factory=list)


async def _storm(every_s: float, in_flight: set[InFlight], storms: Storms) -> None:
    while True:
        await trio.sleep(every_s)
        hit = list(in_flight)
        for request in hit:
            request.storm()
        storms.times.append(trio.current_time())
        storms.reset.append(len(hit))


async def drive(
    mix: Mix,
    host: str,
    port: int,
    *,
    concurrency: int,
    duration_s: float,
    deadline_s: float,
    storm_every_s: float | None,
    results: list[Result],
    storms: Storms,
) -> PoolStatistics:
    """Run the load for *duration_s*, append every request's :class:`Result` to
    *results*, then close the pool. Returns once the last request has ended, with the
    pool's connection counts."""
    pool = ConnectionPool(host, port)
    in_flight: set[InFlight] = set()
    stop_at = trio.current_time() + duration_s

    async def client() -> None:
        while trio.current_time() < stop_at:
            results.append(
                await perform(mix.next(), pool, deadline_s=deadline_s, in_flight=in_flight)
            )

    try:
        async with trio.open_nursery() as nursery:
            if storm_every_s:
                nursery.start_soon(_storm, storm_every_s, in_flight, storms)
            async with trio.open_nursery() as clients:
                for _ in range(concurrency):
                    clients.start_soon(client)
            nursery.cancel_scope.cancel()  # the storms end with the clients
    finally:
        with trio.move_on_after(5, shield=True):
            await pool.aclose()
    return pool.stats
