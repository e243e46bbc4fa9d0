"""The frontend's graceful drain: what SIGTERM and SIGINT do.

Policy: in-process tests run the test's own Frontend on 127.0.0.1:0 (frontend_fixture)
and begin the drain with ``Frontend.stop``, the method the signal handler calls; the
real-process tests run ``python -m headwater serve`` (HF tokenizer backend: about 1 s to
load) on port 0 and send it SIGTERM. Mocker workers run at real speed
(``--speedup-ratio 1``: a token every ~6 ms) so that a stream is still in flight when
the drain begins. Every wait is bounded (``trio.fail_after``); no fixed sleeps.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from headwater.cluster.recipes import FrontendProcess, spawn_frontend, wait_healthy

from frontend_fixture import start_frontend

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]
UNARY = {"model": MODEL, "messages": CHAT, "max_tokens": 2}


def _stream_body(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _first_event(lines: AsyncIterator[str]) -> None:
    """Read up to a stream's first event; the caller keeps *lines* for the rest (leaving
    an httpx line iterator early closes the response)."""
    async for line in lines:
        if line.startswith("data: "):
            return
    raise AssertionError("the stream ended before its first event")


async def _rest(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines if line.startswith("data: ")]


def _assert_draining_answers(
    health: httpx.Response, live: httpx.Response, refused: httpx.Response
) -> None:
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "draining"
    assert live.status_code == 200
    assert refused.status_code == 503, refused.text
    assert refused.json() == {
        "error": {
            "message": "This frontend is shutting down; send the request to another instance",
            "type": "service_unavailable_error",
            "param": None,
            "code": "shutting_down",
        }
    }
    assert refused.headers["connection"] == "close"


def _assert_complete(events: list[str], tokens: int) -> None:
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert 0 < len(text) <= tokens


# -- in-process --------------------------------------------------------------------------


@pytest.mark.slow
async def test_stop_drains_then_exits(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="frontend.server")
    fe, url, stopped = await start_frontend(nursery, speedup_ratio=1.0, drain_timeout=30)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert (await c.get("/health")).status_code == 200
        async with c.stream("POST", "/v1/chat/completions", json=_stream_body(300)) as r:
            lines = r.aiter_lines()
            await _first_event(lines)
            fe.stop()
            # At once: /health is 503, /live 200, a new request 503, the rest as before.
            _assert_draining_answers(
                await c.get("/health"),
                await c.get("/live"),
                await c.post("/v1/chat/completions", json=UNARY),
            )
            assert (await c.get("/v1/models")).status_code == 200
            metrics = (await c.get("/metrics")).text
            assert "headwater_frontend_draining 1.0" in metrics
            # The listener stays open: a new connection is answered, with a 503.
            async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                again = await fresh.post("/v1/completions", json={**UNARY, "prompt": "hi"})
                assert again.status_code == 503
            assert fe.metrics.rejected_requests_total.labels("shutting_down")._value.get() == 2
            assert not stopped.is_set()
            # The stream in flight runs to its end.
            _assert_complete(await _rest(lines), 300)
    # Nothing is in flight any more: the drain ends, the server stops, run() returns.
    with trio.fail_after(10):
        await stopped.wait()
    with pytest.raises(OSError):
        await trio.open_tcp_stream(host, int(port))
    assert fe.admission.statistics().inflight == 0
    assert fe.metrics.inflight_requests._value.get() == 0
    assert "drained: no request in flight" in caplog.text


async def test_stop_with_nothing_in_flight_is_immediate(nursery: trio.Nursery) -> None:
    fe, url, stopped = await start_frontend(nursery, drain_timeout=30)
    async with httpx.AsyncClient(base_url=url) as c:
        assert (await c.post("/v1/chat/completions", json=UNARY)).status_code == 200
    start = trio.current_time()
    fe.stop()
    fe.stop()  # idempotent
    with trio.fail_after(10):
        await stopped.wait()
    assert trio.current_time() - start < 2.0  # not the drain timeout


@pytest.mark.slow
async def test_what_outlasts_the_drain_gets_the_graceful_timeout_then_is_cut(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="frontend.server")
    fe, url, stopped = await start_frontend(
        nursery, speedup_ratio=1.0, drain_timeout=0.5, graceful_timeout=0.5
    )
    events: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json=_stream_body(100_000)) as r:
            lines = r.aiter_lines()
            await _first_event(lines)
            start = trio.current_time()
            fe.stop()
            with pytest.raises(httpx.RemoteProtocolError):  # cut off mid-body
                events = await _rest(lines)
        with trio.fail_after(10):
            await stopped.wait()
    elapsed = trio.current_time() - start
    assert 1.0 <= elapsed < 5.0, elapsed  # drain 0.5 s, then graceful 0.5 s
    assert "data: [DONE]" not in events
    assert "drain timed out with 1 requests in flight; they get 0.5 s more" in caplog.text
    assert fe.admission.statistics().inflight == 0


# -- real processes ------------------------------------------------------------------------

# One process unless a test asks for more (a later --processes wins).
SERVE = (
    sys.executable,
    "-m",
    "headwater",
    "serve",
    "--port",
    "0",
    "--tokenizer-backend",
    "hf",
    "--speedup-ratio",
    "1",
    "--log-level",
    "info",
    "--drain-timeout",
    "30",
    "--processes",
    "1",
)


async def _spawn(nursery: trio.Nursery, tmp_path: Path, *extra: str) -> FrontendProcess:
    frontend = await spawn_frontend(
        nursery,
        [*SERVE, *extra],
        name="frontend",
        log_path=tmp_path / "frontend.log",
        ready_within=90,
    )
    await wait_healthy(frontend.address, within=60, child=frontend)
    return frontend


async def _poll_status(http: httpx.AsyncClient, url: str, status: int) -> None:
    with trio.fail_after(10):
        while (await http.get(url)).status_code != status:
            await trio.sleep(0.02)


@pytest.mark.slow
async def test_sigterm_drains_a_serving_process(tmp_path: Path, nursery: trio.Nursery) -> None:
    frontend = await _spawn(nursery, tmp_path)
    url = frontend.address
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=_stream_body(400)) as r,
    ):
        lines = r.aiter_lines()
        await _first_event(lines)
        frontend.send_signal(signal.SIGTERM)
        await _poll_status(c, "/health", 503)
        _assert_draining_answers(
            await c.get("/health"),
            await c.get("/live"),
            await c.post("/v1/chat/completions", json=UNARY),
        )
        assert frontend.returncode is None
        _assert_complete(await _rest(lines), 400)
    with trio.fail_after(30):
        assert await frontend.wait() == 0
    log = frontend.log_tail()
    assert "SIGTERM received: draining for up to 30 s" in log
    assert "drained: no request in flight" in log


@pytest.mark.slow
async def test_every_process_of_a_group_drains(tmp_path: Path, nursery: trio.Nursery) -> None:
    frontend = await _spawn(nursery, tmp_path, "--processes", "2")
    busy, idle = frontend.members
    async with httpx.AsyncClient(timeout=30) as c:
        body = _stream_body(400)
        async with c.stream("POST", busy.url + "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            await _first_event(lines)
            frontend.send_signal(signal.SIGTERM)  # the supervisor passes it on
            # The idle process has nothing to wait for: it drains at once and exits.
            with trio.fail_after(30):
                while _alive(idle.pid):
                    await trio.sleep(0.05)
            # The busy one drains, on its own port and on the shared one, which it
            # still holds open: new connections get the 503s.
            for url in (busy.url, frontend.address):
                await _poll_status(c, url + "/health", 503)
                _assert_draining_answers(
                    await c.get(url + "/health"),
                    await c.get(url + "/live"),
                    await c.post(url + "/v1/chat/completions", json=UNARY),
                )
            assert frontend.returncode is None
            _assert_complete(await _rest(lines), 400)
    with trio.fail_after(30):
        assert await frontend.wait() == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
