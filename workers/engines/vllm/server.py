"""The vLLM server behind one worker: a child process it started, or one it attached to.

A started server (``--model PATH``) runs ``vllm serve`` in a process group of its own
on a free loopback port, with the environment vLLM's CPU build needs (docs/engines.md)
and, in a prefill or decode role, a NixlConnector of the matching ``kv_role`` on its
own side-channel port. It is ready once ``/health`` answers 200; stopping it sends
SIGTERM to the whole group (API server, engine core, workers), then SIGKILL after a
grace period. Through headwater's launcher it also watches its parent: if the worker
dies without stopping it, the server stops itself.

An attached server (``--vllm-url``) is only waited for: its owner starts and stops it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import httpx
import trio

from headwater.orphans import supervisor_env
from headwater.ports import free_port
from headwater.secret_env import without_secrets
from headwater.sessions import keep_niceness
from headwater.tracing import traces_url
from headwater.wire import Role
from workers.engines.vllm.config import VllmConfig

log = logging.getLogger(__name__)

#: Seconds a started server gets to exit after SIGTERM before its group is killed.
STOP_GRACE = 15.0
_HEALTH_POLL = 0.25  # seconds between two /health attempts while starting


class VllmStartError(Exception):
    """vLLM did not become healthy: it exited, or ``vllm_start_timeout`` passed."""


def kv_transfer_config(role: Role, config: VllmConfig) -> str | None:
    """``--kv-transfer-config`` for *role*: NIXL producer (prefill, with its KV lease),
    consumer (decode); None for an aggregated server."""
    kv_role = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}.get(role)
    if kv_role is None:
        return None
    kv: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": config.kv_buffer_device,
    }
    if role is Role.PREFILL:
        kv["kv_connector_extra_config"] = {"kv_lease_duration": config.kv_lease_duration}
    return json.dumps(kv)


def serve_argv(
    config: VllmConfig,
    role: Role,
    port: int,
    *,
    otlp_endpoint: str = "",
    events_endpoint: str = "",
) -> list[str]:
    """The ``vllm serve`` command line of a started server: the API server's own
    options, then :func:`engine_argv`'s."""
    command = shlex.split(config.vllm_command) or [
        sys.executable,
        "-m",
        "workers.engines.vllm.launcher",
    ]
    return [
        *command,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Token ids in and out: the frontend tokenizes. Without --enable-scale-out (or
        # --tokens-only) /inference/v1/generate answers 403.
        "--enable-scale-out",
        # Cached prompt tokens in the usage of each answer.
        "--enable-prompt-tokens-details",
        *engine_argv(config, role, otlp_endpoint=otlp_endpoint, events_endpoint=events_endpoint),
    ]


def engine_argv(
    config: VllmConfig, role: Role, *, otlp_endpoint: str = "", events_endpoint: str = ""
) -> list[str]:
    """vLLM's engine options, as ``vllm serve`` takes them, for a started server or an
    engine in-process (:mod:`.in_process`); with *otlp_endpoint*, vLLM traces its
    requests there (over OTLP/HTTP, :func:`serve_env`), each span a child of the trace
    headwater's engine hands it with the request; with *events_endpoint*
    (``tcp://127.0.0.1:PORT``), it publishes its KV cache events there
    (:mod:`.kv_events`). ``vllm_args`` come last."""
    argv = [
        "--model",
        config.model,
        "--max-model-len",
        str(config.max_model_len),
        "--block-size",
        str(config.vllm_block_size),
    ]
    if config.tokenizer_path() is None:
        # No tokenizer to load: ids only, and no structured outputs (their grammars are
        # built over the tokenizer's vocabulary; the engine declares them only with one).
        argv.append("--skip-tokenizer-init")
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if otlp_endpoint:
        argv += ["--otlp-traces-endpoint", traces_url(otlp_endpoint)]
    kv = kv_transfer_config(role, config)
    if kv is not None:
        argv += ["--kv-transfer-config", kv]
    if events_endpoint:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events_endpoint,
            "topic": "kv",
        }
        argv += ["--enable-prefix-caching", "--kv-events-config", json.dumps(events)]
    return argv + shlex.split(config.vllm_args)


def serve_env(
    config: VllmConfig, role: Role, base: dict[str, str] | None = None, *, traced: bool = False
) -> dict[str, str]:
    """The environment of a started server: *base* (default: this process's) plus what
    vLLM needs here, less headwater's secrets (the plane secret, API keys: vLLM serves
    its worker on loopback and needs none). Loopback only; the NIXL side channel on a
    port of its own."""
    env = without_secrets(dict(os.environ if base is None else base))
    env.update(
        {
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",  # a local model directory; there is no hub to ask
            # The CPU build's "0 = auto" fails ("No available memory for the cache blocks").
            "VLLM_CPU_KVCACHE_SPACE": str(config.cpu_kv_cache_gib),
        }
    )
    env.update(supervisor_env())  # the launcher stops vLLM once this worker is gone
    if traced:  # vLLM's default is gRPC; headwater's collectors speak OTLP/HTTP
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        env.setdefault("OTEL_SERVICE_NAME", "vllm")
    cores = cpu_bind(config.cpu_bind, role)
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    if role is not Role.AGG:
        if config.kv_buffer_device == "cpu":
            # NIXL's UCX backend without a GPU: shared memory and TCP on loopback. With
            # KV in GPU memory UCX picks its CUDA transports itself.
            env.setdefault("UCX_NET_DEVICES", "lo")
            env.setdefault("UCX_TLS", "sm,self,tcp")
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    return env


def cpu_bind(setting: str, role: Role) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for *setting* (see ``VllmConfig.cpu_bind``); ""
    leaves vLLM's own choice."""
    if setting != "role":
        return setting
    if role is Role.AGG:
        return ""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[0] if role is Role.PREFILL else cores[-1])


class VllmServer:
    """The vLLM server a worker uses; see the module docstring.

    :meth:`start` (again after a death, to restart), :meth:`wait` (a started server's
    exit), :meth:`stop`. ``url`` is set once started.
    """

    def __init__(
        self, config: VllmConfig, role: Role, worker_id: str, *, otlp_endpoint: str = ""
    ) -> None:
        self.config = config
        #: Where vLLM sends its own spans (its --otlp-traces-endpoint); "": untraced.
        self.otlp_endpoint = otlp_endpoint
        self.role = role
        self.worker_id = worker_id
        self.url = config.vllm_url.rstrip("/")
        self.process: trio.Process | None = None
        self.starts = 0
        #: Where a started server sends its KV cache events: the worker's subscriber,
        #: bound on loopback for the worker's life (vLLM connects to an endpoint with a
        #: host, so a restarted vLLM finds it again). Set by the engine; "": no events.
        self.events_endpoint = ""

    @property
    def attached(self) -> bool:
        return self.config.attached

    async def start(self, http: httpx.AsyncClient) -> None:
        """Start the server (or find the attached one) and wait until it is healthy.

        Raises VllmStartError. Cancellation stops a server being started.
        """
        if self.attached:
            await self._wait_healthy(http, None)
            self.starts += 1
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = serve_argv(
            self.config,
            self.role,
            port,
            otlp_endpoint=self.otlp_endpoint,
            events_endpoint=self.events_endpoint,
        )
        log.info("%s: starting vLLM on %s: %s", self.worker_id, self.url, shlex.join(argv))
        output = self._open_log()
        # Without a log file, vLLM writes to the worker's stderr: never to its stdout,
        # which carries the worker's READY line.
        target: IO[bytes] | int = output if output is not None else sys.stderr.fileno()
        try:
            self.process = await trio.lowlevel.open_process(
                argv,
                env=serve_env(self.config, self.role, traced=bool(self.otlp_endpoint)),
                stdin=subprocess.DEVNULL,
                stdout=target,
                stderr=target,
                start_new_session=True,  # its own group: stopped as a whole
            )
        finally:
            if output is not None:
                output.close()
        keep_niceness(self.process.pid)  # its session must not escape our priority
        log.info("%s: vLLM pid %d (its process group)", self.worker_id, self.process.pid)
        try:
            await self._wait_healthy(http, self.process)
        except BaseException:
            with trio.move_on_after(STOP_GRACE + 5, shield=True):
                await self.stop()
            raise
        self.starts += 1
        log.info("%s: vLLM healthy at %s", self.worker_id, self.url)

    async def wait(self) -> int:
        """Wait for a started server to exit; its exit status. Attached: never returns."""
        if self.process is None:
            await trio.sleep_forever()
            raise AssertionError("unreachable")
        return await self.process.wait()

    async def stop(self) -> None:
        """Stop a started server's whole process group: SIGTERM, then SIGKILL after
        :data:`STOP_GRACE`. Does nothing for an attached server."""
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
        # The API server may be gone and its engine core still up: the whole group.
        _signal_group(process.pid, signal.SIGKILL)
        with trio.move_on_after(5):
            await process.wait()

    def kill(self) -> None:
        """SIGKILL a started server's group at once (tests: a crash)."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)

    async def _wait_healthy(self, http: httpx.AsyncClient, process: trio.Process | None) -> None:
        deadline = trio.current_time() + self.config.vllm_start_timeout
        last = "no answer yet"
        while trio.current_time() < deadline:
            if process is not None and process.returncode is not None:
                raise VllmStartError(
                    f"vLLM exited with status {process.returncode} while starting{self._log_hint()}"
                )
            try:
                r = await http.get(self.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"/health answered {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            await trio.sleep(_HEALTH_POLL)
        raise VllmStartError(
            f"vLLM at {self.url} not healthy within {self.config.vllm_start_timeout:g} s "
            f"({last}){self._log_hint()}"
        )

    def _open_log(self) -> IO[bytes] | None:
        if not self.config.vllm_log:
            return None  # inherit: the worker's own stdout and stderr
        path = Path(self.config.vllm_log)
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab")

    def _log_hint(self) -> str:
        if not self.config.vllm_log:
            return " (its output is in this process's stderr)"
        try:
            tail = Path(self.config.vllm_log).read_text(errors="replace")[-1500:]
        except OSError:
            return ""
        return f"; the end of {self.config.vllm_log}:\n{tail}"


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
