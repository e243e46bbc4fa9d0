"""Worker discovery: which workers exist, and keeping the router in step with them.

:mod:`~frontend.discovery.base` defines the interface (``Discovery``, ``DiscoverySink``);
:mod:`~frontend.discovery.static` reads a fixed ``--workers`` list;
:mod:`~frontend.discovery.local` runs the in-process cluster (the default);
:mod:`~frontend.discovery.etcd` follows workers registered in etcd (the workers' side
is :mod:`workers.runtime.registration`; the etcd client and the record both sides use
are :mod:`headwater.etcd`); :mod:`~frontend.discovery.membership` connects to what
discovery reports and updates the router; :mod:`~frontend.discovery.start` picks and
starts both from the frontend's configuration. See docs/discovery.md.
"""

from frontend.discovery.base import Discovery, DiscoverySink
from frontend.discovery.etcd import EtcdDiscovery
from frontend.discovery.local import LocalCluster
from frontend.discovery.membership import Connect, Membership, MembershipStats, open_membership
from frontend.discovery.start import connect_for, discovery_from_config, start_discovery
from frontend.discovery.static import StaticDiscovery, parse_worker_url, parse_workers

__all__ = [
    "Connect",
    "Discovery",
    "DiscoverySink",
    "EtcdDiscovery",
    "LocalCluster",
    "Membership",
    "MembershipStats",
    "StaticDiscovery",
    "connect_for",
    "discovery_from_config",
    "open_membership",
    "parse_worker_url",
    "parse_workers",
    "start_discovery",
]
