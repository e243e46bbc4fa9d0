"""Run a local cluster: etcd, prefill / decode / aggregated workers and a frontend.

    headwater launch --prefill 2 --decode 2                  # what `make cluster` runs
    headwater launch --agg 1 --port 0 -- --router p2c        # options after -- go to serve

Starts, on free loopback ports and in a temporary directory: etcd (with
``--discovery etcd``, the default when the etcd binary is found), the workers
(``headwater worker``, registering in that etcd; with ``--discovery static`` they
start first and the frontend gets their addresses as ``--workers``), then the
frontend (``headwater serve``). Prints the URL once ``/health`` answers 200,
then a line ``HEADWATER_CLUSTER_READY <url>``. Everything binds 127.0.0.1.

With more than one worker of a role the frontend routes by KV cache (``--router kv``)
unless ``--router`` is given after ``--`` (docs/routing.md, "The default").

Options after ``--`` are passed to ``headwater serve`` as they are (``--router``,
``--tokenizer-threads``, ...), except the ones the launcher sets itself: ``--host``,
``--port``, ``--model-name``, ``--workers``, ``--discovery``. The engine's options
(``--speedup-ratio``, ...) go to every worker; other worker options go in
``--worker-args "..."``. ``--worker-metrics`` gives each worker a ``/metrics`` (and
``/debug/*``) port of its own, listed with the processes once the cluster is up.

A process that exits on its own once the cluster is up (a crash, a kill -9) is
logged and restarted while the rest keeps serving: a worker with the same worker
id and port (static --workers lists and etcd keys still name it; with etcd it
registers again under the same key), the frontend on the same port, etcd on the
same ports with the same data. The n-th restart in a row waits a random time up to
--restart-backoff * 2**(n-1) s (at least half the first delay; at most
--restart-backoff-max); a process that stayed up for --restart-window s starts over
at the first delay. A restart that does not come up (it exits before it is ready,
its old port is taken) counts too. After --restart-budget restarts of one process
within --restart-window s, its next exit stops the cluster: the launcher says which
process, how it ended, the restarts used and the end of its log, stops the rest in
order and exits 1. --restart-budget 0: no restarts, the first exit stops the
cluster. A process that cannot start at launch fails the launch (exit 1).

Ctrl-C or SIGTERM stops the frontend first (its in-flight requests finish), then the
workers (SIGTERM: they drain), then etcd; a second signal kills whatever is left.
Logs (one file per process; a restarted process appends to its file after a
separator line) are in the run directory, which is removed after a clean stop
unless ``--workdir`` was given.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from headwater.cli.options import (
    LOG_FORMATS,
    LOG_LEVELS,
    add_config_options,
    config_argv,
    config_from_args,
    configure_logging,
    engine_config_from_args,
    engine_frontend_defaults,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from headwater.cli.preflight import check_engine, check_port
from headwater.cli.secret_args import API_KEYS_ENV, api_keys_to_env, hide_in_cmdline
from headwater.cluster.launch import (
    CLUSTER_READY_PREFIX,
    ETCD_BIN_ENV,
    ClusterPlan,
    ModelWorkers,
    find_etcd,
    run_cluster,
)
from headwater.cluster.recipes import DEFAULT_MODEL
from headwater.cluster.supervisor import RestartPolicy
from headwater.config_fields import DRAIN_TIMEOUT, option, sub_config
from workers.engines import registry
from workers.engines.config import EngineConfig

#: serve options the launcher sets itself; refused after ``--``.
OWNED_SERVE_OPTIONS = ("--host", "--port", "--model-name", "--workers", "--discovery")

__all__ = [
    "CLUSTER_READY_PREFIX",
    "ClusterPlan",
    "LaunchConfig",
    "add_arguments",
    "main",
    "plan_from_args",
]


def _discovery(text: str) -> str:
    if text in ("etcd", "static") or text.startswith(("etcd://", "etcds://")):
        return text
    raise argparse.ArgumentTypeError(f"expected etcd, static or etcd://HOST:PORT, got {text!r}")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """``headwater launch``'s own options, declared once (headwater/config_fields.py):
    the parser, the ``HEADWATER_*`` variables, ``--help`` and docs/cli.md are made from
    these fields, and :func:`plan_from_args` turns the parsed config into a
    :class:`ClusterPlan`. The engine's options are the engine's config's; what follows
    ``--`` is serve's."""

    prefill: int | None = option(
        None,
        type=non_negative_int,
        help="prefill workers (with no worker count given: 1 prefill + 1 decode)",
    )
    decode: int | None = option(None, type=non_negative_int, help="decode workers")
    agg: int | None = option(None, type=non_negative_int, help="aggregated workers")
    engine: str = option(
        registry.DEFAULT_ENGINE, choices=tuple(registry.names()), help="workers' engine"
    )
    discovery: str | None = option(
        None,
        type=_discovery,
        help="etcd: start an etcd and register the workers there (default when the etcd "
        "binary is found); static: no etcd, the frontend gets --workers; etcd://HOST:PORT: "
        "use that etcd",
    )
    etcd_binary: str = option(
        "", help=f"etcd executable (default: ${ETCD_BIN_ENV}, else etcd on PATH)"
    )
    port: int = option(8000, help="frontend port (0: any free port)")
    model_name: str = option(DEFAULT_MODEL, help="model served (frontend and workers)")
    extra_models: tuple[str, ...] = option(
        (),
        flags=("--extra-model",),
        repeat=True,
        metavar='"NAME ENGINE [ROLE=N ...] [ENGINE OPTION ...]"',
        help="workers of another model too, served by the same frontend: "
        '"coder scripted agg=1 --script answers.jsonl" (roles: prefill, decode, agg; '
        "default agg=1); repeat for more",
    )
    lease_ttl: int = option(10, type=positive_int, help="workers' etcd lease TTL (s)")
    drain_timeout: float = option(
        DRAIN_TIMEOUT,  # serve's and worker's too
        type=non_negative_float,
        help="seconds the frontend and each worker get to finish their requests at shutdown",
    )
    worker_args: str = option("", help='more worker options, one string: "--block-size 32"')
    worker_metrics: bool = option(
        False,
        help="each worker serves /metrics (and /debug/*) on a free loopback port of its own, "
        "listed once the cluster is up (a restart keeps the port)",
    )
    workdir: str | None = option(
        None,
        help="directory for logs and etcd data (default: a temporary one, removed after a "
        "clean stop)",
    )
    start_timeout: float = option(
        60.0,
        type=positive_float,
        help="seconds each process gets to start (a restart too), and the frontend to "
        "become healthy",
    )
    restart: RestartPolicy = sub_config(RestartPolicy, group="restarts")
    log_level: str = option("info", choices=LOG_LEVELS, help="the launcher's log level")
    log_format: str = option(
        "text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line: the launcher's and every child's",
    )
    otlp_endpoint: str = option(
        "",
        help="send every process's OpenTelemetry traces over OTLP/HTTP here (default: none)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, LaunchConfig)
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        metavar="-- SERVE_OPTION ...",
        help="options passed to headwater serve, after a -- separator",
    )
    for name in registry.names():
        group = parser.add_argument_group(
            f"engine {name} (every worker)", registry.spec(name).summary
        )
        add_config_options(group, registry.config_type(name))


def plan_from_args(args: argparse.Namespace) -> ClusterPlan:
    """Raises ValueError for a cluster that could not serve or a bad option."""
    c: LaunchConfig = config_from_args(LaunchConfig, args)
    serve_args = list(args.serve_args)
    if serve_args and serve_args[0] == "--":
        serve_args = serve_args[1:]
    for arg in serve_args:
        if arg.split("=", 1)[0] in OWNED_SERVE_OPTIONS:
            raise ValueError(
                f"{arg.split('=', 1)[0]} after -- : the launcher sets it (use launch's own "
                "--port / --model-name / --discovery)"
            )
    counts = (c.prefill, c.decode, c.agg)
    prefill, decode, agg = (1, 1, 0) if counts == (None, None, None) else (n or 0 for n in counts)
    if not agg and not (prefill and decode):
        raise ValueError("need --agg N, or both --prefill N and --decode N (N >= 1)")
    discovery = c.discovery
    binary = ""
    if discovery in (None, "etcd"):
        binary = find_etcd(c.etcd_binary) or ""
        if not binary:
            if discovery == "etcd":
                raise ValueError(
                    "etcd binary not found (install etcd-server, pass --etcd-binary or set "
                    f"{ETCD_BIN_ENV}), or use --discovery static"
                )
            discovery = "static"
        else:
            discovery = "etcd"
    if c.port < 0 or c.port > 65535:
        raise ValueError(f"--port must be 0-65535, got {c.port}")
    engine_config = engine_config_from_args(args)
    # Before anything starts (etcd, workers, a model server each): the frontend's port,
    # the engine's own checks.
    check_port("127.0.0.1", c.port, "--port")
    check_engine(engine_config)
    serve_args += _frontend_defaults(engine_config, serve_args)
    if max(prefill, decode, agg) > 1 and not any(
        arg.split("=", 1)[0] == "--router" for arg in serve_args
    ):
        # Several workers of a role: route by their caches (docs/routing.md, "The
        # default"); one of each leaves nothing to choose.
        serve_args += ["--router", "kv"]
    # Every child logs and traces as the launcher was told to.
    shared = [f"--log-format={c.log_format}"] if c.log_format != "text" else []
    if c.otlp_endpoint:
        shared.append(f"--otlp-endpoint={c.otlp_endpoint}")
    serve_args += shared
    # A worker is up once its engine is: a model server's start-up counts.
    start_within = max(c.start_timeout, engine_config.start_timeout + 30)
    extra_models = tuple(extra_model(text) for text in c.extra_models)
    names = [c.model_name, *(m.model for m in extra_models)]
    if len(set(names)) != len(names):
        raise ValueError(f"--extra-model: each model needs a name of its own, got {names}")
    for extra in extra_models:
        check_engine(config_from_args(registry.config_type(extra.engine), _engine_args(extra)))
    return ClusterPlan(
        prefill=prefill,
        decode=decode,
        agg=agg,
        engine=c.engine,
        engine_args=tuple(config_argv(engine_config)),
        discovery=discovery,
        etcd_binary=binary,
        port=c.port,
        model=c.model_name,
        lease_ttl=c.lease_ttl,
        drain_timeout=c.drain_timeout,
        worker_args=(*shlex.split(c.worker_args), *shared),
        worker_metrics=c.worker_metrics,
        serve_args=tuple(serve_args),
        workdir=Path(c.workdir) if c.workdir else None,
        start_within=start_within,
        restart=c.restart,
        extra_models=extra_models,
    )


def extra_model(text: str) -> ModelWorkers:
    """``--extra-model``'s "NAME ENGINE [ROLE=N ...] [ENGINE OPTION ...]"; the engine's
    options are checked by its own parser now. Raises ValueError."""
    words = shlex.split(text)
    if len(words) < 2 or words[1] not in registry.names():
        raise ValueError(
            f"--extra-model {text!r}: expected NAME ENGINE [ROLE=N ...] [OPTION ...], ENGINE "
            f"one of {', '.join(registry.names())}"
        )
    name, engine, rest = words[0], words[1], words[2:]
    counts: dict[str, int] = {}
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        role, _, n = rest.pop(0).partition("=")
        if role not in ("prefill", "decode", "agg") or not n.isdigit():
            raise ValueError(f"--extra-model {name}: expected ROLE=N (prefill, decode, agg)")
        counts[role] = int(n)
    if not counts:
        counts = {"agg": 1}
    if not counts.get("agg") and not (counts.get("prefill") and counts.get("decode")):
        raise ValueError(f"--extra-model {name}: needs agg=N, or both prefill=N and decode=N")
    roles = tuple(r for r in ("prefill", "decode", "agg") for _ in range(counts.get(r, 0)))
    extra = ModelWorkers(name, engine, tuple(rest), roles)
    _engine_args(extra)  # its options parse, or this is a bad option
    return extra


def _engine_args(extra: ModelWorkers) -> argparse.Namespace:
    """*extra*'s engine options, parsed by that engine's own options."""
    parser = argparse.ArgumentParser(prog=f"--extra-model {extra.model}", add_help=False)
    parser.exit_on_error = False
    add_config_options(parser, registry.config_type(extra.engine))
    try:
        parsed, unknown = parser.parse_known_args(list(extra.engine_args))
    except argparse.ArgumentError as exc:
        raise ValueError(f"--extra-model {extra.model}: {exc}") from None
    if unknown:
        raise ValueError(
            f"--extra-model {extra.model}: not an option of the {extra.engine} engine: "
            f"{' '.join(unknown)}"
        )
    return parsed


def _frontend_defaults(engine_config: EngineConfig, serve_args: list[str]) -> list[str]:
    """``headwater serve`` options from what the workers' engine knows of its model
    (``--tokenizer`` from its model directory, ``--context-length``,
    ``--model-vocab-size``), for those not given after ``--``."""
    given = {arg.split("=", 1)[0] for arg in serve_args}
    argv: list[str] = []
    for name, value in engine_frontend_defaults(engine_config).items():
        option = "--" + name.replace("_", "-")
        if option not in given:
            argv += [option, str(value)]
    return argv


def _api_keys(argv: list[str]) -> list[str]:
    """The keys of the ``--api-key`` options in *argv*."""
    env: dict[str, str] = {}
    api_keys_to_env(argv, env)
    return [k for k in env.get(API_KEYS_ENV, "").split(",") if k]


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a requested stop, 1 if anything failed, 2 on bad options and
    on what the start-up checks find (the frontend's port in use, the engine's model or
    server not there)."""
    configure_logging(args.log_level, args.log_format)
    # API keys for the frontend, after --: hidden from this process's command line too.
    hide_in_cmdline(_api_keys(args.serve_args))
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"headwater launch: {exc}", file=sys.stderr)
        return 2
    return trio.run(run_cluster, plan)
