"""Churn: workers join, drain and die while a frontend serves; no request hangs or fails.

Test policy: real processes on loopback (etcd from the shared fixture, workers and a
frontend through the project's own recipes, killed when the test's nursery ends), the
mocker at a speedup that keeps a few streams in flight on every worker when it goes,
every wait bounded. Dynamo's issue 13088 reports 1.6% of disaggregated requests hanging
forever while workers are added and removed; here each request must end, with exactly
the tokens it asked for, within a bound.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from headwater.cluster.recipes import WorkerProcess, start_frontend, start_worker, wait_healthy

pytestmark = pytest.mark.slow

SPEEDUP = 20.0  # ~1 ms per decode step: a 120-token stream lasts ~0.15-0.5 s under load
MAX_TOKENS = 120
REQUESTS = 60
CONCURRENCY = 8
REQUEST_BOUND_S = 30.0  # no request may take longer, whatever happens to its workers


async def one_stream(http: httpx.AsyncClient, model: str, i: int) -> int:
    """One streamed chat; returns its completion tokens (usage). Fails on any error."""
    body = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"tell me about river {i}"}],
    }
    usage = None
    with trio.fail_after(REQUEST_BOUND_S):
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = orjson.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        usage = event.get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


async def test_workers_join_drain_and_die_under_load(
    tmp_path: Path, etcd_url: str, nursery: trio.Nursery
) -> None:
    model = f"churn-{uuid.uuid4().hex[:8]}"
    discovery = "etcd://" + etcd_url.removeprefix("http://")
    engine = ["--speedup-ratio", f"{SPEEDUP:g}"]

    async def worker(role: str, name: str) -> WorkerProcess:
        return await start_worker(
            nursery,
            role,
            log_dir=tmp_path,
            name=name,
            discovery=discovery,
            model=model,
            engine_args=engine,
            lease_ttl=2,
            drain_timeout=10,
            extra_args=["--log-level", "warning"],
        )

    prefill = [await worker("prefill", "prefill-0")]
    decode = [await worker("decode", f"decode-{i}") for i in range(2)]
    frontend = await start_frontend(
        nursery,
        log_dir=tmp_path,
        discovery=discovery,
        model=model,
        extra_args=[
            "--tokenizer-backend",
            "hf",
            "--log-level",
            "warning",
            "--probe-backoff",
            "0.5",
        ],
    )
    await wait_healthy(frontend.address, within=30)
    done: list[int] = []
    churned = trio.Event()

    async def load(http: httpx.AsyncClient, next_i: list[int]) -> None:
        # At least REQUESTS, and on until every churn step happened under load.
        while next_i[0] < REQUESTS or not churned.is_set():
            i = next_i[0]
            next_i[0] += 1
            done.append(await one_stream(http, model, i))

    async def churn() -> None:
        # Joins: a second prefill and a third decode worker arrive.
        while len(done) < 10:
            await trio.sleep(0.05)
        prefill.append(await worker("prefill", "prefill-1"))
        decode.append(await worker("decode", "decode-2"))
        # A decode worker drains (SIGTERM: in-flight streams finish, then it leaves) ...
        while len(done) < 25:
            await trio.sleep(0.05)
        decode[0].send_signal(signal.SIGTERM)
        # ... another is killed outright with streams in flight, and so is a prefill.
        while len(done) < 40:
            await trio.sleep(0.05)
        decode[1].kill()
        prefill[0].kill()
        while len(done) < 55:  # and the frontend served on through it
            await trio.sleep(0.05)
        churned.set()

    async with (
        httpx.AsyncClient(base_url=frontend.address, timeout=REQUEST_BOUND_S) as http,
        trio.open_nursery() as running,
    ):
        running.start_soon(churn)
        next_i = [0]
        async with trio.open_nursery() as clients:
            for _ in range(CONCURRENCY):
                clients.start_soon(load, http, next_i)
    assert len(done) >= REQUESTS
    assert done == [MAX_TOKENS] * len(done)  # every request ended, whole
    with trio.fail_after(15):
        assert await decode[0].wait() == 0  # the drained worker exited cleanly
    assert (decode[1].returncode, prefill[0].returncode) == (-signal.SIGKILL, -signal.SIGKILL)
    async with httpx.AsyncClient(base_url=frontend.address) as http:
        served = {w["worker_id"]: w["served"] for w in (await http.get("/debug/workers")).json()}
    # The workers that joined under load took some of it.
    assert served.get(decode[2].worker_id, 0) > 0
    assert served.get(prefill[1].worker_id, 0) > 0
