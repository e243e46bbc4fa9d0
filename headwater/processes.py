"""Child processes of a local cluster: etcd, workers and frontends, started and watched.

The building blocks of ``headwater launch`` (:mod:`headwater.launch`), reusable by
tests and benchmarks. Each ``start_*`` function spawns one process, waits until it
announced that it is ready, and returns a :class:`ChildProcess` (its address and pid)::

    async with trio.open_nursery() as nursery:
        etcd = await start_etcd(nursery, binary="etcd", workdir=tmp)
        worker = await start_worker(nursery, "decode", log_dir=tmp, discovery=etcd.discovery)
        frontend = await start_frontend(nursery, log_dir=tmp, discovery=etcd.discovery)
        await wait_healthy(frontend.address)
        ...
        await frontend.stop()          # SIGTERM, then SIGKILL after the timeout

How each one announces itself: a worker prints ``HEADWATER_WORKER_READY <address>
<worker_id> <role>`` (after registering in etcd, with ``--discovery``), a frontend
prints ``headwater: serving <model> on <url>`` once listening (so ``--port 0`` works),
etcd is ready when its JSON gateway answers.

Ownership: every child has a watcher task in the *nursery* passed to ``start_*``. It
notices the exit (``child.exited``), calls *on_exit* if the child was ready and
nobody asked it to stop (a crash, or a ``kill -9`` from outside; an exit before it
was ready is the ``start_*`` call's LaunchError instead), and, if the nursery is
cancelled while the child still runs, kills it (SIGKILL) and reaps it, so no
process outlives its owner's nursery. Orderly shutdown is :meth:`ChildProcess.stop`.

Children start in their own session (``start_new_session``): a Ctrl-C in the
terminal reaches the launcher only, which then stops them in order. stdout is read
for the announcement and then copied to the child's log file, as is stderr.
Everything binds 127.0.0.1. Nothing here imports ``frontend`` or ``workers``: the
children are separate programs (``python -m frontend``, ``python -m workers``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import httpx
import trio

if TYPE_CHECKING:
    from trio._file_io import AsyncIOWrapper

log = logging.getLogger(__name__)

#: First word of the line a worker prints once it accepts connections (workers.cli).
WORKER_READY_PREFIX = "HEADWATER_WORKER_READY"
#: Start of the line a frontend prints once it listens (frontend.cli).
FRONTEND_READY_PREFIX = "headwater: serving "
#: Start of the line a supervisor of frontend processes prints about each one.
FRONTEND_MEMBER_PREFIX = "headwater: process "
#: Launcher settings the children must not inherit from the environment: they are
#: given explicitly (and ``--workers`` with ``--discovery`` is an error).
SCRUBBED_ENV = ("HEADWATER_WORKERS", "HEADWATER_DISCOVERY", "HEADWATER_WORKER_ID")
DEFAULT_MODEL = "deepseek-v4"

_KILL_TIMEOUT = 5.0  # s to reap a process after SIGKILL
_LOG_TAIL = 3000  # characters of a log quoted in an error

T = TypeVar("T")
#: Called with a child that exited although nobody asked it to stop.
ExitHook = Callable[["ChildProcess"], None]


class LaunchError(Exception):
    """A child process did not start: it exited or stayed silent before it was ready."""


class ChildProcess:
    """One running child; made by the ``start_*`` functions.

    ``address`` is what it announced: etcd's client URL, a worker's ``tcp://`` plane
    address or a frontend's ``http://`` URL. ``exited`` is set once it has exited and
    been reaped.
    """

    def __init__(
        self, name: str, process: trio.Process, log_path: Path | None, argv: Sequence[str]
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

    def _mark_ready(self, on_exit: ExitHook | None) -> None:
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
                with trio.move_on_after(_KILL_TIMEOUT, shield=True):
                    self.process.kill()
                    await self.process.wait()
            self.exited.set()
        if self.ready and not self.stopping:
            self._report_exit()

    def _report_exit(self) -> None:
        log.warning("%s (pid %d) exited unexpectedly with status %s",
                    self.name, self.pid, self.process.returncode)  # fmt: skip
        if self.on_exit is not None:
            try:
                self.on_exit(self)
            except Exception:  # a supervisor's bug must not take its siblings down
                log.exception("on_exit hook for %s failed", self.name)


class WorkerProcess(ChildProcess):
    """A ``python -m workers`` child; ``address`` is its ``tcp://`` plane address."""

    worker_id: str = ""
    role: str = ""

    def static_url(self, model: str = DEFAULT_MODEL) -> str:
        """Its entry for a frontend's ``--workers`` list (the id must match the worker's)."""
        return f"{self.address}?role={self.role}&id={self.worker_id}&model={model}"


class EtcdProcess(ChildProcess):
    """An etcd child; ``address`` is its client URL (``http://127.0.0.1:PORT``)."""

    @property
    def discovery(self) -> str:
        """The ``--discovery`` value that points frontends and workers here."""
        return "etcd://" + self.address.removeprefix("http://")


# ---- spawning -----------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without :data:`SCRUBBED_ENV`, plus *extra*."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env.update(extra or {})
    return env


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the caller must bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _spawn(
    cls: type[ChildProcess],
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    log_path: Path | None,
    *,
    env: Mapping[str, str] | None,
    stdout: bool = True,
    pass_fds: Sequence[int] = (),
) -> ChildProcess:
    """Start *argv* in its own session. Its stderr goes to *log_path*, or with None to
    ours (a supervisor whose children log to the same terminal); *pass_fds* are
    inherited (a listening socket shared by frontend processes)."""
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
            env=dict(env) if env is not None else child_env(),
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        if log_file is not None:
            log_file.close()  # the child holds its own descriptor
    child = cls(name, process, log_path, argv)
    nursery.start_soon(child._supervise, name=f"supervise {name}")
    log.debug("started %s (pid %d): %s", name, process.pid, " ".join(argv))
    return child


async def _announcement(
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
                        f"{child.name} exited with status {status} before it was ready; "
                        f"log {child.log_path}:\n{child.log_tail()}"
                    )
                buffer += data
            line, buffer = buffer.split(b"\n", 1)
            result = parse(line.decode(errors="replace").strip())
    if result is None:
        child.kill()
        await trio.aclose_forcefully(stdout)
        raise LaunchError(
            f"{child.name} was not ready within {within:g} s; "
            f"log {child.log_path}:\n{child.log_tail()}"
        )
    nursery.start_soon(_copy_to_log, stdout, buffer, child.log_path, name=f"stdout {child.name}")
    return result


async def _copy_to_log(stream: trio.abc.ReceiveStream, pending: bytes, path: Path | None
                       ) -> None:
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


# ---- etcd ---------------------------------------------------------------------------


async def start_etcd(
    nursery: trio.Nursery,
    *,
    binary: str,
    workdir: Path,
    name: str = "etcd",
    ready_within: float = 15.0,
    on_exit: ExitHook | None = None,
    attempts: int = 3,
) -> EtcdProcess:
    """A single-member etcd on free loopback ports, its data in *workdir*.

    Ready once the JSON gateway answers. Ports are probed, then bound by etcd; if
    another process wins that race etcd exits, and it is retried on new ports, up
    to *attempts* times. Raises LaunchError.
    """
    error: LaunchError | None = None
    for attempt in range(attempts):
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        argv = [
            binary,
            f"--name={name}",
            f"--data-dir={workdir / f'{name}-data-{attempt}'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={name}={peer}",
            "--logger=zap",
            "--log-level=warn",
        ]
        child = await _spawn(
            EtcdProcess, nursery, name, argv, workdir / f"{name}.log",
            env=child_env(), stdout=False,
        )  # fmt: skip
        child.address = client
        try:
            await _wait_etcd(child, ready_within)
        except LaunchError as exc:
            error = exc
            await child.stop(grace=_KILL_TIMEOUT)
            continue
        child._mark_ready(on_exit)
        assert isinstance(child, EtcdProcess)
        return child
    assert error is not None
    raise error


async def _wait_etcd(child: ChildProcess, within: float) -> None:
    async with httpx.AsyncClient(timeout=1.0) as http:
        with trio.move_on_after(within):
            while child.returncode is None:
                try:
                    r = await http.post(child.address + "/v3/kv/range", json={"key": "AA=="})
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                with trio.move_on_after(0.05):
                    await child.exited.wait()
            raise LaunchError(
                f"{child.name} exited with status {child.returncode} at start-up:\n"
                f"{child.log_tail()}"
            )
    raise LaunchError(f"{child.name} did not answer within {within:g} s:\n{child.log_tail()}")


# ---- workers --------------------------------------------------------------------------


def worker_argv(
    role: str,
    *,
    discovery: str = "",
    model: str = DEFAULT_MODEL,
    engine: str = "mocker",
    speedup_ratio: float = 1.0,
    lease_ttl: int | None = None,
    drain_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The command line of one worker on a free loopback port."""
    argv = [
        python, "-m", "workers", "--role", role, "--listen", "127.0.0.1:0",
        "--engine", engine, "--model-name", model, "--speedup-ratio", f"{speedup_ratio:g}",
    ]  # fmt: skip
    if discovery:
        argv += ["--discovery", discovery]
    if lease_ttl is not None:
        argv += ["--lease-ttl", str(lease_ttl)]
    if drain_timeout is not None:
        argv += ["--drain-timeout", f"{drain_timeout:g}"]
    return [*argv, *extra_args]


def parse_worker_ready(line: str) -> tuple[str, str, str] | None:
    """``HEADWATER_WORKER_READY <address> <worker_id> <role>`` → the three fields."""
    parts = line.split()
    if len(parts) == 4 and parts[0] == WORKER_READY_PREFIX:
        return parts[1], parts[2], parts[3]
    return None


async def start_worker(
    nursery: trio.Nursery,
    role: str,
    *,
    log_dir: Path,
    name: str = "",
    discovery: str = "",
    model: str = DEFAULT_MODEL,
    engine: str = "mocker",
    speedup_ratio: float = 1.0,
    lease_ttl: int | None = None,
    drain_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_within: float = 30.0,
    on_exit: ExitHook | None = None,
) -> WorkerProcess:
    """Start ``python -m workers`` for *role*; return once it printed its READY line.

    With *discovery* (``etcd://...``) that line comes after it registered in etcd.
    The log is ``log_dir/<name>.log`` (*name* defaults to the role). Raises LaunchError.
    """
    name = name or role
    argv = worker_argv(
        role, discovery=discovery, model=model, engine=engine, speedup_ratio=speedup_ratio,
        lease_ttl=lease_ttl, drain_timeout=drain_timeout, extra_args=extra_args,
    )  # fmt: skip
    child = await _spawn(WorkerProcess, nursery, name, argv, log_dir / f"{name}.log", env=env)
    assert isinstance(child, WorkerProcess)
    child.address, child.worker_id, child.role = await _announcement(
        child, nursery, parse_worker_ready, ready_within
    )
    child._mark_ready(on_exit)
    return child


# ---- frontends -------------------------------------------------------------------------


def frontend_argv(
    *,
    port: int = 0,
    discovery: str = "",
    workers: str = "",
    model: str = DEFAULT_MODEL,
    extra_args: Sequence[str] = (),
    interpreter: Sequence[str] = (sys.executable,),
) -> list[str]:
    """The command line of one frontend on loopback (``python -m frontend`` = serve).

    *interpreter* is what runs ``-m frontend``: the benchmark's profiler passes
    ``(python, "-m", "pyinstrument", ...)``.
    """
    argv = [*interpreter, "-m", "frontend", "--host", "127.0.0.1", "--port", str(port),
            "--model-name", model]  # fmt: skip
    if discovery:
        argv += ["--discovery", discovery]
    if workers:
        argv += ["--workers", workers]
    return [*argv, *extra_args]


def frontend_urls(line: str) -> list[str]:
    """Every http URL of a ``headwater: serving ...`` line; [] for any other line."""
    if not line.startswith(FRONTEND_READY_PREFIX):
        return []
    return [w.rstrip("/") for w in line.split() if w.startswith("http://")]


def member_line(index: int, pid: int, url: str) -> str:
    """What a supervisor of several frontend processes prints about each, before the
    serving line (``headwater serve --processes N``; see frontend.multiprocess)."""
    return f"{FRONTEND_MEMBER_PREFIX}{index} pid {pid} at {url}"


def parse_member_line(line: str) -> FrontendMember | None:
    """``headwater: process <index> pid <pid> at <url>`` → its fields."""
    parts = line.removeprefix(FRONTEND_MEMBER_PREFIX).split()
    if not line.startswith(FRONTEND_MEMBER_PREFIX) or len(parts) != 5:
        return None
    try:
        return FrontendMember(int(parts[0]), int(parts[2]), parts[4].rstrip("/"))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class FrontendMember:
    """One process of a frontend: its index, pid and a URL that reaches it alone."""

    index: int
    pid: int
    url: str


class FrontendProcess(ChildProcess):
    """A ``python -m frontend`` child. ``address`` is where clients go; ``urls`` is
    every URL it announced; ``members`` are the processes that serve, each with a URL
    of its own (with ``--processes N``: the N children; otherwise the one process)."""

    urls: tuple[str, ...] = ()
    members: tuple[FrontendMember, ...] = ()


async def spawn_frontend(
    nursery: trio.Nursery,
    argv: Sequence[str],
    *,
    name: str,
    log_path: Path | None,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    ready_within: float = 60.0,
    on_exit: ExitHook | None = None,
) -> FrontendProcess:
    """Run *argv* (a frontend command line); return once it announced that it listens.

    Raises LaunchError if it exits or stays silent for *ready_within* seconds.
    """
    members: list[FrontendMember] = []

    def parse(line: str) -> list[str] | None:
        if (member := parse_member_line(line)) is not None:
            members.append(member)
        return frontend_urls(line) or None

    child = await _spawn(
        FrontendProcess, nursery, name, argv, log_path, env=env, pass_fds=pass_fds
    )
    assert isinstance(child, FrontendProcess)
    urls = await _announcement(child, nursery, parse, ready_within)
    child.address, child.urls = urls[0], tuple(urls)
    child.members = tuple(members) or (FrontendMember(0, child.pid, urls[-1]),)
    child._mark_ready(on_exit)
    return child


async def start_frontend(
    nursery: trio.Nursery,
    *,
    log_dir: Path,
    name: str = "frontend",
    port: int = 0,
    discovery: str = "",
    workers: str = "",
    model: str = DEFAULT_MODEL,
    extra_args: Sequence[str] = (),
    interpreter: Sequence[str] = (sys.executable,),
    env: Mapping[str, str] | None = None,
    ready_within: float = 60.0,
    on_exit: ExitHook | None = None,
) -> FrontendProcess:
    """Start a frontend; return once it listens (``address`` is its URL, real port).

    It may not be able to serve yet: :func:`wait_healthy` waits for routable
    workers. Raises LaunchError.
    """
    argv = frontend_argv(
        port=port, discovery=discovery, workers=workers, model=model, extra_args=extra_args,
        interpreter=interpreter,
    )  # fmt: skip
    return await spawn_frontend(
        nursery, argv, name=name, log_path=log_dir / f"{name}.log", env=env,
        ready_within=ready_within, on_exit=on_exit,
    )  # fmt: skip


async def wait_healthy(
    url: str, *, within: float = 60.0, child: ChildProcess | None = None
) -> None:
    """Poll ``url/health`` until it answers 200 (a request can be served now).

    Raises LaunchError after *within* seconds, or at once if *child* exits.
    """
    last = "no answer"
    async with httpx.AsyncClient(timeout=2.0) as http:
        with trio.move_on_after(within):
            while child is None or child.returncode is None:
                try:
                    r = await http.get(url + "/health")
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}: {r.text[:300]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                await trio.sleep(0.1)
            raise LaunchError(f"{child.name} exited with status {child.returncode}")
    raise LaunchError(f"{url}/health not 200 within {within:g} s (last: {last})")
