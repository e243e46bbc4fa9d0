"""Several frontend processes on one port: ``headwater serve --processes N``, the default.

Why: one frontend is one trio event loop, and one loop is one core's worth of HTTP
parsing, templating, routing and streaming (tokenization already runs in threads
beside it). Past that, Python uses more cores with more processes, so ``headwater
serve`` runs one whole frontend per usable core (``--processes auto``) behind one
listening socket; ``--processes 1`` is a single process with no supervisor, and so is
auto on a machine with one usable core.

How (:func:`run_group`): this process, the supervisor, binds the port, loads the
tokenizer and imports the frontend, then forks a *zygote* while it still has one
thread and runs no trio (:mod:`headwater.cluster.zygote`), and only then starts trio.
The zygote forks the N frontend processes, which inherit the socket and share the
zygote's memory (the tokenizer above all) copy-on-write. They take turns at the
socket: one that holds more connections than another leaves a new one to the others
for a moment (:mod:`frontend.http.serving.balance`; the kernel alone hands a connection
to whichever process accepts first, and keep-alive makes that coin toss last). Each
process is a complete frontend: its own tokenizer pool (sharing the loaded tables),
router, stall detector and in-process workers (or its own connections to remote
ones). Each also listens on a private port of its own, for its own ``/metrics`` and
``/dashboard``; the supervisor prints one line per process
(:func:`headwater.cluster.recipes.member_line`) and then the usual ``headwater: serving
<model> on <url>`` line. On the shared port ``/metrics`` and ``/dashboard`` show the
whole group: the process that takes the request relays it to the supervisor, which
asks every process and merges (:mod:`headwater.cluster.group_view`).

If the zygote cannot be forked (another thread is running) or is gone, processes are
started as programs instead (``python -m headwater serve <the same options>
--processes 1 --listen-fd FD``), each loading its own tokenizer: slower to start and
unshared, but the same frontend.

Lifetime: a process that exits on its own is restarted (forked again from the same
pristine zygote), on the same shared socket, while the others go on serving: each is
a :class:`~headwater.cluster.supervisor.Supervised` process, with the same restart
policy as ``headwater launch`` (backoff with jitter, a budget per window; the
``--restart-*`` options). The supervisor keeps the socket open for that, and never
accepts on it: connections that arrive while a process restarts wait in the kernel's
queue for the others. A restarted process has a new private port, printed on a new
member line. Only a process that exhausts its budget stops the frontend (status 1):
one that crash-loops is a configuration to fix, not a fault to wait out. SIGINT or
SIGTERM is passed on as SIGTERM, and each process drains as a single frontend does.
If the supervisor itself is killed (SIGKILL, a crash), the zygote sees its socket
close and stops every process (each drains), and a process whose parent disappears
stops as if signalled (:mod:`headwater.orphans`): no frontend outlives its supervisor.
The supervisor in turn stops its group when the process that started it (``headwater
launch``) is gone.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import trio
from trio_util import wait_any

from frontend.config import FrontendConfig
from frontend.http.serving.balance import AcceptShares
from headwater.cli.secret_args import api_keys_to_env
from headwater.cluster.children import LaunchError, child_env, watch
from headwater.cluster.group_view import GroupView, Member, private_port_tls
from headwater.cluster.recipes import (
    FrontendProcess,
    frontend_announced,
    member_line,
    spawn_frontend,
)
from headwater.cluster.supervisor import RestartPolicy, Starter, Supervised
from headwater.cluster.zygote import Zygote, ZygoteError, start_zygote
from headwater.orphans import supervisor_pid, terminate_when_orphaned

if TYPE_CHECKING:
    from frontend.preprocess.tokenizer import Tokenizer

log = logging.getLogger(__name__)

READY_WITHIN = 120.0  # s for a process to start its loop, warm its tokenizer up and listen
STOP_MARGIN = 5.0  # s beyond a process's stop timeout (drain + graceful) before it is killed


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The shared listening socket. Blocking calls, made before anything is served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def child_argv(argv: Sequence[str], fd: int, group_url: str | None = None) -> list[str]:
    """A process's command line when it is started as a program (no zygote): the
    supervisor's own options, then what makes it one of the group (later flags win in
    argparse)."""
    group = ["--group-url", group_url] if group_url else []
    return [
        sys.executable,
        "-m",
        "headwater",
        "serve",
        *argv,
        "--processes",
        "1",
        "--listen-fd",
        str(fd),
        *group,
    ]


def preload(config: FrontendConfig) -> Tokenizer:
    """What the zygote shares with every process: the frontend's modules, the engine's,
    and the tokenizer, loaded (not used: see :mod:`headwater.cluster.zygote`). Blocking.

    Raises TokenizerLoadError."""
    from frontend.preprocess.template import ChatTemplate
    from frontend.preprocess.tokenizer import Tokenizer, find_tokenizer_files
    from frontend.server import Frontend  # noqa: F401 - imported to be shared
    from workers.engines import registry

    importlib.import_module(registry.spec(config.engine).factory.partition(":")[0])
    files = find_tokenizer_files(config.tokenizer)
    ChatTemplate.from_tokenizer_config(files.config)  # imports what the template needs
    return Tokenizer(
        files, config.tokenizer_backend, segment_cache_bytes=config.tokenizer_cache_mb << 20
    )


def run_group(
    config: FrontendConfig, argv: Sequence[str], restart: RestartPolicy | None = None
) -> int:
    """``headwater serve`` with ``config.processes`` > 1, from its start to its exit
    status: bind, preload, fork the zygote, then run :func:`supervise` under trio.

    Returns 0 after a signal, 1 if the tokenizer cannot be loaded or a process failed
    to start or was given up.
    """
    from frontend.preprocess.tokenizer import TokenizerLoadError

    started = time.time()
    # No collection while the shared state loads: a collection frees objects among
    # the ones that stay, leaving holes that later allocations fill, on shared pages.
    gc.disable()
    sock = listen(config.host, config.port)
    view = listen("127.0.0.1", 0)  # the group view: the supervisor's, loopback only
    group_url = f"http://127.0.0.1:{view.getsockname()[1]}"
    with sock, view:
        try:
            tokenizer = preload(config)
        except TokenizerLoadError as exc:
            log.error("%s", exc)
            return 1
        member = replace(config, processes=1, listen_fd=sock.fileno(), group_url=group_url)
        shares = AcceptShares(config.processes)  # before the fork: every process maps it
        zygote = None
        try:
            zygote = start_zygote(
                partial(_forked_main, member, tokenizer, shares), close_fds=(view.fileno(),)
            )
        except (ZygoteError, OSError) as exc:
            log.warning(
                "cannot fork a zygote (%s): each frontend process loads its own tokenizer", exc
            )
        gc.enable()
        return trio.run(supervise, config, argv, restart, sock, view, zygote, started, shares)


def _forked_main(
    config: FrontendConfig, tokenizer: Tokenizer, shares: AcceptShares, slot: int
) -> int:
    """A frontend process, in the zygote's fresh fork: it takes turns at the shared
    socket with the group's other forked processes."""
    from headwater.cli.serve import serve_until_signalled

    assert config.listen_fd is not None  # set for every member
    balance = shares.balance(slot, config.listen_fd)
    return trio.run(serve_until_signalled, config, tokenizer, balance)


async def supervise(
    config: FrontendConfig,
    argv: Sequence[str],
    restart: RestartPolicy | None,
    sock: socket.socket,
    view_sock: socket.socket,
    zygote: Zygote | None,
    started_at: float,
    shares: AcceptShares,
) -> int:
    """Run ``config.processes`` frontend processes on *sock* until a signal, restarting
    one that exits on its own under *restart*; answer for the group on *view_sock*.
    Processes are forked by *zygote* while it lives, started as programs otherwise.

    Returns the exit status: 0 after a signal, 1 if a process failed to start or was
    given up.
    """
    host, port = sock.getsockname()[:2]
    url = f"{config.scheme}://{host}:{port}"
    group_url = f"http://127.0.0.1:{view_sock.getsockname()[1]}"
    given_up = trio.Event()
    fd = sock.fileno()
    env = child_env()  # API keys given on the command line travel here instead
    argv_ = child_argv(api_keys_to_env(argv, env), fd, group_url)
    children = [
        Supervised(
            f"frontend process {i}",
            _starter(i, argv_, env, fd, zygote, shares),
            restart,
            on_give_up=lambda _process: given_up.set(),
            stop_grace=config.stop_timeout + STOP_MARGIN,
        )
        for i in range(config.processes)
    ]

    def members() -> list[Member]:
        return [
            Member(i, p.child.pid, p.child.urls[-1], p.statistics().running, p.restarts)
            for i, p in enumerate(children)
            if p.child is not None
        ]

    def others() -> dict[str, int]:
        out = {"supervisor": os.getpid()}
        if zygote is not None and zygote.alive:
            out["zygote"] = zygote.pid
        return out

    tls = private_port_tls(config.ssl_certfile) if config.ssl_certfile else None
    group = GroupView(
        members,
        others=others,
        api_keys=config.api_keys,
        api_keys_file=config.api_keys_file,
        metrics_auth=config.metrics_auth,
        started_at=started_at,
        tls=tls,
    )
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(view_sock.dup()))
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            if zygote is not None:
                await nursery.start(zygote.run)
            nursery.start_soon(group.serve, listener)
            if (supervisor := supervisor_pid()) is not None:  # under headwater launch
                nursery.start_soon(terminate_when_orphaned, supervisor)
            try:
                started = await _start_all(nursery, children)
            except LaunchError as exc:
                log.error("%s", exc)
                nursery.cancel_scope.cancel()  # the started ones are killed by their watchers
                return 1
            for i, child in enumerate(started):
                print(member_line(i, child.pid, child.urls[-1]), flush=True)
            print(f"headwater: serving {config.model_name} on {url}", flush=True)
            await wait_any(partial(_first_signal, signals), given_up.wait)
            status = 0
            if given_up.is_set():
                for process in children:
                    if process.failure is not None:
                        log.error("%s", process.failure)
                log.error("stopping the other frontend processes")
                status = 1
            else:
                log.info("signal received: stopping %d frontend processes", len(children))
            async with trio.open_nursery() as stopping:
                for process in children:
                    stopping.start_soon(process.stop)
            if zygote is not None:
                await zygote.aclose()
            nursery.cancel_scope.cancel()
    return status


def _starter(
    i: int,
    argv: list[str],
    env: dict[str, str],
    fd: int,
    zygote: Zygote | None,
    shares: AcceptShares,
) -> Starter[FrontendProcess]:
    """How process *i* is started, and started again: forked by the zygote while it
    lives, else as a program; the same socket either way. A restart announces the
    process's new private URL. Its slot in *shares* reads absent until a forked
    process joins (one started as a program does not share the counts)."""
    name = f"frontend process {i}"

    async def start(nursery: trio.Nursery, previous: FrontendProcess | None) -> FrontendProcess:
        shares.mark_absent(i)  # the previous process, if any, is gone
        if zygote is not None and zygote.alive:
            try:
                forked = await zygote.fork(i)
            except ZygoteError as exc:
                raise LaunchError(f"{name}: {exc}") from exc
            child = watch(
                FrontendProcess,
                nursery,
                name,
                forked,
                None,
                (f"(forked by the zygote, pid {zygote.pid})",),
            )
            child = await frontend_announced(child, nursery, ready_within=READY_WITHIN)
        else:
            child = await spawn_frontend(
                nursery,
                argv,
                name=name,
                log_path=None,
                env=env,
                pass_fds=(fd,),
                ready_within=READY_WITHIN,
            )
        if previous is not None:
            print(member_line(i, child.pid, child.urls[-1]), flush=True)
        return child

    return start


async def _start_all(
    nursery: trio.Nursery, children: list[Supervised[FrontendProcess]]
) -> list[FrontendProcess]:
    """Start every child at once (each loads a tokenizer: seconds of CPU); return their
    first incarnations, in order.

    Raises the first child's LaunchError if any fails; the others are then killed
    by their watchers when the caller cancels *nursery*.
    """
    started: dict[int, FrontendProcess] = {}
    failures: list[LaunchError] = []

    async def start(i: int, process: Supervised[FrontendProcess]) -> None:
        try:
            started[i] = await nursery.start(process.run)
        except LaunchError as exc:
            failures.append(exc)

    async with trio.open_nursery() as starting:
        for i, process in enumerate(children):
            starting.start_soon(start, i, process)
    if failures:
        raise failures[0]
    return [started[i] for i in range(len(children))]


async def _first_signal(signals: AsyncIterator[int]) -> None:
    async for _ in signals:
        return
