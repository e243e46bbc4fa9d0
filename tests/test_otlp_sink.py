"""The OTLP sink the tracing cost is measured against answers like a collector."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from headwater.ports import free_port

pytestmark = pytest.mark.slow


def test_the_sink_takes_exports_and_counts_them() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.otlp_sink", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"otlp sink on http://127.0.0.1:{port}"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for size in (10, 70_000):  # one small, one over a read's worth
                r = client.post(
                    "/v1/traces",
                    content=b"x" * size,
                    headers={"content-type": "application/x-protobuf"},
                )
                assert r.status_code == 200
                assert r.content == b""
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert out.strip() == "otlp sink: 2 exports, 70010 bytes"
        assert proc.returncode == 0
    finally:
        proc.kill()
