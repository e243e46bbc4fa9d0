"""What a worker stores in etcd: one key per worker, a JSON record as its value.

Layout (each segment percent-encoded, so a model name with a slash stays one
segment)::

    headwater/v1/instances/<model>/<role>/<worker_id>

whose value is the JSON of an :class:`InstanceRecord`::

    {"worker_id": "w1", "role": "prefill", "model": "deepseek-v4",
     "address": "tcp://10.0.0.5:7001", "capacity": 256, "state": "ready",
     "pid": 4242, "started_at": 1790000000.0,
     "capabilities": {"engine": "vllm", "features": ["seed", "top_k", ...]}}

``capabilities`` is the engine's declaration (:mod:`headwater.wire.capabilities`); a
record without it (an older worker's) declares nothing.

Written by the workers (``workers.runtime.registration``), read by the frontends
(``frontend.discovery.etcd``); the contract is docs/discovery.md.

**Signed.** Whoever can write to etcd could register a worker of their own, or point a
worker's key at their address, and frontends would route requests there. So with a
plane secret a record carries ``"sig"``: HMAC-SHA256 under the secret over its other
fields (canonical JSON), and a reader with the secret takes only a record signed with
one of its accepted secrets and stored under the key its fields name (:meth:`from_json`
with ``secret``, :meth:`InstanceRecord.key`). A record from a writer without the secret
is ignored and logged. Without a secret (a loopback-only cluster) records are unsigned.
"""

from __future__ import annotations

import base64
import enum
import hmac
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from headwater.plane.base import WorkerInstance
from headwater.wire import Role
from headwater.wire.capabilities import Capabilities, from_plain, to_plain
from headwater.wire.handshake import accepted_secrets

#: Where instance keys live; one more segment per model, role and worker id.
KEY_PREFIX = "headwater/v1/instances/"


class InstanceState(enum.StrEnum):
    READY = "ready"
    DRAINING = "draining"  # serving what it has, taking nothing new


def _segment(text: str) -> str:
    return quote(text, safe="")


def model_prefix(model: str, prefix: str = KEY_PREFIX) -> str:
    """The prefix under which every worker of *model* registers."""
    return f"{prefix}{_segment(model)}/"


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One worker's entry in etcd: the key it owns and the JSON value stored there."""

    worker_id: str
    role: Role
    model: str
    address: str
    capacity: int
    state: InstanceState = InstanceState.READY
    pid: int = 0
    started_at: float = 0.0  # unix time
    #: The engine's declaration (None: the worker declared nothing, an older one).
    capabilities: Capabilities | None = None

    @classmethod
    def from_instance(
        cls,
        instance: WorkerInstance,
        *,
        state: InstanceState = InstanceState.READY,
        pid: int = 0,
        started_at: float = 0.0,
    ) -> InstanceRecord:
        return cls(
            worker_id=instance.worker_id,
            role=instance.role,
            model=instance.model,
            address=instance.address,
            capacity=instance.capacity,
            state=state,
            pid=pid,
            started_at=started_at,
            capabilities=instance.capabilities,
        )

    def key(self, prefix: str = KEY_PREFIX) -> str:
        return f"{model_prefix(self.model, prefix)}{_segment(self.role.value)}/" + _segment(
            self.worker_id
        )

    def instance(self) -> WorkerInstance:
        return WorkerInstance(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model,
            address=self.address,
            capacity=self.capacity,
            metadata={"pid": str(self.pid), "started_at": repr(self.started_at)},
            capabilities=self.capabilities,
        )

    def to_json(self, secret: bytes | None = None) -> bytes:
        """The stored value; signed with *secret* (the plane secret) when given."""
        fields: dict[str, Any] = {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "model": self.model,
            "address": self.address,
            "capacity": self.capacity,
            "state": self.state.value,
            "pid": self.pid,
            "started_at": self.started_at,
        }
        if self.capabilities is not None:  # signed with the rest
            fields["capabilities"] = to_plain(self.capabilities)
        if secret is not None:
            fields["sig"] = _signature(secret, fields)
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, secret: bytes | None = None) -> InstanceRecord:
        """Parse a stored value; unknown fields are ignored. With *secret*, the record
        must be signed with one of its accepted secrets (a rotation's earlier ones too).
        Raises ValueError."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if secret is not None:
                _verify(secret, d)
            for name in ("worker_id", "model", "address"):
                if not isinstance(d.get(name), str) or not d[name]:
                    raise ValueError(f"{name} must be a non-empty string")
            return cls(
                worker_id=d["worker_id"],
                role=Role(str(d.get("role"))),
                model=d["model"],
                address=d["address"],
                capacity=int(d.get("capacity", 256)),
                state=InstanceState(d.get("state", InstanceState.READY.value)),
                pid=int(d.get("pid") or 0),
                started_at=float(d.get("started_at") or 0.0),
                capabilities=(
                    from_plain(d["capabilities"]) if d.get("capabilities") is not None else None
                ),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad instance record: {exc}") from None


_SIGNED = "headwater-record/1|"


def _signature(secret: bytes, fields: dict[str, Any]) -> str:
    """HMAC-SHA256 of *fields* (``sig`` aside) as canonical JSON, base64."""
    unsigned = {k: v for k, v in fields.items() if k != "sig"}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()
    mac = hmac.digest(secret, _SIGNED.encode() + canonical, "sha256")
    return base64.b64encode(mac).decode()


def _verify(secret: bytes, fields: dict[str, Any]) -> None:
    """Raise ValueError unless *fields* carry a signature by one of *secret*'s accepted
    secrets; every candidate is compared, without stopping early."""
    presented = fields.get("sig")
    if not isinstance(presented, str):
        raise ValueError("unsigned (its writer does not hold the plane secret)")
    good = False
    for candidate in accepted_secrets(secret):
        good |= hmac.compare_digest(_signature(candidate, fields).encode(), presented.encode())
    if not good:
        raise ValueError("bad signature (not written with the plane secret)")
