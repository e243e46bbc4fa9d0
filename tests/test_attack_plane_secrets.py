"""Attack: secrets where another user or a stranger can read or guess them.

* A weak plane secret (``a``) can be guessed offline from one recorded handshake: a
  secret must have a minimum length and variety, wherever it is loaded.
* ``headwater launch`` said it made a plane secret for its cluster, and made none: its
  workers took anyone on loopback. It now makes one per run and gives it to the workers
  and the frontend in their environment.
* ``--api-key`` sat in the command line of every process of a frontend group, which any
  user of the machine reads in ``ps``: hidden there at start, and passed to children in
  their environment; a vLLM server and etcd get none of headwater's secrets.
* A frontend process's private port bound the public ``--host``: it binds loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from frontend.config import FrontendConfig
from frontend.server import Frontend
from headwater.cli.secret_args import api_keys_to_env, hide_in_cmdline
from headwater.cluster.launch import Cluster, ClusterPlan
from headwater.cluster.recipes import start_etcd
from headwater.plane.base import CannotConnect, WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.connection import HandshakeFailed
from headwater.secret_env import SECRET_ENV_VARS
from headwater.wire import Role
from headwater.wire.handshake import (
    SECRET_ENV,
    check_secret_strength,
    generate_secret,
    load_secret,
)
from workers.engines.vllm.config import VllmConfig
from workers.engines.vllm.server import serve_env

from etcd_fixture import require_etcd
from frontend_fixture import shared_tokenizer

WEAK = ["a", "password", "aaaaaaaaaaaaaaaaaaaaaaaa", "abababababababababab", "0123456"]


# ---- weak secrets -------------------------------------------------------------------------


@pytest.mark.parametrize("weak", WEAK)
def test_a_weak_plane_secret_is_refused_wherever_it_is_loaded(
    weak: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, weak)
    with pytest.raises(ValueError, match="too weak") as refused:
        load_secret()
    if len(weak) > 3:
        assert weak not in str(refused.value)  # never quoted
    path = tmp_path / "secret"
    path.write_text(f"{generate_secret()}\n{weak}\n")  # an earlier secret is checked too
    with pytest.raises(ValueError, match="line 2"):
        load_secret(str(path))


def test_a_generated_secret_passes_and_differs_each_time() -> None:
    secrets = {generate_secret() for _ in range(5)}
    assert len(secrets) == 5
    for secret in secrets:
        check_secret_strength(secret.encode())
        assert len(secret) == 44  # 32 random bytes, base64


def run_cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headwater", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_worker_and_serve_exit_2_on_a_weak_secret(tmp_path: Path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("hunter2\n")
    worker = run_cli("worker", "--plane-secret-file", str(weak), env={})
    assert worker.returncode == 2, worker.stderr
    assert "too weak" in worker.stderr
    serve = run_cli(
        "serve", "--workers", "tcp://127.0.0.1:9?role=agg&id=w", env={SECRET_ENV: "hunter2"}
    )
    assert serve.returncode == 2, serve.stderr
    assert "too weak" in serve.stderr


# ---- headwater launch makes a secret ------------------------------------------------------------


@pytest.mark.slow
async def test_launch_gives_its_workers_a_secret_and_they_refuse_a_client_without_it(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    plan = ClusterPlan(
        prefill=0, decode=0, agg=1, discovery="static", engine_args=("--speedup-ratio", "100000")
    )
    cluster = Cluster(plan, tmp_path, trio.CancelScope())
    secret = cluster.env[SECRET_ENV]
    check_secret_strength(secret.encode())
    await cluster._start_workers(nursery)
    (worker,) = [w.child for w in cluster.workers]
    assert worker is not None
    environ = (await trio.Path(f"/proc/{worker.pid}/environ").read_bytes()).split(b"\0")
    assert f"{SECRET_ENV}={secret}".encode() in environ
    assert secret.encode() not in await trio.Path(f"/proc/{worker.pid}/cmdline").read_bytes()
    instance = WorkerInstance(worker.worker_id, Role.AGG, plan.model, worker.address)
    with pytest.raises(CannotConnect) as refused:
        await connect_worker(instance, nursery, secret=None)
    cause = refused.value.__cause__
    assert isinstance(cause, HandshakeFailed)
    assert cause.code == "unauthorized"
    client = await connect_worker(instance, nursery, secret=secret.encode())
    await client.aclose()
    for process in cluster.workers:
        await process.stop(grace=5.0)


def test_launch_uses_the_callers_secret_when_there_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = generate_secret()
    monkeypatch.setenv(SECRET_ENV, mine)
    cluster = Cluster(ClusterPlan(), tmp_path, trio.CancelScope())
    assert cluster.env[SECRET_ENV] == mine


def test_launch_moves_api_keys_after_the_separator_to_the_frontends_environment(
    tmp_path: Path,
) -> None:
    plan = ClusterPlan(serve_args=("--router", "p2c", "--api-key", "k-one", "--api-key=k-two"))
    cluster = Cluster(plan, tmp_path, trio.CancelScope())
    assert cluster.serve_args == ["--router", "p2c"]
    assert cluster.frontend_env["HEADWATER_API_KEYS"] == "k-one,k-two"
    assert "HEADWATER_API_KEYS" not in cluster.env  # the workers get no API key


# ---- command lines --------------------------------------------------------------------------


def test_api_keys_leave_a_childs_command_line_for_its_environment() -> None:
    env = {"HEADWATER_API_KEYS": "k-env"}
    argv = api_keys_to_env(["--port", "0", "--api-key", "k1", "--api-key=k2", "-v"], env)
    assert argv == ["--port", "0", "-v"]
    assert env["HEADWATER_API_KEYS"] == "k-env,k1,k2"
    env = {}
    assert api_keys_to_env(["--api-key", "a,b"], env) == ["--api-key", "a,b"]  # cannot travel
    assert env == {}


@pytest.mark.slow
def test_hide_in_cmdline_overwrites_the_values_the_kernel_shows() -> None:
    code = (
        "import sys; from headwater.cli.secret_args import hide_in_cmdline; "
        "n = hide_in_cmdline([sys.argv[2], sys.argv[3].partition('=')[2]]); "
        "print(n, open('/proc/self/cmdline', 'rb').read())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--api-key", "s3cr3t-key", "--api-key=other-key", "x"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.startswith("2 ")
    assert "s3cr3t-key" not in out
    assert "other-key" not in out
    assert "**********" in out
    assert hide_in_cmdline([]) == 0


@pytest.mark.slow
def test_serve_with_an_api_key_shows_it_in_no_process_of_its_group(tmp_path: Path) -> None:
    key = "sk-" + "q" * 40
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headwater",
            "serve",
            "--port",
            "0",
            "--processes",
            "2",
            "--api-key",
            key,
            "--speedup-ratio",
            "1000",
            "--tokenizer-threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("headwater: serving"):
                break
        pids = [process.pid, *_descendants(process.pid)]
        assert len(pids) >= 3  # the supervisor, the zygote or a process, two processes
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert key.encode() not in cmdline, f"pid {pid}: {cmdline!r}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    children = [int(p) for p in out.split()]
    return [p for c in children for p in (c, *_descendants(c))]


# ---- children's environments ---------------------------------------------------------------


def test_a_vllm_server_gets_none_of_headwaters_secrets() -> None:
    base = {**{name: "secret-value" for name in SECRET_ENV_VARS}, "PATH": "/usr/bin"}
    env = serve_env(VllmConfig(), Role.AGG, base=base)
    assert not set(SECRET_ENV_VARS) & set(env)
    assert env["PATH"] == "/usr/bin"


@pytest.mark.slow
async def test_etcd_gets_none_of_headwaters_secrets(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = require_etcd()
    for name in SECRET_ENV_VARS:
        monkeypatch.setenv(name, "secret-value-" + name)
    etcd = await start_etcd(nursery, binary=binary, workdir=tmp_path)
    environ = await trio.Path(f"/proc/{etcd.pid}/environ").read_bytes()
    assert b"secret-value" not in environ
    await etcd.stop(grace=5.0)


# ---- private ports --------------------------------------------------------------------------


def test_a_group_processs_private_port_binds_loopback_whatever_the_host() -> None:
    config = FrontendConfig(host="0.0.0.0", port=0, listen_fd=3, processes=1)
    frontend = Frontend(config, tokenizer=shared_tokenizer())
    assert frontend.hypercorn_config().bind == ["fd://3", "127.0.0.1:0"]
