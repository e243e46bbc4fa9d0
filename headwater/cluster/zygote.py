"""A zygote: one preloaded process that forks the frontend processes of a group.

Why: each frontend process holds the same read-only state, above all the tokenizer
(HF's and fastokens' tables, ~165 MB of the ~220 MB a loaded process has before it
serves), and the same imported modules. Started as separate programs, N processes
hold N copies. Forked from one process that loaded them, they share those pages
copy-on-write, and a process's memory grows only by what it writes: its own heap, its
loop, its in-process workers, the tokenizer's first-use caches.

How: the supervisor (``headwater serve --processes N``) loads the tokenizer and imports
the frontend *before* it starts trio, while it has a single thread, then forks this
zygote (:func:`start_zygote`) and only then runs trio. The zygote never runs trio and
starts no thread; it waits on a Unix socket for the supervisor's requests and forks one
frontend process per request, restarts included, always from the same pristine state::

    headwater serve             the supervisor: trio, restarts, the group's /metrics
    └─ zygote                   a blocking loop: fork on request, reap, report exits
       ├─ frontend process 0    trio.run(serve_until_signalled, ...), forked
       └─ frontend process 1

The traps, and how each is avoided:

* **Threads do not survive a fork** (a thread pool's threads are gone in the child,
  locks they held stay held). :func:`start_zygote` refuses to fork when the process has
  more than one thread (the caller then starts children the old way, as programs),
  and the tokenizer is loaded but never used before the fork: the first encode starts
  fastokens' helper thread (and a batch encode HF's rayon pool), so each child warms
  its tokenizer up itself (``Frontend.run`` does, before it listens).
* **trio must not run in the process that forks**: a forked child of a running trio
  loop inherits the loop's state and cannot ``trio.run`` again. The zygote is forked
  before the supervisor's ``trio.run``, and forks from a plain ``select`` loop.
* **Copy-on-write is undone by writes**: CPython's cyclic GC writes to every tracked
  object it visits. The objects loaded before the fork are moved out of its reach
  with ``gc.freeze()``; the GC stays off in the zygote and on in the children.
* **Signals and orphans**: the zygote has a session of its own (a Ctrl-C at the
  terminal reaches the supervisor only, as with children started as programs). A
  frontend process's parent is the zygote, named in its environment before the fork;
  it polls ``getppid()`` as every child does (:mod:`headwater.orphans`). If the
  supervisor dies, the zygote sees its socket close, sends SIGTERM to every frontend
  process (each drains) and exits once they have; if the zygote dies, its processes
  are orphaned and stop on their own, and the supervisor starts later restarts as
  programs.
* **Exit statuses**: only the zygote can reap its children; it reports each exit
  (``exited <pid> <status>``, the status as :attr:`trio.Process.returncode` has it).
  The supervisor signals a child through a pidfd, so a recycled pid is never hit.

The protocol, one datagram per message on a ``SOCK_SEQPACKET`` pair: the supervisor
sends ``fork <slot>`` with the write end of the new process's stdout pipe attached
(``SCM_RIGHTS``); the zygote answers ``forked <slot> <pid>`` (or ``failed <slot>
<reason>``) and later ``exited <pid> <status>``. Closing the socket ends the zygote.
"""

from __future__ import annotations

import array
import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import trio

from headwater.orphans import supervisor_env
from headwater.sessions import keep_niceness

log = logging.getLogger(__name__)

#: Runs in a freshly forked frontend process (its stdout already redirected); gets the
#: slot it was forked for and returns the process's exit status.
ChildMain = Callable[[int], int]

_MAX_MESSAGE = 512
_EXIT_UNKNOWN = 255  # a process whose parent, the zygote, died before reporting its exit


def threads() -> int:
    """Threads of this process (from ``/proc``; 1 where that cannot be read)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class ZygoteError(Exception):
    """The zygote cannot fork a process: it is gone, or its fork failed."""


# ---- the supervisor's side ---------------------------------------------------------------


def start_zygote(child_main: ChildMain, *, close_fds: tuple[int, ...] = ()) -> Zygote:
    """Fork the zygote from this process, which must be single-threaded and not run
    trio. *close_fds* are closed in the zygote (descriptors only the supervisor uses).

    Raises ZygoteError if this process has more than one thread (forking it would
    leave the other threads' locks held in the copy), OSError if the fork fails.
    """
    if (n := threads()) != 1:
        raise ZygoteError(f"this process has {n} threads: forking it is not safe")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the zygote would write our buffered output a second time
    gc.freeze()  # before the fork: the children's collections leave these pages alone
    pid = os.fork()
    if pid == 0:  # the zygote
        status = 1
        try:
            ours.close()
            for fd in close_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            status = _zygote_main(theirs, child_main)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    theirs.close()
    return Zygote(pid, ours)


class ForkedProcess:
    """A frontend process forked by the zygote, as a :class:`ChildProcess` needs it
    (the subset of :class:`trio.Process` it uses). Signals go through a pidfd."""

    def __init__(self, pid: int, stdout: trio.lowlevel.FdStream) -> None:
        self.pid = pid
        self.stdout: trio.abc.ReceiveStream | None = stdout
        self.returncode: int | None = None
        self._exited = trio.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already gone (its exit report follows), or no pidfd here
            self._pidfd = None

    def __repr__(self) -> str:
        return f"<ForkedProcess {self.pid} returncode={self.returncode}>"

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass  # exited; the zygote's report is on its way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def wait_pidfd(self) -> None:
        """Return once the process has exited (whoever reaps it)."""
        if self._pidfd is not None:
            await trio.lowlevel.wait_readable(self._pidfd)

    def exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self._exited.set()


@dataclass(slots=True)
class _Pending:
    """A fork request waiting for its answer."""

    read_end: int  # the new process's stdout, our end
    answered: trio.Event = field(default_factory=trio.Event)
    child: ForkedProcess | None = None
    failure: str = "the zygote is gone"


class Zygote:
    """The supervisor's handle on its zygote: :meth:`run` reads the zygote's reports
    (start it in the supervisor's nursery), :meth:`fork` asks for a process,
    :meth:`aclose` ends it. ``alive`` turns False once its socket has closed."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._stdlib_sock = sock
        self._sock: trio.socket.SocketType | None = None
        self.alive = True
        self._children: dict[int, ForkedProcess] = {}
        self._pending: dict[int, _Pending] = {}  # by slot
        self._lock = trio.Lock()  # one fork request at a time

    def __repr__(self) -> str:
        return f"<Zygote pid={self.pid} alive={self.alive}>"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read the zygote's messages until its socket closes; then mark it gone, reap
        it, and settle the processes whose exit it can no longer report."""
        self._sock = trio.socket.from_stdlib_socket(self._stdlib_sock)
        task_status.started()
        try:
            async with trio.open_nursery() as orphans:
                while True:
                    try:
                        data = await self._sock.recv(_MAX_MESSAGE)
                    except OSError:
                        data = b""
                    if not data:
                        break
                    self._dispatch(data.decode(errors="replace").split())
                self.alive = False
                self._gone_now(orphans)
        finally:
            self.alive = False
            self._sock.close()
            for pending in self._pending.values():
                pending.answered.set()
            with trio.move_on_after(5, shield=True):
                await reap(self.pid)

    def _dispatch(self, words: list[str]) -> None:
        try:
            if len(words) == 3 and words[0] == "exited":
                child = self._children.pop(int(words[1]), None)
                if child is not None:
                    child.exited(int(words[2]))
                return
            if len(words) >= 2 and words[0] in ("forked", "failed"):
                pending = self._pending.get(int(words[1]))
                if pending is None:
                    return
                if words[0] == "forked" and len(words) == 3:
                    # Registered here, before the next message: its exit report may follow.
                    child = ForkedProcess(int(words[2]), trio.lowlevel.FdStream(pending.read_end))
                    self._children[child.pid] = pending.child = child
                else:
                    pending.failure = " ".join(words[2:]) or "the fork failed"
                pending.answered.set()
                return
        except ValueError:
            pass
        log.warning("zygote: unexpected message %r", " ".join(words))

    def _gone_now(self, nursery: trio.Nursery) -> None:
        if self._children:
            log.error(
                "the zygote (pid %d) is gone; its %d frontend processes stop on their own",
                self.pid,
                len(self._children),
            )

        async def settle(child: ForkedProcess) -> None:
            await child.wait_pidfd()
            child.exited(_EXIT_UNKNOWN)

        for child in self._children.values():
            nursery.start_soon(settle, child)
        self._children.clear()

    async def fork(self, slot: int) -> ForkedProcess:
        """A new frontend process for *slot*, forked by the zygote; its stdout is the
        returned process's ``stdout``. Raises ZygoteError."""
        async with self._lock:
            if not self.alive or self._sock is None:
                raise ZygoteError("the zygote is gone")
            read_end, write_end = os.pipe()
            pending = self._pending[slot] = _Pending(read_end)
            try:
                fds = array.array("i", [write_end])
                try:
                    await self._sock.sendmsg(
                        [f"fork {slot}".encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                    )
                except OSError as exc:
                    raise ZygoteError(f"cannot reach the zygote: {exc}") from exc
                finally:
                    os.close(write_end)  # the zygote has its copy: EOF is the child's exit
                await pending.answered.wait()
            finally:
                del self._pending[slot]
                if pending.child is None:
                    os.close(read_end)
        if pending.child is None:
            raise ZygoteError(pending.failure)
        return pending.child

    async def aclose(self) -> None:
        """End the zygote: it exits once its processes have (stop them first)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        else:  # run() never started
            self._stdlib_sock.close()
            with trio.move_on_after(5, shield=True):
                await reap(self.pid)


async def reap(pid: int) -> None:
    """Wait for our child *pid* to exit, and reap it (cancellable)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = None  # reaped already
    if pidfd is not None:
        try:
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - it has exited: WNOHANG returns at once


# ---- the zygote's side ---------------------------------------------------------------------


def _zygote_main(sock: socket.socket, child_main: ChildMain) -> int:
    """The zygote: serve fork requests on *sock* until it closes and every process it
    forked has exited. Returns its exit status."""
    os.setsid()  # a Ctrl-C at the terminal is the supervisor's alone
    keep_niceness(os.getpid())  # a new session: its scheduling group starts at nice 0
    gc.disable()  # it allocates next to nothing; collections would only dirty pages
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the supervisor's stdout is not ours to hold open
    os.close(devnull)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # wakes select()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stops come from the supervisor
    os.environ.update(supervisor_env())  # the processes it forks watch the zygote
    children: dict[int, int] = {}  # pid → slot
    open_ = True

    def send(text: str) -> None:
        if open_:
            with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
                sock.send(text.encode())

    while open_ or children:
        watched: list[int] = [sock.fileno(), wake_r] if open_ else [wake_r]
        readable, _, _ = select.select(watched, [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        for pid, status in _reaped():
            if children.pop(pid, None) is not None:
                send(f"exited {pid} {status}")
        if sock.fileno() not in readable:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        if not data:  # the supervisor closed it, or died: stop what is left
            open_ = False
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            continue
        words = data.decode(errors="replace").split()
        if len(words) != 2 or words[0] != "fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            send(f"failed {words[1] if len(words) > 1 else -1} bad request")
            continue
        slot, stdout = int(words[1]), fds[0]
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        gc.freeze()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(stdout)
            send(f"failed {slot} fork: {exc}")
            continue
        if pid == 0:
            _child(slot, stdout, child_main, (sock.fileno(), wake_r, wake_w))
        os.close(stdout)
        children[pid] = slot
        send(f"forked {slot} {pid}")
    return 0


def _reaped() -> list[tuple[int, int]]:
    """(pid, status as trio's returncode) of every child that has exited."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        out.append((pid, os.waitstatus_to_exitcode(status)))
    return out


def _child(slot: int, stdout: int, child_main: ChildMain, zygote_fds: tuple[int, ...]) -> NoReturn:
    """In a newly forked frontend process: drop the zygote's descriptors and signal
    set-up, take *stdout*, run *child_main*, and exit; never return to the loop."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in zygote_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.dup2(stdout, 1)
        os.close(stdout)
        gc.enable()
        status = child_main(slot)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        logging.shutdown()
        os._exit(status)
