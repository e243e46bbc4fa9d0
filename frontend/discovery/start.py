"""Choosing and starting discovery from the frontend's configuration.

``--workers tcp://...`` selects :class:`StaticDiscovery`; ``--discovery etcd://...``
selects :class:`EtcdDiscovery` for the served model. :func:`start_discovery` runs
it with a :class:`Membership` feeding the router, in the caller's nursery.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from frontend.discovery.base import Discovery
from frontend.discovery.etcd import EtcdDiscovery
from frontend.discovery.membership import Connect, Membership
from frontend.discovery.static import StaticDiscovery
from frontend.router.router import Router
from headwater.etcd.client import etcd_endpoints

if TYPE_CHECKING:
    from frontend.config import FrontendConfig

log = logging.getLogger(__name__)


def discovery_from_config(config: FrontendConfig) -> Discovery:
    """The discovery the configuration asks for; raises ValueError when it is malformed."""
    if config.workers and config.discovery:
        raise ValueError("give either --workers or --discovery, not both")
    if config.workers:
        return StaticDiscovery.from_spec(config.workers, default_model=config.model_name)
    if config.discovery:
        return EtcdDiscovery(etcd_endpoints(config.discovery), model=config.model_name)
    raise ValueError("neither --workers nor --discovery is set")


async def start_discovery(
    nursery: trio.Nursery,
    config: FrontendConfig,
    router: Router,
    *,
    connect: Connect | None = None,
    initial_wait: float = 10.0,  # seconds to wait for the first report
) -> Membership:
    """Start membership and discovery in *nursery*; returns the running Membership.

    Returns once discovery reported the initial set, or after *initial_wait*
    seconds (etcd unreachable: logged; discovery keeps retrying in the background
    and the frontend answers 503 until workers appear). *connect* defaults to the
    TCP request plane's ``connect_worker`` with the configured ACK timeout. Raises
    ValueError for a bad configuration before starting anything.
    """
    discovery = discovery_from_config(config)
    if connect is None:
        # The TCP plane, imported only when remote workers are in use.
        from frontend.plane.tcp import connect_worker
        from headwater.plane.connection import PlaneConfig

        connect = partial(connect_worker, config=PlaneConfig(ack_timeout=config.ack_timeout))
    membership = Membership(router, connect)
    await nursery.start(membership.run)
    ready = trio.Event()
    nursery.start_soon(_follow, discovery, membership, ready, name="discovery")
    with trio.move_on_after(initial_wait):
        await ready.wait()
    if not ready.is_set():
        log.warning("discovery has not reported workers after %.0f s; still trying", initial_wait)
    return membership


async def _follow(discovery: Discovery, membership: Membership, ready: trio.Event) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run, membership)
        ready.set()
