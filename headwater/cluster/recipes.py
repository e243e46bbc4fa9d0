"""The programs of a local cluster, one recipe each: etcd, a worker, a frontend.

Each ``start_*`` function spawns one process (:mod:`headwater.cluster.children`),
waits until it announced that it is ready, and returns its :class:`ChildProcess`
(address and pid)::

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
etcd is ready when its JSON gateway answers. Workers and frontends run as
``python -m headwater worker ...`` and ``python -m headwater serve ...``.

Started again (``headwater launch`` restarts a process that died, see
:mod:`headwater.cluster.supervisor`), a process must be the same one to everyone
that knew it: each ``start_*`` function takes what pins its identity, and each
handle says what that was. A worker takes ``worker_id`` and ``port`` (its
``WorkerProcess.worker_id`` and ``port``), a frontend ``port``, etcd ``ports`` and
``data_dir``.
"""

from __future__ import annotations

import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio

from headwater.cluster.children import (
    KILL_TIMEOUT,
    ChildProcess,
    ExitHook,
    LaunchError,
    child_env,
    describe_status,
    read_announcement,
    spawn,
)
from headwater.ports import free_port
from headwater.secret_env import without_secrets
from headwater.wire.addresses import parse_tcp_address
from workers.lifecycle import READY_PREFIX as WORKER_READY_PREFIX

#: Start of the line a frontend prints once it listens (``headwater serve``).
FRONTEND_READY_PREFIX = "headwater: serving "
#: Start of the line a supervisor of frontend processes prints about each one.
FRONTEND_MEMBER_PREFIX = "headwater: process "
DEFAULT_MODEL = "deepseek-v4"
#: Runs a program that cannot watch its supervisor (etcd) under one that does.
GUARD = (sys.executable, "-m", "headwater.cluster.guard")

__all__ = [
    "DEFAULT_MODEL",
    "FRONTEND_MEMBER_PREFIX",
    "FRONTEND_READY_PREFIX",
    "WORKER_READY_PREFIX",
    "ChildProcess",
    "EtcdProcess",
    "FrontendMember",
    "FrontendProcess",
    "LaunchError",
    "WorkerProcess",
    "frontend_announced",
    "frontend_argv",
    "frontend_urls",
    "member_line",
    "parse_member_line",
    "parse_worker_ready",
    "spawn_frontend",
    "start_etcd",
    "start_frontend",
    "start_worker",
    "wait_healthy",
    "worker_argv",
]


class WorkerProcess(ChildProcess):
    """A ``headwater worker`` child; ``address`` is its ``tcp://`` plane address."""

    worker_id: str = ""
    role: str = ""
    #: Port of its own ``/metrics`` (``--metrics-port``); 0: it serves none.
    metrics_port: int = 0

    @property
    def metrics_url(self) -> str:
        """``http://127.0.0.1:PORT`` of its metrics endpoint; "" when it serves none."""
        return f"http://127.0.0.1:{self.metrics_port}" if self.metrics_port else ""

    def static_url(self, model: str = DEFAULT_MODEL) -> str:
        """Its entry for a frontend's ``--workers`` list (the id must match the worker's)."""
        return f"{self.address}?role={self.role}&id={self.worker_id}&model={model}"

    @property
    def port(self) -> int:
        """The request plane's port (what it announced)."""
        return parse_tcp_address(self.address)[1]

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port,)


class EtcdProcess(ChildProcess):
    """An etcd child; ``address`` is its client URL (``http://127.0.0.1:PORT``), and
    ``peer_port`` and ``data_dir`` the rest of what a restart must reuse."""

    peer_port: int = 0
    data_dir: Path | None = None

    @property
    def client_port(self) -> int:
        return _url_port(self.address)

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.client_port, self.peer_port)

    @property
    def discovery(self) -> str:
        """The ``--discovery`` value that points frontends and workers here."""
        return "etcd://" + self.address.removeprefix("http://")


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
    ports: tuple[int, int] | None = None,
    data_dir: Path | None = None,
) -> EtcdProcess:
    """A single-member etcd on loopback, its data in *workdir*; its log is
    ``workdir/<name>.log``.

    Ready once the JSON gateway answers. Without *ports* (client, peer) free ones
    are probed, then bound by etcd; if another process wins that race etcd exits,
    and it is retried on new ports, up to *attempts* times. With *ports* (a restart)
    there is one attempt, on those, with the data in *data_dir* (default:
    ``workdir/<name>-data-0``). Raises LaunchError.
    """
    error: LaunchError | None = None
    for attempt in range(1 if ports else attempts):
        client_port, peer_port = ports or (free_port(), free_port())
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        data = data_dir if ports and data_dir else workdir / f"{name}-data-{attempt}"
        argv = [
            *GUARD,
            binary,  # etcd cannot see its supervisor die: the guard does
            f"--name={name}",
            f"--data-dir={data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={name}={peer}",
            "--logger=zap",
            "--log-level=warn",
        ]
        child = await spawn(
            EtcdProcess,
            nursery,
            name,
            argv,
            workdir / f"{name}.log",
            env=without_secrets(child_env()),
            stdout=False,  # etcd needs none of ours
        )
        child.address, child.peer_port, child.data_dir = client, peer_port, data
        try:
            await _wait_etcd(child, ready_within)
        except LaunchError as exc:
            error = exc
            await child.stop(grace=KILL_TIMEOUT)
            continue
        child.mark_ready(on_exit)
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
                f"{child.name} exited at start-up ({describe_status(child.returncode)})",
                f":\n{child.log_tail()}",
            )
    raise LaunchError(f"{child.name} did not answer within {within:g} s", f":\n{child.log_tail()}")


# ---- workers --------------------------------------------------------------------------


def worker_argv(
    role: str,
    *,
    worker_id: str = "",
    discovery: str = "",
    model: str = DEFAULT_MODEL,
    engine: str = "mocker",
    engine_args: Sequence[str] = (),
    lease_ttl: int | None = None,
    drain_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    listen: str = "127.0.0.1:0",
    python: str = sys.executable,
) -> list[str]:
    """The command line of one worker, by default on a free loopback port (*listen*
    ``127.0.0.1:0``; its id generated unless *worker_id*); *engine_args* are the
    engine's own options (``--speedup-ratio 100``). Off loopback the worker needs a plane
    secret (``HEADWATER_PLANE_SECRET`` in its environment)."""
    argv = [
        python,
        "-m",
        "headwater",
        "worker",
        "--role",
        role,
        "--listen",
        listen,
        "--engine",
        engine,
        "--model-name",
        model,
        *engine_args,
    ]
    if worker_id:
        argv += ["--worker-id", worker_id]
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
    worker_id: str = "",
    discovery: str = "",
    model: str = DEFAULT_MODEL,
    engine: str = "mocker",
    engine_args: Sequence[str] = (),
    lease_ttl: int | None = None,
    drain_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    listen: str = "127.0.0.1:0",
    metrics_port: int = 0,
    prefix_argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_within: float = 30.0,
    on_exit: ExitHook | None = None,
) -> WorkerProcess:
    """Start ``headwater worker`` for *role*; return once it printed its READY line.

    With *discovery* (``etcd://...``) that line comes after it registered in etcd.
    The log is ``log_dir/<name>.log`` (*name* defaults to the role). *worker_id* and
    *listen* pin what a restart must keep (default: generated, any free loopback port).
    *metrics_port* (0: none) is its ``--metrics-port``, on 127.0.0.1.
    *prefix_argv* runs the command under a wrapper that execs it, such as ``ip netns exec
    NAME`` (so the child's pid is still the worker's). Raises LaunchError.
    """
    name = name or role
    argv = worker_argv(
        role,
        worker_id=worker_id,
        discovery=discovery,
        model=model,
        engine=engine,
        engine_args=engine_args,
        lease_ttl=lease_ttl,
        drain_timeout=drain_timeout,
        extra_args=[*(["--metrics-port", str(metrics_port)] if metrics_port else []), *extra_args],
        listen=listen,
    )
    child = await spawn(
        WorkerProcess, nursery, name, [*prefix_argv, *argv], log_dir / f"{name}.log", env=env
    )
    assert isinstance(child, WorkerProcess)
    child.address, child.worker_id, child.role = await read_announcement(
        child, nursery, parse_worker_ready, ready_within
    )
    child.metrics_port = metrics_port
    child.mark_ready(on_exit)
    return child


# ---- frontends -------------------------------------------------------------------------


def frontend_argv(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    discovery: str = "",
    workers: str = "",
    model: str = DEFAULT_MODEL,
    extra_args: Sequence[str] = (),
    interpreter: Sequence[str] = (sys.executable,),
    processes: int | str | None = 1,
) -> list[str]:
    """The command line of one frontend, by default on loopback (``python -m headwater serve``).

    *interpreter* is what runs ``-m frontend``: the benchmark's profiler passes
    ``(python, "-m", "pyinstrument", ...)``. *processes* is its ``--processes``: one by
    default, unlike ``headwater serve``'s own default (one per usable core), because a
    recipe's frontend shares the machine with the workers and etcd it is started
    beside; ``None`` leaves serve's default, and a ``--processes`` in *extra_args* wins.
    """
    argv = [
        *interpreter,
        "-m",
        "headwater",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--model-name",
        model,
    ]
    if processes is not None:
        argv += ["--processes", str(processes)]
    if discovery:
        argv += ["--discovery", discovery]
    if workers:
        argv += ["--workers", workers]
    return [*argv, *extra_args]


def frontend_urls(line: str) -> list[str]:
    """Every http(s) URL of a ``headwater: serving ...`` line; [] for any other line."""
    if not line.startswith(FRONTEND_READY_PREFIX):
        return []
    return [w.rstrip("/") for w in line.split() if w.startswith(("http://", "https://"))]


def member_line(index: int, pid: int, url: str) -> str:
    """What a supervisor of several frontend processes prints about each, before the
    serving line (``headwater serve --processes N``; see headwater.cluster.frontend_group)."""
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
    """A ``headwater serve`` child. ``address`` is where clients go; ``urls`` is
    every URL it announced; ``members`` are the processes that serve, each with a URL
    of its own (with ``--processes N``: the N children; otherwise the one process)."""

    urls: tuple[str, ...] = ()
    members: tuple[FrontendMember, ...] = ()

    @property
    def port(self) -> int:
        """The port clients use (the real one when started with port 0)."""
        return _url_port(self.address)

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port,)


def _url_port(url: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"no port in {url!r}")
    return port


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
    child = await spawn(FrontendProcess, nursery, name, argv, log_path, env=env, pass_fds=pass_fds)
    assert isinstance(child, FrontendProcess)
    return await frontend_announced(child, nursery, ready_within=ready_within, on_exit=on_exit)


async def frontend_announced(
    child: FrontendProcess,
    nursery: trio.Nursery,
    *,
    ready_within: float = 60.0,
    on_exit: ExitHook | None = None,
) -> FrontendProcess:
    """Read a started frontend's stdout until it announced that it listens (and, for a
    supervisor, each of its processes); return it, ready. Raises LaunchError."""
    members: list[FrontendMember] = []

    def parse(line: str) -> list[str] | None:
        if (member := parse_member_line(line)) is not None:
            members.append(member)
        return frontend_urls(line) or None

    urls = await read_announcement(child, nursery, parse, ready_within)
    child.address, child.urls = urls[0], tuple(urls)
    child.members = tuple(members) or (FrontendMember(0, child.pid, urls[-1]),)
    child.mark_ready(on_exit)
    return child


async def start_frontend(
    nursery: trio.Nursery,
    *,
    log_dir: Path,
    name: str = "frontend",
    host: str = "127.0.0.1",
    port: int = 0,
    discovery: str = "",
    workers: str = "",
    model: str = DEFAULT_MODEL,
    extra_args: Sequence[str] = (),
    interpreter: Sequence[str] = (sys.executable,),
    prefix_argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_within: float = 60.0,
    on_exit: ExitHook | None = None,
    processes: int | str | None = 1,
) -> FrontendProcess:
    """Start a frontend; return once it listens (``address`` is its URL, real port).
    *processes* as for :func:`frontend_argv` (one by default).

    It may not be able to serve yet: :func:`wait_healthy` waits for routable
    workers. *prefix_argv* runs it under a wrapper that execs it (``ip netns exec
    NAME``), as for :func:`start_worker`. Raises LaunchError.
    """
    argv = frontend_argv(
        host=host,
        port=port,
        discovery=discovery,
        workers=workers,
        model=model,
        extra_args=extra_args,
        interpreter=interpreter,
        processes=processes,
    )
    return await spawn_frontend(
        nursery,
        [*prefix_argv, *argv],
        name=name,
        log_path=log_dir / f"{name}.log",
        env=env,
        ready_within=ready_within,
        on_exit=on_exit,
    )


async def wait_healthy(
    url: str,
    *,
    within: float = 60.0,
    child: ChildProcess | None = None,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Poll ``url/health`` until it answers 200 (a request can be served now);
    *verify* is httpx's, for an ``https://`` URL.

    Raises LaunchError after *within* seconds, or at once if *child* exits.
    """
    last = "no answer"
    async with httpx.AsyncClient(timeout=2.0, verify=verify) as http:
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
            raise LaunchError(f"{child.name} exited ({describe_status(child.returncode)})")
    raise LaunchError(f"{url}/health not 200 within {within:g} s (last: {last})")
