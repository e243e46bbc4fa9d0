"""A fresh server's first requests: no stall, because every loop-side path is warm.

Policy: a real ``headwater serve`` process (a fresh interpreter: in the test process the
loop thread's encoder is warm from earlier tests), loopback, port 0, started with
:mod:`headwater.cluster.recipes` in the test's nursery, which kills it when the test
ends. The stall threshold is 10 ms, half the default, so that the cold inline encode
(13-40 ms measured) is caught whenever it happens; the stall detector's records are
read from ``GET /debug/stalls``, and only those of host CPU contention are allowed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from headwater.cluster.recipes import spawn_frontend

pytestmark = pytest.mark.slow

ARGS = (
    "--port",
    "0",
    "--processes",
    "1",
    "--speedup-ratio",
    "100",
    "--stall-threshold-ms",
    "10",
    "--log-level",
    "warning",
)


def own_stalls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stalls of the server's own making: all but those of a host with no CPU to spare
    (``contention``: another process's load, which a test on a shared machine meets)."""
    return [r for r in records if r["cause"] != "contention"]


async def test_the_first_requests_after_start_record_no_stall(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "headwater", "serve", *ARGS]
    async with trio.open_nursery() as nursery:
        fe = await spawn_frontend(
            nursery, argv, name="frontend", log_path=tmp_path / "frontend.log", ready_within=90
        )
        async with httpx.AsyncClient(base_url=fe.address, timeout=30) as http:
            chat = {
                "model": "deepseek-v4",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hello!"}],
            }
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            completion = {"model": "deepseek-v4", "max_tokens": 4, "prompt": "Once", "stream": True}
            r = await http.post("/v1/completions", json=completion)
            assert r.status_code == 200, r.text
            records = (await http.get("/debug/stalls")).json()
        assert own_stalls(records) == [], records
        nursery.cancel_scope.cancel()
