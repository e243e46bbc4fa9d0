"""One worker's lifecycle on the TCP request plane: bind, build, serve, drain.

:func:`serve_worker` binds the listener, builds the engine (through the registry,
:mod:`workers.engines.registry`), serves it, and reports a :class:`RunningWorker`
once it accepts connections; ``headwater worker`` (``headwater.cli.worker``) is this
function behind a command line, and tests and local clusters run it in-process. Its
``on_ready`` / ``on_stop`` hooks are where discovery registration plugs in
(:mod:`workers.runtime.registration`).

At shutdown it drains: the on-stop hooks run (with discovery: the etcd record turns
``draining``, so frontends stop routing here), every connected frontend gets a
goaway, in-flight requests finish (and, on a prefill worker, held KV gets pulled)
for up to ``drain_timeout`` seconds, then the connections close.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import trio

from headwater.config_fields import (
    DRAIN_TIMEOUT,
    address_list,
    non_negative_float,
    option,
    sub_config,
)
from headwater.etcd.client import EtcdCredentials, etcd_endpoints
from headwater.plane.connection import PlaneConfig
from headwater.plane.kv import KvPeers, KvSource, TcpKvTransfer, open_kv_transfer
from headwater.plane.server import PlaneServer, ServerConfig, check_bind
from headwater.plane.tls import TlsConfig, check_certificate
from headwater.tracing import open_tracing
from headwater.wire import Role
from headwater.wire.addresses import format_tcp_address, is_loopback
from headwater.wire.capabilities import Capabilities
from workers.engines import registry
from workers.engines.base import Engine, EngineContext
from workers.runtime.runtime import WorkerRuntime, load_of, open_runtime

log = logging.getLogger("workers")

#: First word of the line ``headwater worker`` prints once it accepts connections.
READY_PREFIX = "HEADWATER_WORKER_READY"


def ready_line(address: str, worker_id: str, role: Role) -> str:
    """The line ``headwater worker`` prints once it accepts connections; supervisors
    read it back (``headwater.cluster.recipes.parse_worker_ready``)."""
    return f"{READY_PREFIX} {address} {worker_id} {role.value}"


_HOOK_TIMEOUT = 10.0  # s for each on-stop hook
_FLUSH_TIMEOUT = 5.0  # s to send replies still queued when the drain ends

#: Called with the worker's advertised address and its engine's declaration once it
#: accepts connections.
ReadyHook = Callable[[str, Capabilities], Awaitable[None]]
#: Called when the worker starts to drain (and on a hard stop), before goaway.
StopHook = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one worker process is told; ``headwater worker --help`` lists each."""

    role: Role = option(Role.AGG, help="what this worker does")
    #: A name in :data:`workers.engines.registry.ENGINES`.
    engine: str = option(
        registry.DEFAULT_ENGINE, choices=tuple(registry.names()), help="engine implementation"
    )
    #: The engine's own config (its dataclass); None: the engine's defaults.
    engine_config: Any = None
    listen: str = option("127.0.0.1:0", help="host:port to listen on (port 0: any free port)")
    #: Default: the listen host, or this machine's hostname when listening on a wildcard.
    advertise_host: str = option("", help="host in the advertised address (default: listen host)")
    model_name: str = option("deepseek-v4", help="model name this worker serves")
    #: Unique per process; generated as ``<role>-<8 hex>`` when empty.
    worker_id: str = option("", help="unique worker id (default: <role>-<random>)")
    drain_timeout: float = option(
        DRAIN_TIMEOUT,
        type=non_negative_float,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    #: From ``--plane-secret-file`` or ``HEADWATER_PLANE_SECRET`` (never an option value).
    secret: bytes | None = field(default=None, repr=False)
    #: Mutual TLS on both of this worker's sides of the plane: its listener, and (decode,
    #: agg) its KV pulls from prefill workers; it replaces ``plane.tls``. Its certificate
    #: must name the advertised host, which :func:`serve_worker` checks. None: plain TCP.
    tls: TlsConfig | None = None
    metrics_port: int = option(0, help="metrics HTTP port (0 = off)")
    #: Loopback, unless a scraper elsewhere reads it.
    metrics_host: str = option(
        "127.0.0.1",
        help="address the metrics port binds (loopback by default; 0.0.0.0 for a scraper on "
        "another host, e.g. Prometheus in a cluster)",
    )
    #: etcd to register in (``etcd://host:port[,host:port]``); empty = no registration.
    discovery: str = option(
        "",
        help="register in etcd for frontends to find, e.g. etcd://127.0.0.1:2379 (default: "
        "no registration; frontends then need --workers)",
    )
    #: etcd raises values below its minimum (~2 s).
    lease_ttl: int = option(
        10, help="seconds a crashed worker stays registered in etcd (lease TTL)"
    )
    kv_peers: tuple[str, ...] = option(
        (),
        type=address_list,
        help="comma-separated tcp://host:port of the prefill workers a decode worker may "
        "pull KV from, besides those registered in etcd (--discovery); with neither, a "
        "worker listening on loopback pulls from loopback ones. A KV handle naming any "
        "other address is refused",
    )
    otlp_endpoint: str = option(
        "",
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. http://127.0.0.1:4318 "
        "(default: no tracing)",
    )
    #: How to authenticate to etcd (user and password, TLS); None: etcd is open.
    etcd: EtcdCredentials | None = field(default=None, repr=False)
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    #: The plane listener's limits (its options: --peer-timeout, --max-connections...).
    server: ServerConfig = sub_config(ServerConfig, group="plane listener")

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        cls = registry.config_type(self.engine)  # ValueError for an unknown engine
        if self.engine_config is None:
            object.__setattr__(self, "engine_config", cls())
        elif not isinstance(self.engine_config, cls):
            raise ValueError(f"engine {self.engine!r} takes a {cls.__name__} config")
        split_host_port(self.listen)
        if self.discovery:
            etcd_endpoints(self.discovery)
        if self.lease_ttl < 1:
            raise ValueError(f"--lease-ttl must be at least 1 s, got {self.lease_ttl}")

    @property
    def capacity(self) -> int:
        """Concurrent sequences this worker advertises (its engine's, if it says)."""
        return int(getattr(self.engine_config, "max_num_seqs", 256))


@dataclass(frozen=True, slots=True)
class RunningWorker:
    """What :func:`serve_worker` reports once it accepts connections."""

    address: str
    worker_id: str
    role: Role
    model: str
    runtime: WorkerRuntime
    server: PlaneServer
    kv_transfer: TcpKvTransfer | None


def split_host_port(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port). Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen wants host:port, got {listen!r}")
    return host.removeprefix("[").removesuffix("]") or "0.0.0.0", int(port)


async def serve_worker(
    config: WorkerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    on_ready: Sequence[ReadyHook] = (),
    on_stop: Sequence[StopHook] = (),
    task_status: trio.TaskStatus[RunningWorker] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one worker until *shutdown_trigger* returns, then drain and return.

    Order: check the bind (raises :class:`~headwater.plane.server.InsecureBind`
    off loopback without a secret) and, with ``config.tls``, the certificate (raises
    ValueError unless peers would accept it for the advertised host, OSError for an
    unreadable file), bind (OSError if taken), build engine and
    runtime, serve, run *on_ready* hooks (an exception there is fatal: a worker that
    cannot register is useless), report :class:`RunningWorker`. At shutdown: *on_stop*
    hooks (each bounded, errors logged), goaway, drain for ``drain_timeout``, close.
    Without a trigger it serves until cancelled; cancellation still runs *on_stop*.
    """
    host, port = split_host_port(config.listen)
    check_bind(host, config.secret)
    advertised = advertised_host(config, host)
    if config.tls is not None:
        check_certificate(config.tls, advertised)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    address = format_tcp_address(advertised, bound_port)
    try:
        async with (
            _tracing(config),
            _open_engine(config, address) as (engine, kv_transfer),
            open_runtime(engine, config.worker_id) as runtime,
        ):
            await _serve(
                config,
                address,
                listeners,
                runtime,
                kv_transfer,
                shutdown_trigger,
                on_ready,
                on_stop,
                task_status,
            )
    finally:
        for listener in listeners:  # serve_listeners closes them too; twice is fine
            await trio.aclose_forcefully(listener)


@asynccontextmanager
async def _tracing(config: WorkerConfig) -> AsyncIterator[None]:
    """This worker's traces to ``otlp_endpoint`` for the block, if set."""
    if not config.otlp_endpoint:
        yield
        return
    async with open_tracing(
        config.otlp_endpoint,
        "headwater-worker",
        attributes={"headwater.worker.id": config.worker_id, "headwater.role": str(config.role)},
    ):
        yield


@asynccontextmanager
async def _open_engine(
    config: WorkerConfig, address: str
) -> AsyncIterator[tuple[Engine, TcpKvTransfer | None]]:
    """The engine, and the KV transfer a decode or agg engine pulls through."""
    if config.role is Role.PREFILL:
        yield _build(config, address, None), None
        return
    # Where it may pull from: the prefill workers registered in etcd, --kv-peers; with
    # neither, on a worker listening on loopback (a one-host cluster), loopback ones.
    one_host = is_loopback(split_host_port(config.listen)[0])
    peers = KvPeers(
        config.kv_peers, loopback=one_host and not config.kv_peers and not config.discovery
    )
    async with (
        trio.open_nursery() as nursery,
        open_kv_transfer(
            peer_id=config.worker_id,
            role=str(config.role),
            secret=config.secret,
            config=replace(config.plane, tls=config.tls),
            peers=peers,
        ) as kv_transfer,
    ):
        if config.discovery:
            from workers.runtime.registration import follow_prefill_workers

            await nursery.start(
                partial(
                    follow_prefill_workers,
                    etcd_endpoints(config.discovery),
                    config.model_name,
                    peers,
                    secret=config.secret,
                    credentials=config.etcd,
                )
            )
        yield _build(config, address, kv_transfer), kv_transfer
        nursery.cancel_scope.cancel()


def _build(config: WorkerConfig, address: str, kv_transfer: TcpKvTransfer | None) -> Engine:
    context = EngineContext(
        config.role, config.worker_id, kv_transfer, address, otlp_endpoint=config.otlp_endpoint
    )
    return registry.build(config.engine, config.engine_config, context)


async def _serve(
    config: WorkerConfig,
    address: str,
    listeners: list[trio.SocketListener],
    runtime: WorkerRuntime,
    kv_transfer: TcpKvTransfer | None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None,
    on_ready: Sequence[ReadyHook],
    on_stop: Sequence[StopHook],
    task_status: trio.TaskStatus[RunningWorker],
) -> None:
    engine = runtime.engine
    server = PlaneServer(
        runtime,
        role=config.role,
        model=config.model_name,
        secret=config.secret,
        config=config.server,
        kv_source=engine if isinstance(engine, KvSource) else None,
        stats=lambda: worker_stats(runtime, kv_transfer),
        load=partial(load_of, runtime),
        tls=config.tls,
        capabilities=engine.capabilities,
    )
    worker = RunningWorker(
        address, config.worker_id, config.role, config.model_name, runtime, server, kv_transfer
    )
    stopped = False
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(server.serve, listeners)
            if config.metrics_port:
                from workers.metrics_endpoint import serve_worker_metrics

                await nursery.start(
                    partial(serve_worker_metrics, host=config.metrics_host),
                    config.metrics_port,
                    worker,
                )
            for hook in on_ready:
                await hook(address, engine.capabilities)
            log.info("%s %s %s %s", READY_PREFIX, address, config.worker_id, config.role)
            task_status.started(worker)
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger()
            stopped = True
            await _drain(config, worker, on_stop)
        finally:
            if not stopped:
                with trio.move_on_after(_HOOK_TIMEOUT, shield=True):
                    await _run_stop_hooks(on_stop)
            nursery.cancel_scope.cancel()


def worker_stats(
    runtime: WorkerRuntime, kv_transfer: TcpKvTransfer | None
) -> dict[str, int | float | str | bool]:
    """The runtime's, the engine's and the KV transfer's counters, flat (the plane's
    ``stats`` frame)."""
    rt = runtime.statistics()
    values: dict[str, int | float | str | bool] = {
        "inflight": rt.inflight,
        "served_total": rt.served_total,
        "cancelled_total": rt.cancelled_total,
        "failed_total": rt.failed_total,
        "kv_released_total": rt.kv_released_total,
        "draining": rt.draining,
    }
    values.update({f"engine_{k}": v for k, v in asdict(rt.engine).items()})
    counters = getattr(runtime.engine, "counters", None)
    if counters is not None:
        values.update({f"engine_{k}": v for k, v in asdict(counters).items()})
    if kv_transfer is not None:
        values.update({f"kv_{k}": v for k, v in asdict(kv_transfer.statistics()).items()})
    return values


async def _drain(config: WorkerConfig, worker: RunningWorker, on_stop: Sequence[StopHook]) -> None:
    log.info("%s draining (up to %g s)", worker.worker_id, config.drain_timeout)
    await _run_stop_hooks(on_stop)
    worker.server.goaway("draining")
    with trio.move_on_after(config.drain_timeout) as scope:
        await worker.runtime.drain(config.drain_timeout)
        # Handles already handed out are only useful if decode workers can pull them.
        # The Engine interface has no event for that; poll, during shutdown only.
        while worker.runtime.engine.statistics().kv_transfers_held:  # noqa: ASYNC110
            await trio.sleep(0.05)
    left = worker.runtime.statistics()
    if scope.cancelled_caught:
        log.warning(
            "%s drain timed out: %d requests and %d KV transfers abandoned",
            worker.worker_id,
            left.inflight,
            left.engine.kv_transfers_held,
        )
    else:
        log.info("%s drained", worker.worker_id)
    await worker.server.close_connections(_FLUSH_TIMEOUT)


async def _run_stop_hooks(hooks: Sequence[StopHook]) -> None:
    for hook in hooks:
        with trio.move_on_after(_HOOK_TIMEOUT) as scope:
            try:
                await hook()
            except Exception:
                log.exception("on-stop hook %r failed", hook)
        if scope.cancelled_caught:
            log.warning("on-stop hook %r took over %g s; skipped", hook, _HOOK_TIMEOUT)


def advertised_host(config: WorkerConfig, host: str) -> str:
    """The host peers reach this worker at: ``advertise_host``, else the listen *host*,
    or this machine's hostname for a wildcard."""
    if config.advertise_host:
        return config.advertise_host
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return host
