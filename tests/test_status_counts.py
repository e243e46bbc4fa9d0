"""Every answer counted by status code: ``http_responses_total{code}`` and the dashboard.

Policy: a frontend on 127.0.0.1:0 (see frontend_fixture), driven with httpx and, for
what the server answers before the app sees a request (a head it cannot parse, over
its limit or too slow), raw trio sockets. Each status is asked for once; the counts
are then read from ``/metrics`` and ``/dashboard/data``, which are not counted
themselves.
"""

from __future__ import annotations

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from frontend_fixture import eventually, idle, serve_frontend

MODEL = "deepseek-v4"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
KEY = {"Authorization": "Bearer k"}


def counts(metrics_text: str) -> dict[str, float]:
    """``http_responses_total`` by code, from a /metrics page."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "headwater_frontend_http_responses":
            return {s.labels["code"]: s.value for s in family.samples if s.name.endswith("_total")}
    return {}


async def raw(url: str, data: bytes) -> bytes:
    """What the server answers *data* on a fresh connection, until it closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                answer += chunk
    return answer


@pytest.mark.slow
async def test_each_status_is_counted_by_code_on_metrics_and_the_dashboard() -> None:
    settings = {
        "api_keys": ("k",),
        "max_body_bytes": 4096,
        "max_header_bytes": 2048,
        "header_timeout": 0.3,
        "max_inflight": 1,
        "speedup_ratio": 1.0,
    }
    async with (
        serve_frontend(**settings) as (fe, url),
        httpx.AsyncClient(base_url=url, headers=KEY, timeout=30) as c,
    ):
        expected: dict[str, int] = {}

        async def asks(status: int, method: str, path: str, **kw: object) -> None:
            r = await c.request(method, path, **kw)  # type: ignore[arg-type]
            assert r.status_code == status, (path, r.text)
            expected[str(status)] = expected.get(str(status), 0) + 1

        await asks(200, "POST", "/v1/chat/completions", json=CHAT)
        await asks(200, "GET", "/v1/models")
        await asks(
            400,
            "POST",
            "/v1/chat/completions",
            content=b"{not json",
            headers={**KEY, "content-type": "application/json"},
        )
        await asks(400, "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": -1})
        await asks(401, "POST", "/v1/chat/completions", json=CHAT, headers={"Authorization": ""})
        await asks(404, "GET", "/v1/embeddings")
        await asks(404, "POST", "/v1/chat/completions", json={**CHAT, "model": "other"})
        await asks(405, "GET", "/v1/chat/completions")
        await asks(413, "POST", "/v1/completions", json={**CHAT, "prompt": "x" * 5000})
        await asks(
            415,
            "POST",
            "/v1/chat/completions",
            content=b"hi",
            headers={**KEY, "content-type": "text/plain"},
        )
        # 429: one stream holds the only slot (--max-inflight 1).
        long = {**CHAT, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=long) as held:
            lines = held.aiter_lines()
            assert (await lines.__anext__()).startswith("data: ")
            await asks(429, "POST", "/v1/chat/completions", json=CHAT)
        expected["200"] += 1  # the stream's head was a 200
        await eventually(idle(fe))
        # The server's own answers, before any app: garbage, a head too large, too slow.
        assert (await raw(url, b"NOT HTTP AT ALL\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        big = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 3000 + b"\r\n\r\n"
        assert (await raw(url, big)).startswith(b"HTTP/1.1 431 ")
        assert (await raw(url, b"GET /v1/models HTTP/1.1\r\n")).startswith(b"HTTP/1.1 408 ")
        expected["400"] += 1
        expected["431"] = expected["408"] = 1
        # 503: draining; /health says so too, but the server's own views are not counted.
        fe.admission.drain()
        await asks(503, "POST", "/v1/chat/completions", json=CHAT)
        for path in (
            "/health",
            "/live",
            "/metrics",
            "/dashboard",
            "/dashboard/data",
            "/debug/stalls",
        ):
            await c.get(path)

        assert counts((await c.get("/metrics")).text) == {k: float(v) for k, v in expected.items()}
        data = (await c.get("/dashboard/data")).json()
        assert data["requests"]["by_code"] == expected
        # The validated generation requests keep their own, narrower count.
        assert sum(data["requests"]["by_status"].values()) < sum(expected.values())
