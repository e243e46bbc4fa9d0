"""A real etcd server for tests, on free loopback ports in a temporary directory.

The binary comes from ``$HEADWATER_ETCD_BIN`` or ``etcd`` on PATH (Debian package
``etcd-server``). Without it the tests that need etcd are skipped with the reason —
except under CI (``CI=true``), where a missing etcd is a failure, so a broken CI
image cannot pass silently.

Fixtures:

* ``etcd_server`` (session) — one server shared by the whole run; tests keep apart
  by using their own key prefix (``etcd_prefix``).
* ``etcd_url`` — that server's client URL.
* ``etcd_prefix`` — a key prefix unique to the test.
* ``private_etcd`` — a server of the test's own, for tests that stop or wipe it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from headwater.cluster.launch import ETCD_BIN_ENV, find_etcd
from headwater.ports import free_port

START_TIMEOUT = 15.0  # seconds for the gateway to answer


def require_etcd() -> str:
    """The etcd binary; skips the test without one (fails under CI=true)."""
    path = find_etcd()
    if path is None:
        why = (
            f"etcd binary not found (install the Debian package etcd-server, or set {ETCD_BIN_ENV})"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI must provide it")
        pytest.skip(why)
    return path


class EtcdServer:
    """One single-member etcd, started and stopped from tests (blocking calls)."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.log_path = workdir / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._generation = 0

    @property
    def data_dir(self) -> Path:
        return self.workdir / f"data-{self._generation}"

    def start(self) -> None:
        """Start etcd and wait until its JSON gateway answers; raises RuntimeError if not."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--logger=zap",
            "--log-level=warn",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        try:
            self._process = subprocess.Popen(argv, stdout=log, stderr=log, cwd=self.workdir)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise RuntimeError(f"etcd exited early: {self._log_tail()}")
                try:
                    r = http.post(self.url + "/v3/kv/range", json={"key": "AA=="})
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer within {START_TIMEOUT:g} s: {self._log_tail()}")

    def stop(self) -> None:
        """Kill etcd (SIGKILL: tests want no graceful goodbye) and reap it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    def restart(self, *, wipe: bool = False) -> None:
        """Stop and start again on the same ports; *wipe* starts from an empty store."""
        self.stop()
        if wipe:
            self._generation += 1
        self.start()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def _start(binary: str, workdir: Path) -> EtcdServer:
    # The free ports are probed, then bound by etcd: retry if another process won the race.
    for attempt in range(3):
        server = EtcdServer(binary, workdir)
        try:
            server.start()
        except RuntimeError:
            if attempt == 2:
                raise
            continue
        return server
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    binary = require_etcd()
    with tempfile.TemporaryDirectory(prefix="headwater-etcd-") as tmp:
        server = _start(binary, Path(tmp))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def etcd_url(etcd_server: EtcdServer) -> str:
    return etcd_server.url


@pytest.fixture
def etcd_prefix() -> str:
    return f"test/{uuid.uuid4().hex[:12]}/instances/"


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = _start(require_etcd(), tmp_path)
    try:
        yield server
    finally:
        server.stop()
