"""Worker discovery: which workers exist, and keeping the router in step with them.

:mod:`~frontend.discovery.base` defines the interface (``Discovery``, ``DiscoverySink``);
:mod:`~frontend.discovery.static` reads a fixed ``--workers`` list;
:mod:`~frontend.discovery.etcd` follows workers registered in etcd (the workers' side
is :mod:`workers.runtime.registration`); :mod:`~frontend.discovery.membership` connects
to what discovery reports and updates the router; :mod:`~frontend.discovery.start`
picks and starts both from the frontend's configuration. See docs/discovery.md.
"""

from frontend.discovery.base import Backoff, Discovery, DiscoverySink
from frontend.discovery.etcd import (
    KEY_PREFIX,
    EtcdClient,
    EtcdCompacted,
    EtcdDiscovery,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    InstanceRecord,
    InstanceState,
)
from frontend.discovery.membership import Connect, Membership, MembershipStats
from frontend.discovery.start import discovery_from_config, etcd_endpoints, start_discovery
from frontend.discovery.static import StaticDiscovery, parse_worker_url, parse_workers

__all__ = [
    "KEY_PREFIX",
    "Backoff",
    "Connect",
    "Discovery",
    "DiscoverySink",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdDiscovery",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdUnavailable",
    "InstanceRecord",
    "InstanceState",
    "Membership",
    "MembershipStats",
    "StaticDiscovery",
    "discovery_from_config",
    "etcd_endpoints",
    "parse_worker_url",
    "parse_workers",
    "start_discovery",
]
