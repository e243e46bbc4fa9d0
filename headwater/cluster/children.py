"""Child processes, started and watched: the generic half of every local supervisor.

:func:`spawn` starts a program in its own session with its stderr in a log file;
:func:`read_announcement` reads its stdout until it says it is ready (then copies the
rest to the log). The per-program recipes (etcd, a worker, a frontend) are
:mod:`headwater.cluster.recipes`; ``headwater launch`` (:mod:`headwater.cluster.launch`)
and ``headwater serve --processes N`` (:mod:`headwater.cluster.frontend_group`) are
built from both.

Ownership: every child has a watcher task in the *nursery* passed to :func:`spawn`.
It notices the exit (``child.exited``), calls *on_exit* if the child was ready and
nobody asked it to stop (a crash, or a ``kill -9`` from outside; an exit before it
was ready is the starter's LaunchError instead), and, if the nursery is cancelled
while the child still runs, kills it (SIGKILL) and reaps it, so no process outlives
its owner's nursery. Orderly shutdown is :meth:`ChildProcess.stop`.

Children start in their own session (``start_new_session``): a Ctrl-C in the
terminal reaches the supervisor only, which then stops them in order. Everything
binds 127.0.0.1. Restarting a child that exited is not this module's business but
:mod:`headwater.cluster.supervisor`'s; what it needs of a child is here (``ports``,
:func:`headwater.ports.port_free`, :func:`describe_status`, :func:`append_to_log`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeVar

import trio

from headwater.orphans import supervisor_env
from headwater.sessions import keep_niceness

if TYPE_CHECKING:
    from trio._file_io import AsyncIOWrapper

log = logging.getLogger(__name__)

#: Supervisor settings the children must not inherit from the environment: they are
#: given explicitly (and ``--workers`` with ``--discovery`` is an error).
SCRUBBED_ENV = ("HEADWATER_WORKERS", "HEADWATER_DISCOVERY", "HEADWATER_WORKER_ID")

KILL_TIMEOUT = 5.0  # s to reap a process after SIGKILL
_LOG_TAIL = 3000  # characters of a log quoted in an error

T = TypeVar("T")
C = TypeVar("C", bound="ChildProcess")
#: Called with a child that exited although nobody asked it to stop.
ExitHook = Callable[["ChildProcess"], None]


class LaunchError(Exception):
    """A child process did not start: it exited or stayed silent before it was ready.

    ``summary`` is the one-line reason; ``str()`` adds *detail* (the end of its log).
    """

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(f"{summary}{detail}")
        self.summary = summary


class ProcessHandle(Protocol):
    """What a :class:`ChildProcess` needs of the process it wraps: a
    :class:`trio.Process`, or a process forked from a zygote
    (:class:`headwater.cluster.zygote.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


class ChildProcess:
    """One running child; made by the ``start_*`` functions.

    ``address`` is what it announced: etcd's client URL, a worker's ``tcp://`` plane
    address or a frontend's ``http://`` URL. ``exited`` is set once it has exited and
    been reaped.
    """

    def __init__(
        self, name: str, process: ProcessHandle, log_path: Path | None, argv: Sequence[str]
    ) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.argv = tuple(argv)
        self.address = ""
        self.exited = trio.Event()
        #: Set once it announced itself; only then is an unexpected exit reported.
        self.ready = False
        #: Set by stop()/kill(): an exit after that is not reported to on_exit.
        self.stopping = False
        self.on_exit: ExitHook | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid={self.pid} {self.address}>"

    @property
    def ports(self) -> tuple[int, ...]:
        """The loopback ports it listens on and must get again when restarted (none
        known for a plain child; the recipes' subclasses say)."""
        return ()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child (no-op once it exited). Does not mark it as stopping."""
        if self.process.returncode is None:
            self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL now; an expected exit (on_exit is not called)."""
        self.stopping = True
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        """Wait for the exit; returns the exit status (negative: killed by that signal)."""
        await self.exited.wait()
        assert self.process.returncode is not None
        return self.process.returncode

    async def stop(self, grace: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """Ask the child to exit with *sig*; SIGKILL after *grace* seconds. Returns its
        exit status. Idempotent; safe to call on a child that already exited."""
        self.stopping = True
        if self.process.returncode is None:
            self.send_signal(sig)
            with trio.move_on_after(grace):
                return await self.wait()
            log.warning("%s did not exit within %g s; killing it", self.name, grace)
            self.kill()
        return await self.wait()

    def log_tail(self, chars: int = _LOG_TAIL) -> str:
        """The end of the child's log file (blocking read of a local file; small)."""
        if self.log_path is None:
            return "(its log went to this process's stderr)"
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def mark_ready(self, on_exit: ExitHook | None) -> None:
        self.ready = True
        self.on_exit = on_exit
        if self.exited.is_set() and not self.stopping:
            self._report_exit()  # it died between its announcement and now

    async def _supervise(self) -> None:
        try:
            await self.process.wait()
        finally:
            if self.process.returncode is None:  # our owner is going away: no orphans
                self.stopping = True
                with trio.move_on_after(KILL_TIMEOUT, shield=True):
                    self.process.kill()
                    await self.process.wait()
            self.exited.set()
        if self.ready and not self.stopping:
            self._report_exit()

    def _report_exit(self) -> None:
        log.warning(
            "%s (pid %d) exited unexpectedly: %s",
            self.name,
            self.pid,
            describe_status(self.process.returncode),
        )
        if self.on_exit is not None:
            try:
                self.on_exit(self)
            except Exception:  # a supervisor's bug must not take its siblings down
                log.exception("on_exit hook for %s failed", self.name)


# ---- spawning -----------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without :data:`SCRUBBED_ENV`, plus *extra*."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env.update(extra or {})
    return env


def describe_status(status: int | None) -> str:
    """An exit status as people read it: ``exit status 1``, ``killed by SIGKILL``."""
    if status is None:
        return "still running"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def append_to_log(path: Path | None, line: str) -> None:
    """Append *line* to a child's log file (a separator between two incarnations);
    nothing for a child without one. A blocking write of one line to a local file."""
    if path is None:
        return
    try:
        with path.open("a") as f:
            f.write(f"{line}\n")
    except OSError as exc:
        log.warning("cannot write to %s: %s", path, exc)


async def spawn(
    cls: type[C],
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    log_path: Path | None,
    *,
    env: Mapping[str, str] | None,
    stdout: bool = True,
    pass_fds: Sequence[int] = (),
) -> C:
    """Start *argv* in its own session. Its stderr goes to *log_path*, or with None to
    ours (a supervisor whose children log to the same terminal); *pass_fds* are
    inherited (a listening socket shared by frontend processes). Its environment names
    this process as its supervisor (:mod:`headwater.orphans`)."""
    log_file = None
    if log_path is not None:
        await trio.Path(log_path.parent).mkdir(parents=True, exist_ok=True)
        log_file = await trio.to_thread.run_sync(log_path.open, "ab")
    try:
        process = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout else log_file,
            stderr=log_file,
            env={**(env if env is not None else child_env()), **supervisor_env()},
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        if log_file is not None:
            log_file.close()  # the child holds its own descriptor
    keep_niceness(process.pid)
    child = watch(cls, nursery, name, process, log_path, argv)
    log.debug("started %s (pid %d): %s", name, process.pid, " ".join(argv))
    return child


def watch(
    cls: type[C],
    nursery: trio.Nursery,
    name: str,
    process: ProcessHandle,
    log_path: Path | None,
    argv: Sequence[str],
) -> C:
    """Wrap a process that was started already (by :func:`spawn`, or forked by a
    zygote) as a *cls*, with its watcher task in *nursery* (see the module docstring)."""
    child = cls(name, process, log_path, argv)
    nursery.start_soon(child._supervise, name=f"supervise {name}")
    return child


async def read_announcement(
    child: ChildProcess,
    nursery: trio.Nursery,
    parse: Callable[[str], T | None],
    within: float,
) -> T:
    """Read the child's stdout until *parse* accepts a line; then copy the rest to its log.

    Raises LaunchError (after killing the child) if it exits or stays silent for
    *within* seconds.
    """
    stdout = child.process.stdout
    assert stdout is not None
    buffer = b""
    result: T | None = None
    with trio.move_on_after(within):
        while result is None:
            while b"\n" not in buffer:
                data = await stdout.receive_some(4096)
                if not data:
                    await trio.aclose_forcefully(stdout)
                    status = await child.wait()
                    raise LaunchError(
                        f"{child.name} exited before it was ready ({describe_status(status)})",
                        f"; log {child.log_path}:\n{child.log_tail()}",
                    )
                buffer += data
            line, buffer = buffer.split(b"\n", 1)
            result = parse(line.decode(errors="replace").strip())
    if result is None:
        child.kill()
        await trio.aclose_forcefully(stdout)
        raise LaunchError(
            f"{child.name} was not ready within {within:g} s",
            f"; log {child.log_path}:\n{child.log_tail()}",
        )
    nursery.start_soon(_copy_to_log, stdout, buffer, child.log_path, name=f"stdout {child.name}")
    return result


async def _copy_to_log(stream: trio.abc.ReceiveStream, pending: bytes, path: Path | None) -> None:
    """Keep the child's stdout pipe drained (a full pipe would block it) into its log,
    or into our stdout when it has no log file."""
    f = await trio.open_file(path, "ab") if path is not None else _our_stdout()
    async with stream, f:
        if pending:
            await f.write(pending)
        async for data in stream:
            await f.write(data)
            await f.flush()


def _our_stdout() -> AsyncIOWrapper[BinaryIO]:
    """A duplicate of this process's stdout as a trio file (writes run in a thread;
    closing it leaves our own stdout open)."""
    return trio.wrap_file(os.fdopen(os.dup(sys.stdout.fileno()), "ab"))
