"""Choosing and starting discovery from the frontend's configuration.

``--workers tcp://...`` selects :class:`StaticDiscovery`; ``--discovery etcd://...``
selects :class:`EtcdDiscovery` for every model registered there; neither runs the in-process
cluster (:class:`LocalCluster`). :func:`start_discovery` runs the chosen source with a
:class:`Membership` feeding the router, in the caller's nursery: one mechanism for
every source.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from frontend.discovery.base import Discovery
from frontend.discovery.etcd import EtcdDiscovery
from frontend.discovery.local import LocalCluster
from frontend.discovery.membership import Connect, Membership, open_membership
from frontend.discovery.static import StaticDiscovery
from frontend.router.router import Router
from headwater.etcd.client import etcd_endpoints
from headwater.instrumentation.attribution import StallAttribution

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
        from headwater.wire.handshake import load_secret

        return EtcdDiscovery(
            etcd_endpoints(config.discovery),
            model=None,  # every model registered: each is served (frontend/catalog.py)
            secret=load_secret(),
            credentials=config.etcd_credentials,
        )
    return LocalCluster(
        model=config.model_name,
        mode=config.mode,
        engine=config.engine,
        engine_config=config.engine_config,
        ack_timeout=config.ack_timeout,
    )


def connect_for(
    discovery: Discovery, config: FrontendConfig, attribution: StallAttribution | None = None
) -> Connect:
    """How to reach what *discovery* reports: in-process clients for the local cluster,
    the TCP request plane (with the configured ACK timeout and TLS) for everything else; both
    excuse deadlines missed while this loop stalled when given *attribution*."""
    if isinstance(discovery, LocalCluster):
        discovery.attribution = attribution
        return discovery.connect
    from headwater.plane.client import connect_worker
    from headwater.plane.connection import PlaneConfig

    return partial(
        connect_worker,
        config=PlaneConfig(ack_timeout=config.ack_timeout, tls=config.plane_tls),
        attribution=attribution,
    )


async def start_discovery(
    nursery: trio.Nursery,
    config: FrontendConfig,
    router: Router,
    *,
    connect: Connect | None = None,
    attribution: StallAttribution | None = None,
    initial_wait: float = 10.0,  # seconds to wait for the first report
    discovery: Discovery | None = None,
) -> Membership:
    """Start membership and discovery in *nursery*; returns the running Membership.

    Returns once discovery reported the initial set (the in-process cluster: once its
    workers are in the router), or after *initial_wait* seconds (etcd unreachable:
    logged; discovery keeps retrying in the background and the frontend answers 503
    until workers appear). *connect* defaults to :func:`connect_for`. Raises
    ValueError for a bad configuration before starting anything. *discovery* replaces
    the one *config* names.
    """
    discovery = discovery or discovery_from_config(config)
    connect = connect or connect_for(discovery, config, attribution)
    membership: Membership = await nursery.start(
        _follow, discovery, router, connect, initial_wait, name="discovery"
    )
    return membership


async def _follow(
    discovery: Discovery,
    router: Router,
    connect: Connect,
    initial_wait: float,
    *,
    task_status: trio.TaskStatus[Membership],
) -> None:
    async with open_membership(router, connect) as membership, trio.open_nursery() as nursery:
        ready = trio.Event()
        nursery.start_soon(_report, discovery, membership, ready)
        with trio.move_on_after(initial_wait):
            await ready.wait()
            if isinstance(discovery, LocalCluster):
                await membership.connecting.wait_value(0)
        if not ready.is_set():
            log.warning(
                "discovery has not reported workers after %.0f s; still trying", initial_wait
            )
        task_status.started(membership)


async def _report(discovery: Discovery, membership: Membership, ready: trio.Event) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run, membership)
        ready.set()
