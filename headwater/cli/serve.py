"""Run the OpenAI-compatible HTTP frontend (``headwater serve``).

With no worker options it serves model ``deepseek-v4`` on http://127.0.0.1:8000 with
the real DeepSeek-V4 tokenizer and an in-process prefill + decode pair of simulated
("mocker") workers. ``--workers`` or ``--discovery`` reach worker processes instead.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import trio

from frontend.config import HTTP, PROCESSES, ROUTING, FrontendConfig
from frontend.http.auth import API_KEYS_ENV, load_api_keys
from headwater.cli.options import (
    add_config_options,
    add_etcd_options,
    argument_group,
    config_from_args,
    configure_logging,
    declared_flags,
    engine_config_from_args,
    engine_frontend_defaults,
    etcd_credentials_from_args,
)
from headwater.cli.preflight import check_engine, check_port
from headwater.cli.secret_args import hide_in_cmdline
from headwater.cluster.supervisor import RestartPolicy
from headwater.malloc_tuning import limit_arenas
from headwater.orphans import supervisor_pid, terminate_when_orphaned
from headwater.wire.handshake import SECRET_ENV, load_secret
from workers.engines import registry
from workers.engines.base import EngineFailed

if TYPE_CHECKING:
    from frontend.http.serving.balance import AcceptBalance
    from frontend.preprocess.tokenizer import Tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``headwater serve``'s options: FrontendConfig's fields and those of the configs it
    holds, generated (headwater/config_fields.py), then the few that are not config
    fields (a key on the command line, a secret's file, a supervisor's restarts, etcd's
    credentials) and the engines' own."""
    add_config_options(p, FrontendConfig)
    http = argument_group(p, HTTP)
    http.add_argument(
        "--api-key",
        dest="api_key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this API key (repeatable); with keys, every route but /live and "
        "/health needs 'Authorization: Bearer KEY' (also HEADWATER_API_KEYS, "
        "comma-separated; --api-keys-file keeps keys out of the process list)",
    )
    routing = argument_group(p, ROUTING)
    routing.add_argument(
        "--plane-secret-file",
        default=None,
        help="file holding the shared plane secret, one per line as the workers' "
        "(else HEADWATER_PLANE_SECRET); read once at start (docs/security.md)",
    )
    add_config_options(argument_group(p, PROCESSES), RestartPolicy)
    add_etcd_options(p)
    for name in registry.names():
        group = p.add_argument_group(
            f"engine {name} (in-process workers)", registry.spec(name).summary
        )
        add_config_options(group, registry.config_type(name))


def load_plane_secret(secret_file: str | None) -> None:
    """Check the plane secret now (a weak one is a bad option: ValueError; an unreadable
    file: OSError). From *secret_file*, it is put in ``HEADWATER_PLANE_SECRET``, which this
    process's plane clients read, and a group's processes, forked from this one."""
    load_secret(secret_file)
    if secret_file:
        with open(secret_file, encoding="utf-8") as f:
            os.environ[SECRET_ENV] = f.read()


def frontend_config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """Raises ValueError for a value the engine's config rejects or a bad API key,
    OSError for an unreadable keys file or TLS file (``ssl.SSLError`` for one that is
    not a certificate or key, or a key that does not match).

    With in-process workers, what the engine knows of its model (its directory's
    tokenizer, its vocabulary size and context length) fills the options not given.
    """
    engine_config = engine_config_from_args(args, shared=declared_flags(FrontendConfig))
    api_keys = load_api_keys(args.api_key or (), env=os.environ.get(API_KEYS_ENV))
    if args.api_keys_file is not None:  # read now too: a bad file is a bad option
        load_api_keys(file=args.api_keys_file)
    if args.processes == 0:  # auto: the engine's choice, else one per usable CPU
        args = argparse.Namespace(**{**vars(args), "processes": None})
    model_defaults: dict[str, object] = {}
    if not args.workers and not args.discovery:
        model_defaults = engine_frontend_defaults(engine_config)
    config: FrontendConfig = config_from_args(
        FrontendConfig,
        args,
        model_defaults,
        engine_config=engine_config,
        api_keys=api_keys,
        etcd_credentials=etcd_credentials_from_args(args),
    )
    # The files are read now, not at the first connection: a bad one is a bad option.
    if config.ssl_certfile and config.ssl_keyfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        except OSError as exc:  # ssl's own errors name no file
            reason = exc.strerror or getattr(exc, "reason", None) or exc
            raise OSError(
                exc.errno,
                f"--ssl-certfile {config.ssl_certfile}, --ssl-keyfile "
                f"{config.ssl_keyfile}: {reason}",
            ) from exc
    if (plane_tls := config.plane_tls) is not None:
        plane_tls.client_context()
    return config


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a signal (once drained); 1 if a frontend process or an
    in-process engine failed, or a second signal cut the drain short; 2 on bad options
    (a tokenizer that is not the model's included) and on what the start-up checks find
    (headwater.cli.preflight: the port in use, no tokenizer at --tokenizer, the engine's
    model or server not there)."""
    from frontend.preprocess.tokenizer import TokenizerLoadError, find_tokenizer_files

    if args.api_key:  # every user of the machine reads a command line: hide them there
        hide_in_cmdline(args.api_key)
    try:
        config = frontend_config_from_args(args)
        restart = config_from_args(RestartPolicy, args)
        load_plane_secret(args.plane_secret_file)
        # Before anything slow (the tokenizer, a group's fork, a model server's start).
        if config.listen_fd is None:
            check_port(config.host, config.port, "--host, --port")
        try:
            find_tokenizer_files(config.tokenizer)
        except TokenizerLoadError as exc:
            raise ValueError(f"--tokenizer: {exc}" if args.tokenizer else str(exc)) from exc
        if not config.workers and not config.discovery:
            check_engine(config.engine_config)
    except (ValueError, OSError) as exc:
        print(f"headwater serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    limit_arenas()  # before the tokenizer's threads, and the group's fork: all inherit it
    if args.api_key:
        logging.getLogger(__name__).warning(
            "--api-key puts a key in the command line, which every user of this machine can "
            "read until it is hidden at start: use --api-keys-file or %s",
            API_KEYS_ENV,
        )
    if config.processes > 1:
        from headwater.cluster.frontend_group import run_group

        return run_group(config, args.argv, restart)
    try:
        return trio.run(serve_until_signalled, config)
    except TokenizerLoadError as exc:
        print(f"headwater serve: {exc}", file=sys.stderr)
        return 2
    except (EngineFailed, OSError, BaseExceptionGroup) as exc:
        if (failed := _only(exc, EngineFailed)) is not None:
            print(
                f"headwater serve: an in-process engine failed: {_first(failed)}", file=sys.stderr
            )
            return 1
        unbound = _first(_only(exc, OSError) or exc)
        if not isinstance(unbound, OSError) or unbound.errno not in _BIND_ERRORS:
            raise
        # The port taken between the check and the bind: still one line.
        print(
            f"headwater serve: cannot listen on {config.host}:{config.port} (--host, "
            f"--port): {unbound.strerror}",
            file=sys.stderr,
        )
        return 1


#: What a bind of the HTTP port fails with when the port is taken or not ours.
_BIND_ERRORS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _only(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """*exc* if it is a *kind*, or the part of a group that is; else None."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(kind)
    return exc if isinstance(exc, kind) else None


def _first(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def serve_until_signalled(
    config: FrontendConfig,
    tokenizer: Tokenizer | None = None,
    accept_balance: AcceptBalance | None = None,
) -> int:
    """Serve until a signal: the first drains and stops (``Frontend.stop``), a second
    one stops at once. Returns the exit status: 0, or 1 after a second signal.

    *tokenizer*: one loaded already (a process forked from the group's zygote shares
    the zygote's); *accept_balance*: the forked process's share of the group's accepts."""
    supervisor = supervisor_pid()  # who started us, if a headwater supervisor did
    from frontend.server import Frontend  # heavy imports only when serving

    log = logging.getLogger(__name__)
    frontend = Frontend(config, tokenizer=tokenizer, accept_balance=accept_balance)
    forced = False

    async def stop_on_signals(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
        nonlocal forced
        async for signum in signals:
            if not frontend.shutdown.is_set():
                log.info(
                    "%s received: draining for up to %g s (a second signal stops at once)",
                    signal.Signals(signum).name,
                    config.drain_timeout,
                )
                frontend.stop()
            else:
                log.warning("second signal: stopping now, requests in flight are cut off")
                forced = True
                scope.cancel()
                return

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signals, signals, nursery.cancel_scope)

            async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await frontend.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # stopped: the signal watcher ends too

            urls = await nursery.start(run)
            print(f"headwater: serving {config.model_name} on {' '.join(urls)}", flush=True)
            if supervisor is not None:  # launched, or one of several processes
                nursery.start_soon(terminate_when_orphaned, supervisor, frontend.shutdown)
    return 1 if forced else 0
