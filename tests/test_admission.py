"""Admission control: ``--max-inflight`` refuses generation requests before any work.

Policy: the policy object is tested on its own (no I/O; virtual time for its waits);
the HTTP behaviour against a real frontend on 127.0.0.1:0 (see frontend_fixture) with
in-process mocker workers at real speed (``speedup_ratio`` 1), so that streams stay in
flight while the test sends more. Waits on the server's own state are polls bounded by
``trio.fail_after``; no fixed sleeps.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from frontend.http.admission import Admission, Reason
from frontend.server import Frontend

from frontend_fixture import eventually, idle, serve_frontend

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]


# -- the policy --------------------------------------------------------------------------


def test_admission_counts_slots_up_to_its_limit() -> None:
    admission = Admission(2)
    assert admission.admit() is None
    assert admission.admit() is None
    assert admission.admit() is Reason.MAX_INFLIGHT
    admission.release()
    assert admission.admit() is None
    stats = admission.statistics()
    assert (stats.inflight, stats.max_inflight, stats.admitted_total, stats.rejected_total) == (
        2,
        2,
        3,
        1,
    )
    admission.release()
    admission.release()
    with pytest.raises(RuntimeError):
        admission.release()


def test_no_limit_and_bad_limits() -> None:
    unlimited = Admission(0)
    assert all(unlimited.admit() is None for _ in range(10_000))
    with pytest.raises(ValueError):
        Admission(-1)


def test_a_drain_refuses_everything_but_lets_the_admitted_finish() -> None:
    admission = Admission(0)
    assert admission.admit() is None
    admission.drain()
    admission.drain()  # idempotent
    assert admission.draining
    assert admission.admit() is Reason.SHUTTING_DOWN
    assert admission.statistics().inflight == 1
    assert admission.refusal(Reason.SHUTTING_DOWN).status == 503
    assert admission.refusal(Reason.MAX_INFLIGHT).status == 429


async def test_wait_idle_returns_when_the_last_request_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(4)
    await admission.wait_idle()  # nothing in flight: at once
    assert trio.current_time() == 0
    for _ in range(2):
        assert admission.admit() is None

    async def finish(after: float) -> None:
        await trio.sleep(after)
        admission.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish, 1.0)
        nursery.start_soon(finish, 3.0)
        await admission.wait_idle()
        assert trio.current_time() == 3.0
    # And again, with a fresh request.
    assert admission.admit() is None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish, 2.0)
        await admission.wait_idle()
        assert trio.current_time() == 5.0


# -- over HTTP ---------------------------------------------------------------------------


def _encoded(fe: Frontend) -> int:
    return fe.pool.statistics().encoded_total  # inline encodes included


def _rejected(fe: Frontend, reason: str) -> float:
    value: float = fe.metrics.rejected_requests_total.labels(reason)._value.get()
    return value


async def _first_event(lines: AsyncIterator[str]) -> None:
    """Read up to a stream's first event. The caller keeps *lines*, one iterator for the
    whole stream: leaving an httpx line iterator early closes the response."""
    async for line in lines:
        if line.startswith("data: "):
            return
    raise AssertionError("the stream ended before its first event")


async def _rest(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines if line.startswith("data: ")]


def _assert_429(r: httpx.Response, limit: int) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": {
            "message": f"This frontend is serving its limit of {limit} requests at once. "
            "Please try again in 1s.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }


@pytest.mark.slow
async def test_over_max_inflight_is_429_before_any_work_until_a_stream_ends() -> None:
    async with (
        serve_frontend(max_inflight=2, speedup_ratio=1.0) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        # Two streams in flight: ~2.5 s of decoding for the first, far more for the second.
        short = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        long = {**short, "max_tokens": 100_000}
        async with (
            c.stream("POST", "/v1/chat/completions", json=short) as first,
            c.stream("POST", "/v1/chat/completions", json=long) as second,
        ):
            first_lines, second_lines = first.aiter_lines(), second.aiter_lines()
            await _first_event(first_lines)
            await _first_event(second_lines)
            assert fe.admission.statistics().inflight == 2
            encoded = _encoded(fe)

            unary = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
            _assert_429(await c.post("/v1/chat/completions", json=unary), 2)
            _assert_429(await c.post("/v1/completions", json={**unary, "prompt": "hi"}), 2)
            _assert_429(await c.post("/inference/v1/generate", json={"token_ids": [5, 6]}), 2)
            # Refused before its body is read: not even parsed (no 400 for bad JSON) ...
            junk = await c.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            )
            _assert_429(junk, 2)
            # ... nor tokenized: a 40k-token prompt costs the pool nothing, and the
            # connection stays usable (its body was read to the end and dropped).
            big = {"model": MODEL, "messages": [{"role": "user", "content": "river " * 40_000}]}
            _assert_429(await c.post("/v1/chat/completions", json=big), 2)
            assert _encoded(fe) == encoded
            assert _rejected(fe, "max_inflight") == 5
            # What is never refused.
            for path in ("/health", "/live", "/metrics", "/v1/models", f"/v1/models/{MODEL}"):
                assert (await c.get(path)).status_code == 200, path
            metrics = (await c.get("/metrics")).text
            rejected = "headwater_frontend_rejected_requests_total"
            assert rejected + '{reason="max_inflight"} 5.0' in metrics
            assert rejected + '{reason="shutting_down"} 0.0' in metrics
            assert "headwater_frontend_inflight_requests 2.0" in metrics
            assert "headwater_frontend_max_inflight_requests 2.0" in metrics

            # The first stream runs to its end; its slot is free once its last byte left.
            events = await _rest(first_lines)
            assert events[-1] == "data: [DONE]"
            assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
            await eventually(lambda: fe.admission.statistics().inflight == 1)
            ok = await c.post("/v1/chat/completions", json=unary)
            assert ok.status_code == 200, ok.text
            assert _encoded(fe) == encoded + 1
        # The second stream's client left: its slot is back too.
        await eventually(lambda: fe.admission.statistics().inflight == 0)
        await eventually(idle(fe))
        assert "headwater_frontend_inflight_requests 0.0" in (await c.get("/metrics")).text


async def test_max_inflight_zero_is_no_limit() -> None:
    async with (
        serve_frontend(max_inflight=0) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(partial(c.post, "/v1/chat/completions", json=body))
        assert fe.admission.statistics().admitted_total == 20
        assert _rejected(fe, "max_inflight") == 0


@pytest.mark.slow
async def test_ten_times_overload_answers_every_request_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """80 requests at once against max_inflight 8: each gets a whole 200 or a 429 (a 503
    would be allowed, no other 5xx), the server logs no error, and every slot and gauge
    is back to 0 at the end."""
    caplog.set_level(logging.WARNING)
    n, limit = 80, 8
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with (
        serve_frontend(max_inflight=limit, speedup_ratio=1.0) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c,
    ):
        statuses: Counter[int] = Counter()
        complete: list[bool] = []

        async def one(i: int) -> None:
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": CHAT,
                "max_tokens": 16,
                "ignore_eos": True,
                "stream": i % 2 == 0,
            }
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                statuses[r.status_code] += 1
                raw = await r.aread()
            if r.status_code == 200:
                if body["stream"]:
                    complete.append(raw.endswith(b"data: [DONE]\n\n"))
                else:
                    usage = orjson.loads(raw)["usage"]
                    complete.append(usage["completion_tokens"] == 16)
            elif r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert orjson.loads(raw)["error"]["code"] == "rate_limit_exceeded"

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        assert sum(statuses.values()) == n
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses[429] > 0, statuses
        assert statuses[200] >= limit, statuses
        assert len(complete) == statuses[200]
        assert all(complete)
        assert _rejected(fe, "max_inflight") == statuses[429]
        await eventually(lambda: fe.admission.statistics().inflight == 0)
        await eventually(idle(fe))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
