"""Run one prefill / decode / aggregated worker process on the TCP request plane.

``headwater worker --role agg`` binds the listener, builds the engine, serves, and
prints one line to stdout once it accepts connections::

    HEADWATER_WORKER_READY tcp://127.0.0.1:PORT <worker_id> <role>

With ``--discovery etcd://HOST:PORT`` it registers in etcd before printing that line
(on a lease of ``--lease-ttl`` seconds, kept alive while it runs), so frontends
watching etcd find it.

SIGTERM or SIGINT drains it: the etcd record turns ``draining`` (frontends stop
routing here), every connected frontend gets a goaway, in-flight requests finish
(and, on a prefill worker, held KV gets pulled) for up to ``--drain-timeout``
seconds, then the lease is revoked and the process exits 0. A second signal stops at
once (exit 1). A worker whose supervisor (``headwater launch``) is gone drains as on
SIGTERM (:mod:`headwater.orphans`). The lifecycle itself is
:func:`workers.lifecycle.serve_worker`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Iterator

import trio

from headwater.cli.options import (
    LOG_FORMATS,
    LOG_LEVELS,
    add_config_options,
    add_etcd_options,
    configure_logging,
    engine_config_from_args,
    etcd_credentials_from_args,
    non_negative_int,
    positive_float,
)
from headwater.cli.preflight import check_engine, check_port
from headwater.etcd.client import EtcdError, etcd_endpoints
from headwater.gc_tuning import tune_gc
from headwater.logs import set_process_worker
from headwater.malloc_tuning import keep_freed_heap
from headwater.orphans import supervisor_pid, terminate_when_orphaned
from headwater.plane.server import ServerConfig, check_bind
from headwater.plane.tls import check_certificate, tls_config
from headwater.wire import Role
from headwater.wire.handshake import load_secret
from workers.engines import registry
from workers.engines.base import EngineFailed
from workers.lifecycle import (
    RunningWorker,
    WorkerConfig,
    advertised_host,
    ready_line,
    serve_worker,
    split_host_port,
)
from workers.runtime.registration import RegistrationHooks

log = logging.getLogger("workers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkerConfig(worker_id="-")
    a = parser.add_argument
    a("--role", choices=[r.value for r in Role], default=d.role.value, help="what this worker does")
    a("--engine", choices=registry.names(), default=d.engine, help="engine implementation")
    a("--listen", default=d.listen, help="host:port to listen on (port 0: any free port)")
    a("--advertise-host", default="", help="host in the advertised address (default: listen host)")
    a("--model-name", default=d.model_name, help="model name this worker serves")
    a("--worker-id", default="", help="unique worker id (default: <role>-<random>)")
    a(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    a(
        "--peer-timeout",
        type=positive_float,
        default=d.server.heartbeat_timeout,
        help="seconds a plane connection may stay silent (peers ping every 5 s) before "
        "the worker closes it and cancels its requests",
    )
    a(
        "--max-connections-per-address",
        type=non_negative_int,
        default=d.server.max_connections_per_address,
        help="plane connections open at once per peer IP address; one more is closed as soon "
        "as it is accepted (0: no limit)",
    )
    a(
        "--max-connections",
        type=non_negative_int,
        default=None,
        help="plane connections open at once in all (default: half the process's file "
        "descriptor limit, at most 4096; 0: no limit)",
    )
    a(
        "--plane-secret-file",
        default=None,
        help="file holding the shared plane secret (else HEADWATER_PLANE_SECRET); required "
        "to listen beyond loopback",
    )
    t = parser.add_argument_group(
        "plane TLS (all three or none; docs/request-plane.md)",
        "Mutual TLS on this worker's listener and on its KV pulls; the secret's handshake "
        "still runs inside it.",
    )
    t.add_argument(
        "--plane-tls-certfile",
        default=None,
        metavar="PEM",
        help="this worker's certificate chain; it must name the advertised host "
        "(--advertise-host, else the listen host) and allow server and "
        "client use",
    )
    t.add_argument(
        "--plane-tls-keyfile",
        default=None,
        metavar="PEM",
        help="the private key of --plane-tls-certfile",
    )
    t.add_argument(
        "--plane-tls-ca-file",
        default=None,
        metavar="PEM",
        help="the CA that every peer's certificate (frontends, other workers) "
        "must chain to; nothing else is trusted",
    )
    a(
        "--kv-peers",
        default="",
        help="comma-separated tcp://host:port of the prefill workers a decode worker may pull "
        "KV from, besides those registered in etcd (--discovery); with neither, a worker "
        "listening on loopback pulls from loopback ones. A KV handle naming any other "
        "address is refused",
    )
    a("--metrics-port", type=int, default=0, help="metrics HTTP port (0 = off)")
    a(
        "--metrics-host",
        default=d.metrics_host,
        help="address the metrics port binds (loopback by default; 0.0.0.0 for a "
        "scraper on another host, e.g. Prometheus in a cluster)",
    )
    a(
        "--discovery",
        default="",
        help="register in etcd for frontends to find, e.g. etcd://127.0.0.1:2379 (default: "
        "no registration; frontends then need --workers)",
    )
    a(
        "--lease-ttl",
        type=int,
        default=d.lease_ttl,
        help="seconds a crashed worker stays registered in etcd (lease TTL)",
    )
    a(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log level (debug also shows every etcd call)",
    )
    a(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line (docs/observability.md)",
    )
    a(
        "--otlp-endpoint",
        default="",
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. http://127.0.0.1:4318 "
        "(default: no tracing)",
    )
    add_etcd_options(parser)
    for name in registry.names():
        spec = registry.spec(name)
        group = parser.add_argument_group(f"engine {name}", spec.summary)
        add_config_options(group, registry.config_type(name))


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError (bad values), OSError (unreadable secret file)."""
    return WorkerConfig(
        role=Role(args.role),
        engine=args.engine,
        engine_config=engine_config_from_args(args),
        listen=args.listen,
        advertise_host=args.advertise_host,
        model_name=args.model_name,
        worker_id=args.worker_id,
        drain_timeout=args.drain_timeout,
        server=ServerConfig(
            heartbeat_timeout=args.peer_timeout,
            max_connections_per_address=args.max_connections_per_address,
            max_connections=args.max_connections,
        ),
        secret=load_secret(args.plane_secret_file),
        tls=tls_config(args.plane_tls_certfile, args.plane_tls_keyfile, args.plane_tls_ca_file),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        discovery=args.discovery,
        lease_ttl=args.lease_ttl,
        etcd=etcd_credentials_from_args(args),
        kv_peers=tuple(p.strip() for p in args.kv_peers.split(",") if p.strip()),
        otlp_endpoint=args.otlp_endpoint,
    )


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a drain; 1 on a forced stop, a bind failure, no etcd or an
    engine that failed (its model server would not start, or died for good); 2 on bad
    options and on what the start-up checks find (headwater.cli.preflight: a port in
    use, the engine's model or server not there)."""
    configure_logging(args.log_level, args.log_format)
    try:
        config = worker_config_from_args(args)
        host, port = split_host_port(config.listen)
        check_bind(host, config.secret)
        # Before anything slow (a model server's start): the port, the engine's own.
        check_port(host, port, "--listen")
        check_engine(config.engine_config)
        if config.tls is not None:
            check_certificate(config.tls, advertised_host(config, host))
    except (ValueError, OSError) as exc:
        print(f"headwater worker: {exc}", file=sys.stderr)
        return 2
    set_process_worker(config.worker_id)  # every log line of this process names it
    tune_gc()  # its requests carry the same long token lists as the frontend's
    keep_freed_heap()  # its large plane buffers are freed and allocated per request
    try:
        return trio.run(_run, config)
    except (OSError, EtcdError, EngineFailed, BaseExceptionGroup) as exc:
        leaves = list(_leaves(exc))
        if not all(isinstance(e, OSError | EtcdError | EngineFailed) for e in leaves):
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
                capacity=config.capacity,
                ttl=config.lease_ttl,
                secret=config.secret,  # signs its record: frontends check it
                credentials=config.etcd,
            )
        nursery.start_soon(_watch_signals, stop, forced, nursery.cancel_scope)
        if (supervisor := supervisor_pid()) is not None:  # under headwater launch
            nursery.start_soon(terminate_when_orphaned, supervisor, stop)
        worker: RunningWorker = await nursery.start(
            _serve, config, stop, nursery.cancel_scope, hooks
        )
        print(ready_line(worker.address, worker.worker_id, worker.role), flush=True)
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
