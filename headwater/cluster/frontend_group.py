"""Several frontend processes on one port: ``headwater serve --processes N``.

Why: one frontend is one trio event loop, and one loop is one core's worth of HTTP
parsing, templating, routing and streaming (tokenization already runs in threads
beside it). Past that, Python uses more cores with more processes; this module runs
N whole frontends behind one listening socket.

How: this process, the supervisor, binds the port and starts N children
(``python -m headwater serve <the same options> --processes 1 --listen-fd FD``) that inherit
the socket. The kernel hands each new connection to whichever child accepts first, so
a busy child takes fewer. Each child is a complete frontend: its own tokenizer pool,
router, stall detector and in-process workers (or its own connections to remote
ones). On the shared port ``/metrics`` and ``/dashboard`` answer from whichever child
took the connection, so each child also listens on a private port of its own; the
supervisor prints one line per child (:func:`headwater.cluster.recipes.member_line`) and
then the usual ``headwater: serving <model> on <url>`` line.

Lifetime: a child that exits on its own is restarted, on the same shared socket,
while the others go on serving: each child is a
:class:`~headwater.cluster.supervisor.Supervised` process, with the same restart policy
as ``headwater launch`` (backoff with jitter, a budget per window; the ``--restart-*``
options). The supervisor keeps the socket open for that, and never accepts on it:
connections that arrive while a child restarts wait in the kernel's queue for the
others. A restarted child has a new private port, printed on a new member line. Only a
child that exhausts its budget stops the frontend (status 1): one that crash-loops is
a configuration to fix, not a fault to wait out. SIGINT or SIGTERM is passed on as
SIGTERM, and each child drains as a single frontend does. If the supervisor itself is
killed (SIGKILL, a crash), each child notices that it was re-parented and stops as if
signalled (:func:`terminate_when_orphaned`): no frontend outlives its supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from functools import partial

import trio
from trio_util import wait_any

from frontend.config import FrontendConfig
from headwater.cluster.children import LaunchError
from headwater.cluster.recipes import FrontendProcess, member_line, spawn_frontend
from headwater.cluster.supervisor import RestartPolicy, Starter, Supervised

log = logging.getLogger(__name__)

READY_WITHIN = 120.0  # s for a child to load its tokenizer and listen
STOP_MARGIN = 5.0  # s beyond a child's stop timeout (drain + graceful) before it is killed


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


def child_argv(argv: Sequence[str], fd: int) -> list[str]:
    """A child's command line: the supervisor's own options, then what makes it a child
    (later flags win in argparse)."""
    return [sys.executable, "-m", "headwater", "serve", *argv, "--processes", "1",
            "--listen-fd", str(fd)]  # fmt: skip


async def supervise(
    config: FrontendConfig, argv: Sequence[str], restart: RestartPolicy | None = None
) -> int:
    """Run ``config.processes`` children on one socket until a signal, restarting one
    that exits on its own under *restart*.

    Returns the exit status: 0 after a signal, 1 if a child failed to start or was
    given up.
    """
    sock = listen(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"{config.scheme}://{host}:{port}"
    given_up = trio.Event()
    fd = sock.fileno()
    children = [
        Supervised(
            f"frontend process {i}", _starter(i, child_argv(argv, fd), fd), restart,
            on_give_up=lambda _process: given_up.set(),
            stop_grace=config.stop_timeout + STOP_MARGIN,
        )
        for i in range(config.processes)
    ]
    with sock, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
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
            nursery.cancel_scope.cancel()
    return status


def _starter(i: int, argv: list[str], fd: int) -> Starter[FrontendProcess]:
    """How child *i* is started, and started again: the same command on the same
    socket. A restart announces the child's new private URL."""

    async def start(nursery: trio.Nursery, previous: FrontendProcess | None) -> FrontendProcess:
        child = await spawn_frontend(
            nursery, argv, name=f"frontend process {i}", log_path=None, pass_fds=(fd,),
            ready_within=READY_WITHIN,
        )  # fmt: skip
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


async def terminate_when_orphaned(
    supervisor: int, shutdown: trio.Event, poll_s: float = 1.0
) -> None:
    """In a child: send ourselves SIGTERM once our parent is no longer *supervisor* (its
    pid, read when the child started: by the time this runs it may be gone already);
    return on *shutdown*.

    A supervisor stops its children itself, unless it is killed outright; then the
    children are re-parented and must notice on their own. ``PR_SET_PDEATHSIG`` would
    have the kernel tell them, but it fires when the parent *thread* that started the
    child exits, and trio starts processes from worker threads that come and go. So a
    child polls ``getppid()``, once a second, and then takes the usual SIGTERM path.
    """
    while not shutdown.is_set():
        if os.getppid() != supervisor:
            log.warning("supervisor (pid %d) is gone: shutting down", supervisor)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        with trio.move_on_after(poll_s):
            await shutdown.wait()
