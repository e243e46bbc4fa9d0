"""etcd for headwater: a trio client for the JSON gateway and the instance records.

:mod:`headwater.etcd.client` is the client (KV, leases, watches) and its error tree;
:mod:`headwater.etcd.records` the key layout and the JSON value each worker stores.
Workers register with them (``workers.runtime.registration``), frontends watch with
them (``frontend.discovery.etcd``). See docs/discovery.md.
"""

from headwater.etcd.client import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    EventType,
    KeyValue,
    Lease,
    RangeResult,
    WatchEvent,
    WatchStream,
    etcd_endpoints,
    prefix_range_end,
)
from headwater.etcd.records import KEY_PREFIX, InstanceRecord, InstanceState, model_prefix

__all__ = [
    "KEY_PREFIX",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdUnavailable",
    "EventType",
    "InstanceRecord",
    "InstanceState",
    "KeyValue",
    "Lease",
    "RangeResult",
    "WatchEvent",
    "WatchStream",
    "etcd_endpoints",
    "model_prefix",
    "prefix_range_end",
]
