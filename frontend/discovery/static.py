"""A fixed list of workers from the command line: ``--workers``.

Syntax: comma-separated worker URLs (whitespace around them is ignored)::

    tcp://HOST:PORT?role=ROLE[&model=MODEL][&id=WORKER_ID][&capacity=N]

``role`` is required (``prefill``, ``decode`` or ``agg``); ``model`` defaults to
the model the frontend serves; ``id`` defaults to ``HOST:PORT``; ``capacity`` to
the :class:`WorkerInstance` default. IPv6 hosts go in brackets (``tcp://[::1]:9000``).
Anything else — another scheme, a missing port, an unknown or repeated parameter,
two workers with the same id — is a ``ValueError`` naming the offending entry.
"""

from __future__ import annotations

from dataclasses import replace
from urllib.parse import parse_qsl, urlsplit

import trio

from frontend.discovery.base import Discovery, DiscoverySink
from headwater.plane.base import WorkerInstance
from headwater.wire import Role

_PARAMS = ("role", "model", "id", "capacity")
_ROLES = ", ".join(r.value for r in Role)


def parse_worker_url(url: str, *, default_model: str) -> WorkerInstance:
    """Parse one ``tcp://host:port?role=...`` URL; raises ``ValueError`` saying what is wrong."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:  # bad port number or malformed brackets
        raise ValueError(f"{text!r}: bad address ({exc})") from None
    if parts.scheme != "tcp":
        raise ValueError(f"{text!r}: scheme must be tcp://, got {parts.scheme or 'none'!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"{text!r}: missing host (expected tcp://HOST:PORT?role=...)")
    if port is None:
        raise ValueError(f"{text!r}: missing port (expected tcp://HOST:PORT?role=...)")
    if port == 0:
        raise ValueError(f"{text!r}: port 0 is not a worker address")
    if parts.path not in ("", "/") or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text!r}: only tcp://HOST:PORT?PARAMS is allowed")

    params: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ValueError(f"{text!r}: malformed parameters ({exc})") from None
    for name, value in pairs:
        if name not in _PARAMS:
            allowed = ", ".join(_PARAMS)
            raise ValueError(f"{text!r}: unknown parameter {name!r} (allowed: {allowed})")
        if name in params:
            raise ValueError(f"{text!r}: parameter {name!r} given twice")
        if not value:
            raise ValueError(f"{text!r}: parameter {name!r} is empty")
        params[name] = value

    if "role" not in params:
        raise ValueError(f"{text!r}: missing role= (one of {_ROLES})")
    try:
        role = Role(params["role"])
    except ValueError:
        got = params["role"]
        raise ValueError(f"{text!r}: role must be one of {_ROLES}, got {got!r}") from None

    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    inst = WorkerInstance(
        worker_id=params.get("id", hostport),
        role=role,
        model=params.get("model", default_model),
        address=f"tcp://{hostport}",
        # Without id= we do not know the worker's id: accept whoever answers there.
        metadata={} if "id" in params else {"expect_worker_id": ""},
    )
    if "capacity" in params:
        raw = params["capacity"]
        if not raw.isdecimal() or int(raw) <= 0:
            raise ValueError(f"{text!r}: capacity must be a positive integer, got {raw!r}")
        inst = replace(inst, capacity=int(raw))
    return inst


def parse_workers(spec: str, *, default_model: str) -> list[WorkerInstance]:
    """Parse a ``--workers`` value (comma-separated URLs) into instances, in order.

    Empty entries (a trailing comma) are skipped. Raises ``ValueError`` when an
    entry is malformed, when two entries share a worker id, or when there is none.
    """
    instances: list[WorkerInstance] = []
    seen: dict[str, int] = {}
    entries = [e.strip() for e in spec.split(",")]
    for n, entry in enumerate(entries, start=1):
        if not entry:
            continue
        try:
            inst = parse_worker_url(entry, default_model=default_model)
        except ValueError as exc:
            raise ValueError(f"--workers entry {n}: {exc}") from None
        if inst.worker_id in seen:
            raise ValueError(
                f"--workers entry {n}: worker id {inst.worker_id!r} already used by entry "
                f"{seen[inst.worker_id]} (give each an id=...)"
            )
        seen[inst.worker_id] = n
        instances.append(inst)
    if not instances:
        raise ValueError("--workers: no worker given (expected tcp://HOST:PORT?role=...,...)")
    return instances


class StaticDiscovery(Discovery):
    """Reports a fixed list of workers once, then nothing: the list never changes."""

    def __init__(self, instances: list[WorkerInstance]) -> None:
        self.instances = list(instances)

    @classmethod
    def from_spec(cls, spec: str, *, default_model: str) -> StaticDiscovery:
        """Build from a ``--workers`` value; raises ``ValueError`` (see :func:`parse_workers`)."""
        return cls(parse_workers(spec, default_model=default_model))

    async def run(
        self,
        sink: DiscoverySink,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        for inst in self.instances:
            sink.worker_added(inst)
        task_status.started()
        await trio.sleep_forever()
