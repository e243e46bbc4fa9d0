"""Start-up failures are one clear line and a non-zero exit, found before anything slow.

Policy: each case runs the real command (``python -m headwater ...``) in a subprocess,
bounded by a timeout well under what the slow path would take (a tokenizer load, a
group's fork, a vLLM waited for up to 300 s). A port in use is one the test holds open
on loopback; an unreachable server is a loopback port bound but not listening, which
refuses connections at once. No vLLM is needed: the checks run before any starts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A loopback port another server listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def refusing_url() -> Iterator[str]:
    """A loopback URL that refuses connections (its port is bound, nobody listens)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def run(command: str, *args: str) -> tuple[int, list[str]]:
    """Exit status and the non-empty stderr lines of ``headwater <command> <args>``."""
    done = subprocess.run(
        [sys.executable, "-m", "headwater", command, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def assert_one_line(command: str, status: int, lines: list[str], *words: str) -> None:
    assert status == 2, lines
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith(f"headwater {command}: "), line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize(
    ("command", "args"),
    [("serve", ["--processes", "1"]), ("serve", ["--processes", "2"]), ("launch", [])],
)
def test_a_port_in_use(command: str, args: list[str], taken_port: int) -> None:
    status, lines = run(command, "--port", str(taken_port), *args)
    assert_one_line(command, status, lines, f"127.0.0.1:{taken_port}", "in use")


def test_a_worker_port_in_use(taken_port: int) -> None:
    status, lines = run("worker", "--role", "agg", "--listen", f"127.0.0.1:{taken_port}")
    assert_one_line("worker", status, lines, f"127.0.0.1:{taken_port}", "--listen", "in use")


def test_a_bad_tokenizer_path(tmp_path: Path) -> None:
    status, lines = run("serve", "--port", "0", "--tokenizer", str(tmp_path / "nothing"))
    assert_one_line("serve", status, lines, "--tokenizer", str(tmp_path / "nothing"))


@pytest.mark.parametrize("command", ["serve", "worker", "launch"])
def test_a_missing_vllm_model_directory(command: str, tmp_path: Path) -> None:
    where = ["--role", "agg"] if command == "worker" else ["--port", "0"]
    missing = str(tmp_path / "no-model")
    status, lines = run(command, "--engine", "vllm", "--model", missing, *where)
    assert_one_line(command, status, lines, f"--model {missing}", "no such directory")


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_unreachable_vllm_url(command: str, refusing_url: str) -> None:
    # Without the check, the worker waits vllm_start_timeout (300 s) for it.
    where = ["--role", "agg"] if command == "worker" else ["--port", "0", "--mode", "agg"]
    status, lines = run(
        command,
        "--engine",
        "vllm",
        "--vllm-url",
        refusing_url,
        "--model-vocab-size",
        "1000",
        *where,
    )
    assert_one_line(command, status, lines, f"--vllm-url {refusing_url}", "cannot connect")
