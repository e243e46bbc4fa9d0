"""The servers a benchmark measures: started on loopback, awaited until ready, always stopped.

Two kinds, each an async context manager that yields a :class:`ServerInfo`:

- :func:`headwater_server`: ``python -m headwater serve`` on a free port
  (``--port 0``; the bound URL is read from its start-up line), its mocker workers
  in-process or as two ``headwater worker`` processes (``python -m headwater worker``, also on
  free ports), optionally under pyinstrument, optionally as several frontend processes
  on one port (``--processes N``: a supervisor that does not serve and N members, each
  also on a private port of its own). Stopped with SIGINT (the frontend shuts down
  gracefully and pyinstrument writes its session), SIGKILL after a deadline.
- :func:`dynamo_server`: NVIDIA Dynamo's frontend + mocker through the peer scripts
  (``scripts/peers/dynamo/``: ``install.sh`` puts Dynamo's wheels from PyPI into a scratch
  directory, ``start_disagg.sh`` / ``stop.sh`` run and stop it). Those scripts bind port
  8000, so the port is checked first and the server is refused rather than started on top
  of something else. Raises
  :class:`DynamoUnavailable` when the scripts or the installation are missing.

Every child runs in its own session, so a Ctrl-C at the terminal reaches only the suite,
which then stops the servers itself (shielded, with a deadline). Only processes started
here are signalled, by PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import trio

from headwater.cluster import recipes as processes
from scripts.bench.scrape import DYNAMO_PREFIX, HEADWATER_PREFIX

READY_TIMEOUT = 120.0  # s for a server to print its URL and report healthy
STOP_TIMEOUT = 20.0  # s after SIGINT before SIGKILL (pyinstrument writes its session then)
DYNAMO_PORT = 8000  # fixed by the peer scripts
DYNAMO_INSTALL_TIMEOUT = 600.0  # s


class ServerError(RuntimeError):
    """A server did not start (its log is named in the message)."""


class DynamoUnavailable(ServerError):
    """The Dynamo peer cannot be run here; the message says why (the suite skips it)."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A running server as the suite sees it.

    ``pids`` holds every process of the server: ``pids[0]`` is the frontend process that
    was started, then (``--processes N``) the frontend members it supervises, then the
    worker processes (Dynamo's mockers). ``frontend_pids`` are the processes that serve
    HTTP and ``member_urls`` one base URL per such process, reaching it alone (its own
    ``/metrics``, ``/debug/stalls``); both default to the single-process meaning,
    ``(pids[0],)`` and ``(base_url,)``. With several members ``pids[0]`` is a supervisor
    that serves nothing but still counts in the frontend's CPU and RSS
    (:attr:`frontend_group`). ``stall_threshold_ms`` is the threshold behind the stall
    counter.
    """

    kind: str  # "headwater" | "dynamo"
    variant: str  # e.g. "fastokens/thread", "default", "fastokens"
    base_url: str
    model: str
    pids: tuple[int, ...]
    metrics_prefix: str
    stall_threshold_ms: float
    log_path: Path
    profile_path: Path | None = None
    args: tuple[str, ...] = field(default=())
    frontend_pids: tuple[int, ...] = field(default=())
    member_urls: tuple[str, ...] = field(default=())
    #: Processes of the frontend that serve nothing beside its supervisor: a group's
    #: zygote (``headwater serve --processes N`` forks its processes from it).
    helper_pids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.frontend_pids:
            object.__setattr__(self, "frontend_pids", self.pids[:1])
        if not self.member_urls:
            object.__setattr__(self, "member_urls", (self.base_url,))
        if len(self.member_urls) != len(self.frontend_pids):
            raise ValueError(
                f"{len(self.member_urls)} member URLs for "
                f"{len(self.frontend_pids)} frontend processes"
            )

    @property
    def label(self) -> str:
        return f"{self.kind} {self.variant}"

    @property
    def metrics_url(self) -> str:
        """The shared port's ``/metrics``: whichever member accepts answers (see
        :attr:`member_metrics_urls` for measuring)."""
        return self.base_url + "/metrics"

    @property
    def member_metrics_urls(self) -> tuple[str, ...]:
        return tuple(url + "/metrics" for url in self.member_urls)

    @property
    def frontend_processes(self) -> int:
        """How many processes serve (1 for a single-process frontend)."""
        return len(self.frontend_pids)

    @property
    def frontend_group(self) -> tuple[int, ...]:
        """The frontend's processes whose CPU and memory it costs: ``pids[0]`` (a
        supervisor when there are members), its helpers (a zygote) and the serving
        processes."""
        return tuple(dict.fromkeys((*self.pids[:1], *self.helper_pids, *self.frontend_pids)))


# --- helpers ------------------------------------------------------------------------


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts connections on *host*:*port* (a quick connect, 0.5 s at most)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET on loopback without proxies; returns (status, body). Raises OSError."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def child_env(
    drop_prefixes: Sequence[str] = ("HEADWATER_",), **extra: str | None
) -> dict[str, str]:
    """This process's environment without *drop_prefixes* variables, plus *extra*.

    ``HEADWATER_*`` variables are dropped so that a server's configuration is exactly its
    command line; an *extra* value of ``None`` removes that variable.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop_prefixes))}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def poll_until(predicate: Callable[[], bool], limit_s: float, every_s: float = 0.2) -> bool:
    """Check *predicate* every *every_s* seconds for up to *limit_s*; return its last value.

    For outside state that sends no event (a process's /proc entry, a port).
    """
    with trio.move_on_after(limit_s):
        while True:
            if predicate():
                return True
            await trio.sleep(every_s)
    return predicate()


# --- headwater ----------------------------------------------------------------------


TOPOLOGIES: tuple[str, ...] = ("inprocess", "processes")


def _serve_args(backend: str, mode: str, speedup_ratio: float, extra: Sequence[str]) -> list[str]:
    return [
        "--speedup-ratio",
        f"{speedup_ratio:g}",
        "--tokenizer-backend",
        backend,
        "--tokenize-mode",
        mode,
        "--log-level",
        "warning",
        *extra,
    ]


def variant_name(backend: str, mode: str, topology: str, frontend_processes: int) -> str:
    """A headwater server's variant label, e.g. ``fastokens/thread ×2 procs``."""
    procs = f" ×{frontend_processes} procs" if frontend_processes > 1 else ""
    workers = " +worker procs" if topology == "processes" else ""
    return f"{backend}/{mode}{procs}{workers}"


def process_layout(
    frontend_pid: int,
    members: Sequence[processes.FrontendMember],
    worker_pids: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """``(pids, frontend_pids, member_urls)`` of a :class:`ServerInfo` (pure).

    *members* is what the frontend announced (:attr:`processes.FrontendProcess.members`):
    for a single process, the process itself, which then appears once in ``pids``.
    """
    ordered = sorted(members, key=lambda m: m.index)
    frontend_pids = tuple(m.pid for m in ordered)
    pids = tuple(dict.fromkeys((frontend_pid, *frontend_pids, *worker_pids)))
    return pids, frontend_pids, tuple(m.url for m in ordered)


def zygotes(supervisor: int, members: Sequence[int]) -> tuple[int, ...]:
    """The processes between *supervisor* and its *members* (a group's zygote: the
    members' parent, the supervisor's child); none when the members are its own children
    or the supervisor is the one process."""
    out = []
    for pid in members:
        parent = _parent(pid)
        if parent not in (None, supervisor, pid) and _parent(parent) == supervisor:
            out.append(parent)
    return tuple(dict.fromkeys(out))


def _parent(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _profiler(profile_path: Path | None) -> tuple[str, ...]:
    """What runs ``-m frontend``: Python, or Python under pyinstrument."""
    if profile_path is None:
        return (sys.executable,)
    return (sys.executable, "-m", "pyinstrument", "-r", "pyisession", "-o", str(profile_path))


@asynccontextmanager
async def headwater_server(
    *,
    backend: str,
    mode: str,
    speedup_ratio: float,
    log_dir: Path,
    topology: str = "inprocess",
    extra_args: Sequence[str] = (),
    profile_path: Path | None = None,
    stall_threshold_ms: float = 20.0,
    frontend_processes: int = 1,
) -> AsyncIterator[ServerInfo]:
    """Run one headwater frontend and its mocker workers for the block.

    *topology* ``"inprocess"`` is ``headwater serve``'s default (a prefill + decode pair
    inside the frontend process); ``"processes"`` runs them as two ``headwater worker``
    processes on the TCP request plane, Dynamo's layout. *frontend_processes* > 1 adds
    ``--processes N``: N frontend members on one port under a supervisor, each with its
    own in-process workers (or its own connections to the worker processes); the
    :class:`ServerInfo` then names the members (``frontend_pids``, ``member_urls``). The
    processes are started and supervised by :mod:`headwater.cluster.recipes`, as ``headwater
    launch`` does. Raises :class:`ServerError` if anything does not come up within
    :data:`READY_TIMEOUT` (every member must report healthy), ValueError for an unknown
    *topology*, a count below 1, or a profile of several processes (pyinstrument would
    watch only the supervisor). On exit (normal, error or cancellation) the frontend gets
    SIGINT (pyinstrument writes its session then; a supervisor stops its members), then
    the workers; SIGKILL after :data:`STOP_TIMEOUT`.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if frontend_processes < 1:
        raise ValueError(f"frontend_processes must be at least 1, got {frontend_processes}")
    if frontend_processes > 1 and profile_path is not None:
        raise ValueError("a profile covers one process: use frontend_processes=1")
    procs = ["--processes", str(frontend_processes)] if frontend_processes > 1 else []
    tag = (
        f"headwater-{backend}-{mode}"
        + (f"-x{frontend_processes}" if procs else "")
        + ("-profile" if profile_path else "")
    )
    env = child_env()
    children: list[processes.ChildProcess] = []
    # An exception leaves the nursery as itself, raised after it: raised inside, trio
    # would wrap it in an ExceptionGroup and `except ServerError` would miss it.
    error: Exception | None = None
    async with trio.open_nursery() as nursery:
        try:
            workers: list[processes.WorkerProcess] = []
            for role in ("prefill", "decode") if topology == "processes" else ():
                worker = await processes.start_worker(
                    nursery,
                    role,
                    log_dir=log_dir,
                    name=f"{tag}-{role}",
                    engine_args=["--speedup-ratio", f"{speedup_ratio:g}"],
                    extra_args=["--log-level", "warning"],
                    env=env,
                    ready_within=READY_TIMEOUT,
                )
                children.append(worker)
                workers.append(worker)
            frontend = await processes.start_frontend(
                nursery,
                log_dir=log_dir,
                name=tag,
                workers=",".join(w.static_url() for w in workers),
                extra_args=_serve_args(backend, mode, speedup_ratio, [*procs, *extra_args]),
                interpreter=_profiler(profile_path),
                env=env,
                ready_within=READY_TIMEOUT,
            )
            children.insert(0, frontend)  # stopped first
            for url in dict.fromkeys((frontend.address, *(m.url for m in frontend.members))):
                await processes.wait_healthy(url, within=READY_TIMEOUT, child=frontend)
            if len(frontend.members) != frontend_processes:
                raise ServerError(
                    f"{tag}: {len(frontend.members)} frontend processes "
                    f"announced, {frontend_processes} asked for; see {log_dir}"
                )
            pids, frontend_pids, member_urls = process_layout(
                frontend.pid, frontend.members, [w.pid for w in workers]
            )
            helpers = zygotes(frontend.pid, frontend_pids)
            pids = (pids[0], *helpers, *pids[1:])
            try:
                yield ServerInfo(
                    kind="headwater",
                    variant=variant_name(backend, mode, topology, frontend_processes),
                    base_url=frontend.address,
                    model=processes.DEFAULT_MODEL,
                    pids=pids,
                    metrics_prefix=HEADWATER_PREFIX,
                    stall_threshold_ms=stall_threshold_ms,
                    log_path=frontend.log_path or log_dir / f"{tag}.log",
                    profile_path=profile_path,
                    args=frontend.argv,
                    frontend_pids=frontend_pids,
                    member_urls=member_urls,
                    helper_pids=helpers,
                )
            finally:
                with trio.move_on_after(STOP_TIMEOUT + 10, shield=True):
                    for child in children:
                        await child.stop(STOP_TIMEOUT, sig=signal.SIGINT)
        except processes.LaunchError as exc:
            error = ServerError(f"{tag}: {exc}; see {log_dir}")
            error.__cause__ = exc
        except Exception as exc:  # carried out of the nursery (see above)
            error = exc
        finally:
            nursery.cancel_scope.cancel()  # the children's watchers kill what still runs
    if error is not None:
        raise error


# --- Dynamo -------------------------------------------------------------------------

_DYNAMO_SCRIPTS = ("install.sh", "start_disagg.sh", "stop.sh", "env.sh")
_DYNAMO_PID_FILES = ("frontend.pid", "prefill.pid", "decode.pid")


def default_dynamo_install_dir() -> Path:
    """Where the peer scripts install Dynamo: ``$DYN_DIR`` or ``${TMPDIR:-/tmp}/dynamo-peer``."""
    if os.environ.get("DYN_DIR"):
        return Path(os.environ["DYN_DIR"])
    return Path(os.environ.get("TMPDIR") or "/tmp") / "dynamo-peer"


def check_dynamo_scripts(scripts_dir: Path) -> None:
    """Raise :class:`DynamoUnavailable` unless every peer script is in *scripts_dir*."""
    missing = [s for s in _DYNAMO_SCRIPTS if not (scripts_dir / s).is_file()]
    if missing:
        raise DynamoUnavailable(f"no Dynamo peer scripts in {scripts_dir} (missing {missing})")


def dynamo_installed(install_dir: Path) -> bool:
    """The install dir has a venv in which ``dynamo.frontend`` and ``dynamo.mocker`` import."""
    python = install_dir / "venv" / "bin" / "python"
    if not python.is_file() or not (install_dir / "model" / "tokenizer.json").is_file():
        return False
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sys; sys.exit(0 if "
            "u.find_spec('dynamo.frontend') and u.find_spec('dynamo.mocker') else 1)",
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    return probe.returncode == 0


async def ensure_dynamo(scripts_dir: Path, install_dir: Path, log_dir: Path) -> str:
    """Install Dynamo with the peer's ``install.sh`` if needed; return its version.

    Raises :class:`DynamoUnavailable` when the scripts are missing or installing fails.
    """
    check_dynamo_scripts(scripts_dir)
    if not await trio.to_thread.run_sync(dynamo_installed, install_dir):
        await trio.Path(log_dir).mkdir(parents=True, exist_ok=True)
        log = log_dir / "dynamo-install.log"
        print(f"installing Dynamo into {install_dir} (about a minute); log: {log}", file=sys.stderr)
        with open(log, "wb") as f:  # noqa: ASYNC230 - a new log file
            try:
                with trio.fail_after(DYNAMO_INSTALL_TIMEOUT):
                    done = await trio.run_process(
                        ["bash", str(scripts_dir / "install.sh")],
                        stdout=f,
                        stderr=f,
                        env=child_env(DYN_DIR=str(install_dir)),
                        check=False,
                        start_new_session=True,
                    )
            except trio.TooSlowError as exc:
                raise DynamoUnavailable(f"Dynamo install timed out; see {log}") from exc
        if done.returncode != 0 or not dynamo_installed(install_dir):
            raise DynamoUnavailable(f"Dynamo install failed (status {done.returncode}); see {log}")
    return dynamo_version(install_dir)


def dynamo_version(install_dir: Path) -> str:
    """``ai-dynamo``'s version in the install dir's venv, or ``"unknown"``."""
    python = install_dir / "venv" / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('ai-dynamo'))"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    return probe.stdout.decode().strip() or "unknown"


def _read_pids(install_dir: Path) -> list[int]:
    pids = []
    for name in _DYNAMO_PID_FILES:
        try:
            pids.append(int((install_dir / name).read_text().strip()))
        except (OSError, ValueError):
            continue
    return pids


@asynccontextmanager
async def dynamo_server(
    *,
    scripts_dir: Path,
    install_dir: Path,
    tokenizer: str,
    speedup_ratio: float,
    log_dir: Path,
) -> AsyncIterator[ServerInfo]:
    """Run Dynamo's frontend + prefill + decode mockers (disaggregated) for the block.

    *tokenizer* is ``"default"`` (HF tokenizers) or ``"fastokens"`` (``DYN_TOKENIZER``).
    Raises :class:`DynamoUnavailable` if port 8000 is taken, and :class:`ServerError`
    if the servers do not come up. On exit the peer's ``stop.sh`` stops the recorded PIDs;
    any still alive after 10 s get SIGKILL.
    """
    if port_in_use(DYNAMO_PORT):
        raise DynamoUnavailable(
            f"port {DYNAMO_PORT} (fixed by the Dynamo peer scripts) is already in use"
        )
    await trio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"dynamo-{tokenizer}-start.log"
    env = child_env(
        DYN_DIR=str(install_dir),
        DYN_TOKENIZER="fastokens" if tokenizer == "fastokens" else None,
    )
    cmd = ["bash", str(scripts_dir / "start_disagg.sh"), "--speedup-ratio", f"{speedup_ratio:g}"]
    pids: list[int] = []
    try:
        with open(log_path, "wb") as f:  # noqa: ASYNC230 - a new log file
            with trio.move_on_after(READY_TIMEOUT):
                done = await trio.run_process(
                    cmd,
                    stdout=f,
                    stderr=f,
                    env=env,
                    check=False,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
        pids = _read_pids(install_dir)
        if done.returncode != 0 or len(pids) != len(_DYNAMO_PID_FILES):
            raise ServerError(f"Dynamo did not start; see {log_path} and {install_dir}/logs")
        base = f"http://127.0.0.1:{DYNAMO_PORT}"
        status, body = await trio.to_thread.run_sync(http_get, base + "/v1/models")
        models = [m["id"] for m in orjson.loads(body).get("data", [])] if status == 200 else []
        if not models:
            raise ServerError(f"Dynamo lists no model at {base}/v1/models; see {log_path}")
        yield ServerInfo(
            kind="dynamo",
            variant=tokenizer,
            base_url=base,
            model=models[0],
            pids=tuple(pids),
            metrics_prefix=DYNAMO_PREFIX,
            stall_threshold_ms=5.0,  # Dynamo's canary counts overshoots above 5 ms
            log_path=install_dir / "logs" / "frontend.log",
            args=tuple(cmd),
        )
    finally:
        with trio.move_on_after(30, shield=True):
            await _stop_dynamo(scripts_dir, install_dir, pids or _read_pids(install_dir))


async def _stop_dynamo(scripts_dir: Path, install_dir: Path, pids: Sequence[int]) -> None:
    env = child_env(DYN_DIR=str(install_dir))
    await trio.run_process(
        ["bash", str(scripts_dir / "stop.sh")],
        env=env,
        check=False,
        capture_stdout=True,
        capture_stderr=True,
        stdin=subprocess.DEVNULL,
    )
    await poll_until(lambda: not any(_alive(p) for p in pids), 10)
    for pid in pids:
        if _alive(pid) and _is_dynamo(pid):
            os.kill(pid, signal.SIGKILL)
    await poll_until(lambda: not port_in_use(DYNAMO_PORT), 10)


def _is_dynamo(pid: int) -> bool:
    """Guard against a recycled PID: the process must be one of Dynamo's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dynamo." in f.read()
    except OSError:
        return False
