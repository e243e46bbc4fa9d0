"""Real vLLM servers for the tests of the vLLM engine, started once per session.

vLLM's CPU build (``make vllm``) serves the tiny locally built model
(``scripts/build_tiny_model.py``; built here when missing). Without vLLM the tests
that need it are skipped with the reason, except under CI (``CI=true``), where a
missing vLLM is a failure, so a broken CI image cannot pass silently.

Policy: three ``headwater worker --engine vllm`` processes, each starting its own
vLLM (``--enforce-eager``) on free loopback ports, both ways to it covered: one
aggregated behind vLLM's API server (``--vllm-client api-server``: its vLLM logs every
request's ``SamplingParams``, and its token-in API is the tests' oracle of vLLM's own
answers), and a prefill + decode pair with NIXL, each with vLLM in-process (the
default; the decode without prefix caching, so its prompt tokens can only come from
the transfer, and exporting vLLM's series on its own metrics port). They start in
the background as soon as collection sees a test marked ``vllm`` (``conftest.py``),
while the other tests run; those tests run last and wait for them, and they run niced,
so the tests running meanwhile keep the cores they need. At most these three vLLM
instances (~3.5 GB each) are alive at once; every process is stopped at the end of the
session (its process group, and the vLLM group its log names).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from headwater.orphans import supervisor_env
from headwater.plane.base import WorkerInstance
from headwater.ports import free_port
from headwater.sessions import set_session_nice
from headwater.wire import Role

REPO = Path(__file__).resolve().parent.parent
#: The tiny model's directory: $HEADWATER_TINY_MODEL, else artifacts/tiny-llama.
#: Seconds a plane connection of these tests may wait for an ACK or stay silent. Three
#: CPU vLLM engines on two cores: every process of the machine was seen to stop for
#: 20-30 s at once (each vLLM's own 10-s log line late by as much), and a 5-s ACK or a
#: 15-s silence then failed a test about vLLM's behaviour, not about the plane's.
PATIENCE = 120.0
TINY_MODEL = Path(os.environ.get("HEADWATER_TINY_MODEL", REPO / "artifacts" / "tiny-llama"))
MODEL_NAME = "deepseek-v4"
#: Seconds the three workers get to report ready (their vLLMs start side by side on
#: two cores, beside other tests).
READY_WITHIN = 420.0
NICENESS = 10  # of the vLLM workers and their servers
_READY = re.compile(r"HEADWATER_WORKER_READY (\S+) (\S+) (\S+)")
_VLLM_URL = re.compile(r"starting vLLM on (http://\S+):")
_VLLM_PID = re.compile(r"vLLM pid (\d+)")
_ENGINE_CORE_PID = re.compile(r"vLLM up at in-process \(engine core pid (\d+)\)")


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (run `make vllm`)"
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (run `make vllm`)"
    return None


def require_vllm() -> None:
    """Skip the test without vLLM (fail under CI=true)."""
    why = vllm_missing()
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI must provide it")
    pytest.skip(why)


def ensure_tiny_model() -> Path:
    """The tiny model's directory, built first if missing (~5 s)."""
    if not (TINY_MODEL / "headwater-tiny-model.json").is_file():
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(TINY_MODEL)],
            check=True,
            cwd=REPO,
            timeout=300,
        )
    return TINY_MODEL


@dataclass
class VllmWorker:
    """One ``headwater worker --engine vllm`` process and the vLLM it started."""

    role: Role
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    address: str = ""
    worker_id: str = ""
    #: The worker's own metrics endpoint (with vLLM's series when it runs in-process).
    metrics_url: str = ""
    #: vLLM's API server (``--vllm-client api-server``); "" in-process.
    vllm_url: str = ""
    #: The process groups of the vLLM servers it started, or in-process the pids of the
    #: engine cores (in the worker's own group), the last one current.
    vllm_pids: list[int] = field(default_factory=list)

    @property
    def instance(self) -> WorkerInstance:
        return WorkerInstance(self.worker_id, self.role, MODEL_NAME, self.address)

    @property
    def vllm_pid(self) -> int:
        """The process group of the vLLM it runs now (the last one it started)."""
        self.refresh()
        return self.vllm_pids[-1]

    def refresh(self) -> None:
        """Read what the worker logged: its vLLM's URL and pids."""
        text = self.stderr.read_text(errors="replace")
        urls = _VLLM_URL.findall(text)
        if urls:
            self.vllm_url = urls[-1]
        self.vllm_pids = [int(p) for p in _VLLM_PID.findall(text)]
        self.vllm_pids += [int(p) for p in _ENGINE_CORE_PID.findall(text)]

    def poll_ready(self) -> bool:
        match = _READY.search(self.stdout.read_text(errors="replace"))
        if match is None:
            return False
        self.address, self.worker_id = match.group(1), match.group(2)
        self.refresh()
        return True

    def log_tail(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]

    def vllm_log(self) -> str:
        """What its vLLM logged so far."""
        return (self.stderr.parent / f"vllm-{self.role}.log").read_text(errors="replace")


class TraceReceiver:
    """An OTLP/HTTP traces receiver in a thread of its own (the vLLM workers start at
    collection, before any trio run): what the aggregated worker and its vLLM export."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, str]] = []  # (service, name, trace, parent)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                got = ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    for rs in got.resource_spans:
                        service = next(
                            (
                                a.value.string_value
                                for a in rs.resource.attributes
                                if a.key == "service.name"
                            ),
                            "",
                        )
                        for scope in rs.scope_spans:
                            receiver.spans += [
                                (service, s.name, s.trace_id.hex(), s.parent_span_id.hex())
                                for s in scope.spans
                            ]
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="otlp", daemon=True).start()

    def in_trace(self, trace_id: str) -> list[tuple[str, str, str, str]]:
        with self._lock:
            return [s for s in self.spans if s[2] == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class VllmCluster:
    """The session's three vLLM workers; see the module docstring."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        #: Where the aggregated worker and its vLLM send their spans.
        self.traces = TraceReceiver()
        self.model = ensure_tiny_model()
        self.workers: dict[Role, VllmWorker] = {}
        self._ready = False
        self.started_at = time.monotonic()
        self.ready_after: float | None = None

    def start(self) -> None:
        """Start the three workers; returns at once."""
        for role, extra in (
            # Its vLLM logs each request's SamplingParams: what vLLM received
            # (tests/test_vllm_fields.py reads it).
            (
                Role.AGG,
                (
                    "--vllm-client=api-server",
                    f"--otlp-endpoint={self.traces.url}",
                    "--vllm-args=--enable-log-requests",
                ),
            ),
            (Role.PREFILL, ()),
            (Role.DECODE, ("--vllm-args=--no-enable-prefix-caching",)),
        ):
            self.workers[role] = self._spawn(role, extra)

    def _spawn(self, role: Role, extra: tuple[str, ...]) -> VllmWorker:
        metrics_port = free_port()
        stdout = self.workdir / f"worker-{role}.out"
        stderr = self.workdir / f"worker-{role}.err"
        argv = [
            # Niced: they start while the rest of the suite runs, and timing-sensitive
            # tests there come first; by the time the vLLM tests run nothing else does.
            "nice",
            "-n",
            str(NICENESS),
            sys.executable,
            "-m",
            "headwater",
            "worker",
            "--engine",
            "vllm",
            "--model",
            str(self.model),
            "--role",
            str(role),
            "--enforce-eager",
            "--listen",
            "127.0.0.1:0",
            "--worker-id",
            f"vllm-{role}",
            "--model-name",
            MODEL_NAME,
            "--drain-timeout",
            "2",
            "--peer-timeout",
            str(PATIENCE),
            "--vllm-log",
            str(self.workdir / f"vllm-{role}.log"),
            "--cpu-bind",
            "role",
            "--metrics-port",
            str(metrics_port),
            *extra,
        ]
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
                # A test session killed outright: the worker drains, its vLLM with it.
                env={**os.environ, **supervisor_env()},
            )
        # nice sets the worker's own priority; its session's scheduling group (and its
        # vLLM's, which the worker sets) needs it too (headwater/sessions.py).
        set_session_nice(process.pid, NICENESS)
        return VllmWorker(
            role, process, stdout, stderr, metrics_url=f"http://127.0.0.1:{metrics_port}"
        )

    def wait_ready(self) -> None:
        """Block until every worker reported ready; raises RuntimeError naming the one
        that exited or did not make it in time."""
        if self._ready:
            return
        deadline = self.started_at + READY_WITHIN
        pending = dict(self.workers)
        while pending:
            for role, worker in list(pending.items()):
                if worker.poll_ready():
                    del pending[role]
                elif worker.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM {role} worker exited ({worker.process.returncode}): "
                        f"{worker.log_tail()}"
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(map(str, pending))
                raise RuntimeError(f"vLLM workers not ready in {READY_WITHIN:g} s: {names}")
            time.sleep(0.2)
        self._ready = True
        self.ready_after = time.monotonic() - self.started_at

    def stop(self) -> None:
        """SIGTERM every worker (it stops its vLLM), then kill what is left."""
        for worker in self.workers.values():
            if worker.process.poll() is None:
                _signal_group(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for worker in self.workers.values():
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(worker.process.pid, signal.SIGKILL)
                worker.process.wait(timeout=10)
            worker.refresh()
            for pid in worker.vllm_pids:
                _signal_group(pid, signal.SIGKILL)
        self.traces.close()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


_CLUSTER: VllmCluster | None = None
_TMP: tempfile.TemporaryDirectory[str] | None = None


def start_in_background() -> None:
    """Start the session's cluster now (collection time) if vLLM is installed."""
    global _CLUSTER, _TMP
    if _CLUSTER is not None or vllm_missing() is not None:
        return
    # HEADWATER_VLLM_LOGS=DIR keeps the workers' and vLLMs' logs there, for a failure.
    if keep := os.environ.get("HEADWATER_VLLM_LOGS"):
        workdir = Path(keep)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        _TMP = tempfile.TemporaryDirectory(prefix="headwater-vllm-")
        workdir = Path(_TMP.name)
    _CLUSTER = VllmCluster(workdir)
    _CLUSTER.start()


def stop_cluster() -> None:
    global _CLUSTER, _TMP
    if _CLUSTER is not None:
        _CLUSTER.stop()
        _CLUSTER = None
    if _TMP is not None:
        _TMP.cleanup()
        _TMP = None


@pytest.fixture(scope="session")
def vllm_cluster() -> VllmCluster:
    """The three ready vLLM workers (started at collection; see the module docstring)."""
    require_vllm()
    start_in_background()
    assert _CLUSTER is not None
    _CLUSTER.wait_ready()
    return _CLUSTER
