"""Run one prefill / decode / aggregated worker process on the TCP request plane.

``python -m workers --role agg`` (or ``headwater worker``) binds the listener, builds
the engine, serves, and prints one line to stdout once it accepts connections::

    HEADWATER_WORKER_READY tcp://127.0.0.1:PORT <worker_id> <role>

With ``--discovery etcd://HOST:PORT`` it registers in etcd before printing that line
(on a lease of ``--lease-ttl`` seconds, kept alive while it runs), so frontends
watching etcd find it.

SIGTERM or SIGINT drains it: the on-stop hooks run (with discovery: the etcd record
turns ``draining``, so frontends stop routing here), every connected frontend gets a
goaway, in-flight requests finish (and, on a prefill worker, held KV gets pulled)
for up to ``--drain-timeout`` seconds, then the lease is revoked and the process
exits 0. A second signal stops at once (exit 1).

The lifecycle is :func:`serve_worker`, reusable in-process (tests, a local cluster,
discovery registration via its ``on_ready`` / ``on_stop`` hooks).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import trio

from headwater.etcd.client import EtcdError, etcd_endpoints
from headwater.gc_tuning import tune_gc
from headwater.plane.connection import PlaneConfig
from headwater.wire import Role
from headwater.wire.framing import format_tcp_address, load_secret
from workers.engines.base import Engine, KvTransfer
from workers.runtime.kv_transfer_tcp import TcpKvTransfer
from workers.runtime.registration import RegistrationHooks
from workers.runtime.runtime import WorkerRuntime
from workers.runtime.tcp_server import PlaneServer, ServerConfig, check_bind

log = logging.getLogger("workers")

READY_PREFIX = "HEADWATER_WORKER_READY"
ENGINES = ("mocker",)
_HOOK_TIMEOUT = 10.0  # s for each on-stop hook
_FLUSH_TIMEOUT = 5.0  # s to send replies still queued when the drain ends

#: Called with the worker's advertised address once it accepts connections.
ReadyHook = Callable[[str], Awaitable[None]]
#: Called when the worker starts to drain (and on a hard stop), before goaway.
StopHook = Callable[[], Awaitable[None]]
#: Builds the engine once the address (which prefill handles advertise) is known.
EngineFactory = Callable[["WorkerConfig", str, KvTransfer | None], Engine]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one worker process is told; see ``--help`` for each option."""

    role: Role = Role.AGG
    engine: str = "mocker"
    #: host:port to bind; port 0 picks a free one.
    listen: str = "127.0.0.1:0"
    #: Host put in the advertised address; default: the listen host, or this
    #: machine's hostname when listening on a wildcard.
    advertise_host: str = ""
    model_name: str = "deepseek-v4"
    #: Unique per process; generated as ``<role>-<8 hex>`` when empty.
    worker_id: str = ""
    #: Seconds in-flight requests get to finish after SIGTERM.
    drain_timeout: float = 30.0
    secret: bytes | None = field(default=None, repr=False)
    #: Port of the metrics endpoint; 0 = off.
    metrics_port: int = 0
    #: etcd to register in (``etcd://host:port[,host:port]``); empty = no registration.
    discovery: str = ""
    #: Seconds the etcd lease outlives the last keep-alive: how long a crashed worker
    #: stays registered. etcd raises values below its minimum (~2 s).
    lease_ttl: int = 10
    # mocker sizing
    speedup_ratio: float = 1.0
    kv_bytes_per_token: int = 16  # bytes of KV payload per prompt token
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 64
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        split_host_port(self.listen)
        if self.discovery:
            etcd_endpoints(self.discovery)
        if self.lease_ttl < 1:
            raise ValueError(f"--lease-ttl must be at least 1 s, got {self.lease_ttl}")


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


def mocker_engine(config: WorkerConfig, address: str, kv_transfer: KvTransfer | None) -> Engine:
    """The default :data:`EngineFactory`: the simulated engine sized by *config*."""
    from workers.engines.mocker import MockerConfig, MockerEngine

    mocker = MockerConfig(
        speedup_ratio=config.speedup_ratio,
        block_size=config.block_size,
        num_gpu_blocks=config.num_gpu_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_bytes_per_token=config.kv_bytes_per_token,
    )
    return MockerEngine(
        mocker, config.role, config.worker_id, kv_transfer=kv_transfer, transfer_address=address
    )


async def serve_worker(
    config: WorkerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    on_ready: Sequence[ReadyHook] = (),
    on_stop: Sequence[StopHook] = (),
    engine_factory: EngineFactory = mocker_engine,
    task_status: trio.TaskStatus[RunningWorker] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one worker until *shutdown_trigger* returns, then drain and return.

    Order: check the bind (raises :class:`~workers.runtime.tcp_server.InsecureBind`
    off loopback without a secret), bind (OSError if taken), build engine and
    runtime, serve, run *on_ready* hooks (an exception there is fatal: a worker that
    cannot register is useless), report :class:`RunningWorker`. At shutdown: *on_stop*
    hooks (each bounded, errors logged), goaway, drain for ``drain_timeout``, close.
    Without a trigger it serves until cancelled; cancellation still runs *on_stop*.
    """
    host, port = split_host_port(config.listen)
    check_bind(host, config.secret)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    address = format_tcp_address(_advertised_host(config, host), bound_port)

    kv_transfer: TcpKvTransfer | None = None
    if config.role is not Role.PREFILL:
        kv_transfer = TcpKvTransfer(
            peer_id=config.worker_id, role=str(config.role), secret=config.secret,
            config=config.plane,
        )
    try:
        engine = engine_factory(config, address, kv_transfer)
    except BaseException:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise
    runtime = WorkerRuntime(engine, config.worker_id)
    server = PlaneServer(
        runtime,
        role=config.role,
        model=config.model_name,
        secret=config.secret,
        config=config.server,
        extra_stats=partial(_extra_stats, engine, kv_transfer),
    )
    worker = RunningWorker(
        address, config.worker_id, config.role, config.model_name, runtime, server, kv_transfer
    )
    stopped = False
    async with trio.open_nursery() as nursery:
        try:
            if kv_transfer is not None:
                await nursery.start(kv_transfer.run)
            await nursery.start(runtime.run)
            await nursery.start(server.serve, listeners)
            if config.metrics_port:
                await _start_metrics(nursery, config.metrics_port, worker)
            for hook in on_ready:
                await hook(address)
            log.info("%s %s %s %s", READY_PREFIX, address, config.worker_id, config.role)
            task_status.started(worker)
            if shutdown_trigger is None:
                await trio.sleep_forever()
            await shutdown_trigger()
            stopped = True
            await _drain(config, worker, on_stop)
        finally:
            if not stopped:
                with trio.move_on_after(_HOOK_TIMEOUT, shield=True):
                    await _run_stop_hooks(on_stop)
            nursery.cancel_scope.cancel()


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
            worker.worker_id, left.inflight, left.engine.kv_transfers_held,
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


def _advertised_host(config: WorkerConfig, host: str) -> str:
    if config.advertise_host:
        return config.advertise_host
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return host


def _extra_stats(
    engine: Engine, kv_transfer: TcpKvTransfer | None
) -> dict[str, int | float | str | bool]:
    values: dict[str, int | float | str | bool] = {}
    counters = getattr(engine, "counters", None)
    if counters is not None:
        values.update({f"engine_{k}": v for k, v in asdict(counters).items()})
    if kv_transfer is not None:
        values.update({f"kv_{k}": v for k, v in asdict(kv_transfer.statistics()).items()})
    return values


async def _start_metrics(nursery: trio.Nursery, port: int, worker: RunningWorker) -> None:
    """Serve worker metrics on *port* if this build has ``workers.metrics``.

    Its contract: ``serve_worker_metrics(port, worker, *, task_status)``, started in
    the worker's nursery, reporting started once listening.
    """
    try:
        from workers import metrics  # type: ignore[attr-defined]
    except ImportError:
        log.info("--metrics-port %d: this build has no worker metrics; not serving", port)
        return
    await nursery.start(metrics.serve_worker_metrics, port, worker)


# ---- command line ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkerConfig(worker_id="-")
    a = parser.add_argument
    a("--role", choices=[r.value for r in Role], default=d.role.value, help="what this worker does")
    a("--engine", choices=ENGINES, default=d.engine, help="engine implementation")
    a("--listen", default=d.listen, help="host:port to listen on (port 0: any free port)")
    a("--advertise-host", default="", help="host in the advertised address (default: listen host)")
    a("--model-name", default=d.model_name, help="model name this worker serves")
    a("--worker-id", default="", help="unique worker id (default: <role>-<random>)")
    a("--speedup-ratio", type=float, default=d.speedup_ratio, help="mocker: divide step times")
    a("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token,
      help="KV payload bytes per prompt token moved on a transfer")
    a("--drain-timeout", type=float, default=d.drain_timeout,
      help="seconds in-flight requests get to finish after SIGTERM")
    a("--plane-secret-file", default=None,
      help="file holding the shared plane secret (else HEADWATER_PLANE_SECRET); required "
      "to listen beyond loopback")
    a("--metrics-port", type=int, default=0, help="metrics HTTP port (0 = off)")
    a("--discovery", default="",
      help="register in etcd for frontends to find, e.g. etcd://127.0.0.1:2379 (default: "
      "no registration; frontends then need --workers)")
    a("--lease-ttl", type=int, default=d.lease_ttl,
      help="seconds a crashed worker stays registered in etcd (lease TTL)")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"],
      help="log level")
    a("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="mocker: KV cache blocks")
    a("--max-num-seqs", type=int, default=d.max_num_seqs, help="mocker: max running sequences")
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
      help="mocker: token budget per step")
    a("--block-size", type=int, default=d.block_size, help="mocker: tokens per KV block")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError (bad values), OSError (unreadable secret file)."""
    return WorkerConfig(
        role=Role(args.role),
        engine=args.engine,
        listen=args.listen,
        advertise_host=args.advertise_host,
        model_name=args.model_name,
        worker_id=args.worker_id,
        drain_timeout=args.drain_timeout,
        secret=load_secret(args.plane_secret_file),
        metrics_port=args.metrics_port,
        discovery=args.discovery,
        lease_ttl=args.lease_ttl,
        speedup_ratio=args.speedup_ratio,
        kv_bytes_per_token=args.kv_bytes_per_token,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
    )


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a drain; 1 on a forced stop, a bind failure or no etcd;
    2 on bad options."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
        check_bind(split_host_port(config.listen)[0], config.secret)
    except (ValueError, OSError) as exc:
        print(f"headwater worker: {exc}", file=sys.stderr)
        return 2
    tune_gc()  # its requests carry the same long token lists as the frontend's
    try:
        return trio.run(_run, config)
    except (OSError, EtcdError, BaseExceptionGroup) as exc:
        leaves = list(_leaves(exc))
        if not all(isinstance(e, OSError | EtcdError) for e in leaves):
            raise
        for e in leaves:
            print(f"headwater worker: {e}", file=sys.stderr)
        return 1


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


async def _run(config: WorkerConfig) -> int:
    stop = trio.Event()
    forced = trio.Event()
    async with trio.open_nursery() as nursery:
        hooks: RegistrationHooks | None = None
        if config.discovery:
            hooks = RegistrationHooks(
                etcd_endpoints(config.discovery),
                nursery,
                worker_id=config.worker_id,
                role=str(config.role),
                model=config.model_name,
                capacity=config.max_num_seqs,
                ttl=config.lease_ttl,
            )
        nursery.start_soon(_watch_signals, stop, forced, nursery.cancel_scope)
        worker: RunningWorker = await nursery.start(
            _serve, config, stop, nursery.cancel_scope, hooks
        )
        print(f"{READY_PREFIX} {worker.address} {worker.worker_id} {worker.role}", flush=True)
    return 1 if forced.is_set() else 0


async def _serve(
    config: WorkerConfig,
    stop: trio.Event,
    done: trio.CancelScope,
    hooks: RegistrationHooks | None,
    *,
    task_status: trio.TaskStatus[RunningWorker],
) -> None:
    # Registration order: registered before READY; draining published before the
    # goaway; the lease revoked only once the drain is over (in-flight requests done).
    await serve_worker(
        config,
        shutdown_trigger=stop.wait,
        on_ready=[hooks.on_ready] if hooks else (),
        on_stop=[hooks.on_stop] if hooks else (),
        task_status=task_status,
    )
    if hooks is not None:
        await hooks.deregister()
    done.cancel()  # drained: stop watching for signals too


async def _watch_signals(
    stop: trio.Event, forced: trio.Event, everything: trio.CancelScope
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                log.info("%s: draining", name)
                stop.set()
            else:
                log.warning("%s again: stopping now", name)
                forced.set()
                everything.cancel()
                return
