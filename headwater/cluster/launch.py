"""The local cluster supervisor behind ``headwater launch``: etcd, workers, a frontend.

:func:`run_cluster` starts, on free loopback ports and in a working directory, etcd
(with discovery ``etcd``), the workers (``headwater worker``, registering in that etcd;
with discovery ``static`` they start first and the frontend gets their addresses as
``--workers``), then the frontend (``headwater serve``). It prints the URL once
``/health`` answers 200, then a line ``HEADWATER_CLUSTER_READY <url>``. Everything
binds 127.0.0.1. The command line is :mod:`headwater.cli.launch`.

A process that exits on its own once the cluster is up (a crash, a ``kill -9``) is
restarted, while the rest keeps serving, per ``plan.restart``
(:mod:`headwater.cluster.supervisor`: exponential backoff with jitter, a budget of
restarts per window): a worker with its id and port, so static ``--workers`` lists
and etcd keys still name it; the frontend with its port; etcd with its ports and
data. A process that cannot start at launch fails the launch instead.

The plane between the frontend and the workers is authenticated: the cluster's secret
is ``$HEADWATER_PLANE_SECRET`` when set, else one made for this run
(:func:`~headwater.wire.handshake.generate_secret`), held in memory and given to the
workers and the frontend in their environment, never on a command line or in a file.
API keys given after ``--`` go to the frontend the same way.

Ctrl-C or SIGTERM stops the frontend first (its in-flight requests finish), then the
workers (SIGTERM: they drain), then etcd; a second signal kills whatever is left.
A process that exhausts its restart budget stops the cluster the same way, after
saying which one and why, and the exit status is 1. Logs (one file per process,
every incarnation appended to it) are in the run directory, which is removed after
a clean stop unless ``--workdir`` was given.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from headwater.cli.secret_args import api_keys_to_env
from headwater.cluster.children import ChildProcess, LaunchError, child_env
from headwater.cluster.recipes import (
    DEFAULT_MODEL,
    EtcdProcess,
    FrontendProcess,
    WorkerProcess,
    start_etcd,
    start_frontend,
    start_worker,
    wait_healthy,
)
from headwater.cluster.supervisor import RestartPolicy, Starter, Supervised
from headwater.config_fields import DRAIN_TIMEOUT
from headwater.ports import free_port
from headwater.wire.handshake import SECRET_ENV, generate_secret

log = logging.getLogger("headwater.launch")  # the name users see in its log lines

CLUSTER_READY_PREFIX = "HEADWATER_CLUSTER_READY"
ETCD_BIN_ENV = "HEADWATER_ETCD_BIN"  # also read by the tests' etcd fixture
#: s after SIGTERM, beyond the frontend's drain, before SIGKILL (serve's --graceful-timeout
#: 10 s for what is left after the drain, plus a margin for its own shutdown).
_FRONTEND_GRACE = 15.0
_ETCD_GRACE = 5.0  # s

C = TypeVar("C", bound=ChildProcess)


@dataclass(frozen=True, slots=True)
class ModelWorkers:
    """Workers of another model beside the plan's own (``launch --extra-model``): the
    frontend serves it from their registration on (frontend/catalog.py)."""

    model: str
    engine: str
    #: The engine's options for these workers (``--script answers.jsonl``).
    engine_args: tuple[str, ...] = ()
    roles: tuple[str, ...] = ("agg",)


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """What to start; built from the command line by :func:`plan_from_args`."""

    prefill: int = 1
    decode: int = 1
    agg: int = 0
    engine: str = "mocker"
    #: The engine's options for every worker (``--speedup-ratio 100``).
    engine_args: tuple[str, ...] = ()
    #: "etcd" (start one), "static" (no etcd: --workers), or an etcd:// URL to use.
    discovery: str = "etcd"
    etcd_binary: str = ""
    port: int = 8000
    model: str = DEFAULT_MODEL
    lease_ttl: int = 10  # s
    drain_timeout: float = DRAIN_TIMEOUT  # s each worker, and the frontend, get to finish
    worker_args: tuple[str, ...] = ()
    #: Each worker serves its own ``/metrics`` on a free loopback port (kept across
    #: restarts), listed when the cluster is up.
    worker_metrics: bool = False
    serve_args: tuple[str, ...] = ()
    workdir: Path | None = None  # None: a temporary directory, removed after a clean stop
    start_within: float = 60.0  # s for each process to come up, and for /health
    #: When a process that exited on its own is restarted, and when it is given up.
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    #: Workers of other models, after the plan's own.
    extra_models: tuple[ModelWorkers, ...] = ()
    roles: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        roles = ("prefill",) * self.prefill + ("decode",) * self.decode + ("agg",) * self.agg
        object.__setattr__(self, "roles", roles)


def find_etcd(explicit: str = "") -> str | None:
    """The etcd binary: *explicit*, else ``$HEADWATER_ETCD_BIN``, else ``etcd`` on PATH."""
    candidate = explicit or os.environ.get(ETCD_BIN_ENV, "")
    if candidate:
        found = shutil.which(candidate)
        return found if found and os.access(found, os.X_OK) else None
    return shutil.which("etcd")


# ---- the cluster -------------------------------------------------------------------------


class Cluster:
    """The processes of one local cluster, started and stopped in dependency order.

    Each one is a :class:`~headwater.cluster.supervisor.Supervised` process in the
    nursery given to :meth:`start`, restarted per ``plan.restart`` when it exits on its
    own: a worker with its id and port, the frontend with its port, etcd with its
    ports and data. One that is given up sets ``failure`` and cancels *run_scope*, so
    the launcher stops the rest.
    """

    def __init__(self, plan: ClusterPlan, workdir: Path, run_scope: trio.CancelScope) -> None:
        self.plan = plan
        self.workdir = workdir
        self.etcd: Supervised[EtcdProcess] | None = None
        self.workers: list[Supervised[WorkerProcess]] = []
        self.frontend: Supervised[FrontendProcess] | None = None
        self.failure: str | None = None
        self._run_scope = run_scope
        #: The workers' and the frontend's environment: the plane secret (the caller's
        #: $HEADWATER_PLANE_SECRET, else one made for this run) is given there.
        self.env = child_env({SECRET_ENV: os.environ.get(SECRET_ENV) or generate_secret()})
        #: The frontend's options, its API keys moved to its environment.
        #: The model of each worker not of the plan's own, by process name.
        self._models: dict[str, str] = {}
        self.frontend_env = dict(self.env)
        self.serve_args = api_keys_to_env(plan.serve_args, self.frontend_env)

    @property
    def discovery_url(self) -> str:
        if self.etcd is not None and self.etcd.child is not None:
            return self.etcd.child.discovery
        return self.plan.discovery if "://" in self.plan.discovery else ""

    def supervised(self) -> list[Supervised[Any]]:
        """Every process, in the order they stop: frontend, workers, etcd."""
        frontend = [self.frontend] if self.frontend else []
        etcd = [self.etcd] if self.etcd else []
        return [*frontend, *self.workers, *etcd]

    def children(self) -> list[ChildProcess]:
        """The current (or last) incarnation of every process that came up."""
        return [s.child for s in self.supervised() if s.child is not None]

    def _supervised(self, name: str, start: Starter[C]) -> Supervised[C]:
        return Supervised(name, start, self.plan.restart, on_give_up=self._gave_up)

    def _gave_up(self, process: Supervised[Any]) -> None:
        if self.failure is None:
            self.failure = process.failure
        self._run_scope.cancel()

    async def start(self, nursery: trio.Nursery) -> str:
        """Start everything; return the frontend URL once /health is 200. Raises LaunchError."""
        plan = self.plan
        if plan.discovery == "etcd":
            self.etcd = self._supervised("etcd", self._start_etcd)
            etcd: EtcdProcess = await nursery.start(self.etcd.run)
            log.info("etcd on %s (pid %d)", etcd.address, etcd.pid)
        await self._start_workers(nursery)
        self.frontend = self._supervised("frontend", self._start_frontend)
        frontend: FrontendProcess = await nursery.start(self.frontend.run)
        await wait_healthy(frontend.address, within=plan.start_within, child=frontend)
        return frontend.address

    async def _start_etcd(self, nursery: trio.Nursery, previous: EtcdProcess | None) -> EtcdProcess:
        plan = self.plan
        return await start_etcd(
            nursery,
            binary=plan.etcd_binary,
            workdir=self.workdir,
            ready_within=plan.start_within,
            ports=(previous.client_port, previous.peer_port) if previous else None,
            data_dir=previous.data_dir if previous else None,
        )

    def _worker_starter(
        self, role: str, name: str, model: ModelWorkers | None = None
    ) -> Starter[WorkerProcess]:
        """A worker of the plan's model, or of *model*."""
        plan = self.plan
        served = model or ModelWorkers(plan.model, plan.engine, plan.engine_args)

        async def start(nursery: trio.Nursery, previous: WorkerProcess | None) -> WorkerProcess:
            metrics_port = 0
            if plan.worker_metrics:
                metrics_port = previous.metrics_port if previous else free_port()
            return await start_worker(
                nursery,
                role,
                log_dir=self.workdir,
                name=name,
                worker_id=previous.worker_id if previous else "",
                listen=f"127.0.0.1:{previous.port if previous else 0}",
                metrics_port=metrics_port,
                discovery=self.discovery_url,
                model=served.model,
                engine=served.engine,
                engine_args=served.engine_args,
                lease_ttl=plan.lease_ttl,
                drain_timeout=plan.drain_timeout,
                extra_args=plan.worker_args,
                ready_within=plan.start_within,
                env=self.env,
            )

        return start

    async def _start_frontend(
        self, nursery: trio.Nursery, previous: FrontendProcess | None
    ) -> FrontendProcess:
        plan = self.plan
        static = (
            ""
            if self.discovery_url
            else ",".join(
                w.child.static_url(self._models.get(w.name, plan.model))
                for w in self.workers
                if w.child is not None
            )
        )
        return await start_frontend(
            nursery,
            log_dir=self.workdir,
            port=previous.port if previous else plan.port,
            discovery=self.discovery_url,
            workers=static,
            model=plan.model,
            extra_args=("--drain-timeout", f"{plan.drain_timeout:g}", *self.serve_args),
            ready_within=plan.start_within,
            env=self.frontend_env,
        )

    async def _start_workers(self, nursery: trio.Nursery) -> None:
        numbered: dict[str, int] = {}
        for role in self.plan.roles:  # prefill, decode, agg: the order they are listed in
            name = f"{role}-{numbered.setdefault(role, 0)}"
            numbered[role] += 1
            self.workers.append(self._supervised(name, self._worker_starter(role, name)))
        for extra in self.plan.extra_models:
            for i, role in enumerate(extra.roles):
                name = f"{extra.model}-{role}-{i}"
                self._models[name] = extra.model
                self.workers.append(self._supervised(name, self._worker_starter(role, name, extra)))
        errors: list[LaunchError] = []

        async def one(process: Supervised[WorkerProcess], cancel: trio.CancelScope) -> None:
            try:
                worker: WorkerProcess = await nursery.start(process.run)
            except LaunchError as exc:
                errors.append(exc)
                cancel.cancel()
                return
            log.info(
                "%s: %s %s (pid %d)", worker.name, worker.worker_id, worker.address, worker.pid
            )

        async with trio.open_nursery() as starting:
            for process in self.workers:
                starting.start_soon(one, process, starting.cancel_scope)
        if errors:
            raise errors[0]

    async def stop(self) -> None:
        """No more restarts; then the frontend (in-flight requests finish), the workers
        (they drain), etcd. Bounded: each step ends in SIGKILL if its grace runs out."""
        for process in self.supervised():
            process.stop_restarting()
        if self.frontend is not None:
            await self.frontend.stop(grace=self.plan.drain_timeout + _FRONTEND_GRACE)
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(worker.stop, self.plan.drain_timeout + 10.0)
        if self.etcd is not None:
            await self.etcd.stop(grace=_ETCD_GRACE)

    def kill_all(self) -> None:
        for process in self.supervised():
            process.kill()


async def run_cluster(plan: ClusterPlan) -> int:
    """Start the cluster, serve until a signal or a failure, stop it in order.

    Returns the exit status: 0 after SIGINT/SIGTERM, 1 if a process failed to start
    or exhausted its restart budget, or if a second signal forced the stop.
    """
    workdir = plan.workdir or Path(tempfile.mkdtemp(prefix="headwater-cluster-"))
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    forced = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            run_scope = trio.CancelScope()
            cluster = Cluster(plan, workdir, run_scope)

            async def watch_signals() -> None:
                nonlocal forced
                async for signum in signals:
                    if not run_scope.cancel_called:
                        log.info("%s: stopping the cluster", signal.Signals(signum).name)
                        run_scope.cancel()
                    else:
                        log.warning("%s again: killing every process", signal.Signals(signum).name)
                        forced = True
                        cluster.kill_all()

            nursery.start_soon(watch_signals)
            with run_scope:
                try:
                    url = await cluster.start(nursery)
                except LaunchError as exc:
                    cluster.failure = cluster.failure or str(exc)
                else:
                    _announce(cluster, url)
                    await trio.sleep_forever()
            if cluster.failure:
                log.error("%s", cluster.failure)
            log.info("stopping: frontend, then workers, then etcd")
            await cluster.stop()
            nursery.cancel_scope.cancel()
    failed = cluster.failure is not None or forced
    if failed:
        print(f"headwater launch: logs kept in {workdir}", file=sys.stderr)
    elif plan.workdir is None:
        await trio.to_thread.run_sync(shutil.rmtree, workdir, True)
    log.info("cluster stopped")
    return 1 if failed else 0


def _announce(cluster: Cluster, url: str) -> None:
    plan = cluster.plan
    counts = ", ".join(
        f"{n} {role}"
        for role, n in (("prefill", plan.prefill), ("decode", plan.decode), ("agg", plan.agg))
        if n
    )
    etcd = cluster.etcd.child if cluster.etcd else None
    where = (
        f"etcd {etcd.address}"
        if etcd
        else (f"etcd {cluster.discovery_url}" if cluster.discovery_url else "static --workers")
    )
    lines = [f"headwater launch: {plan.model} on {url} ({counts}; discovery: {where})"]
    for extra in plan.extra_models:
        lines.append(f"  and {extra.model} ({extra.engine}: {', '.join(extra.roles)})")
    for child in cluster.children():
        lines.append(f"  {child.name:<12} pid {child.pid:<8} {child.address}")
    for child in cluster.children():
        if isinstance(child, WorkerProcess) and child.metrics_url:
            lines.append(f"  {child.name:<12} metrics {child.metrics_url}/metrics")
    kept = "" if plan.workdir else " (removed after a clean stop)"
    lines.append(f"  logs in {cluster.workdir}{kept}; Ctrl-C stops the cluster")
    lines.append(f"{CLUSTER_READY_PREFIX} {url}")
    print("\n".join(lines), flush=True)
