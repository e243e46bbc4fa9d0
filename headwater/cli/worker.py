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
    config_from_args,
    configure_logging,
    engine_config_from_args,
    etcd_credentials_from_args,
)
from headwater.cli.preflight import check_engine, check_port
from headwater.etcd.client import EtcdError, etcd_endpoints
from headwater.gc_tuning import tune_gc
from headwater.logs import set_process_worker
from headwater.malloc_tuning import keep_freed_heap
from headwater.orphans import supervisor_pid, terminate_when_orphaned
from headwater.plane.server import check_bind
from headwater.plane.tls import check_certificate, tls_config
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
    """``headwater worker``'s options: WorkerConfig's fields and its plane listener's,
    generated (headwater/config_fields.py), then those that are not config fields (a
    secret's file, TLS files, logging, etcd's credentials) and the engines' own."""
    add_config_options(parser, WorkerConfig)
    a = parser.add_argument
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
    add_etcd_options(parser)
    for name in registry.names():
        spec = registry.spec(name)
        group = parser.add_argument_group(f"engine {name}", spec.summary)
        add_config_options(group, registry.config_type(name))


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError (bad values), OSError (unreadable secret file)."""
    config: WorkerConfig = config_from_args(
        WorkerConfig,
        args,
        engine_config=engine_config_from_args(args),
        secret=load_secret(args.plane_secret_file),
        tls=tls_config(args.plane_tls_certfile, args.plane_tls_keyfile, args.plane_tls_ca_file),
        etcd=etcd_credentials_from_args(args),
    )
    return config


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
