"""Attack: a keyed JSON bomb. 32 MiB of ``[]`` cost +1.04 GB of peak RSS and blocked the loop
for 3.0 s, then answered 200: the whole body was parsed on the loop before the models
ignored its unknown fields.

Now a large body's values are counted as it arrives (``--max-json-values``) and refused
past the budget before any parse; the parse decodes into the models only (an unknown field
is skipped, nothing of it built), with every list bounded; free-form JSON is decoded only
once its size, objects and arrays and depth are within their bounds.

Policy: a real frontend on 127.0.0.1:0 in the test's own loop, so that a ticker measures
how long the frontend held the loop (generous bounds: a loaded 2-core machine); peak RSS
from getrusage, an upper bound of what the bomb added.
"""

from __future__ import annotations

import resource

import httpx
import orjson
import pytest

from frontend.limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH

from attack_fixture import LoopGaps
from frontend_fixture import assert_error, serve_frontend

MODEL = "deepseek-v4"
HEAD = b'{"model": "deepseek-v4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def test_a_32_mib_bomb_is_refused_before_its_parse_without_stalling_the_loop() -> None:
    bomb = HEAD + b', "x": [' + b"[]," * (11 * 1024 * 1024) + b"[]]}"
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as client:
        before = _peak_mb()
        async with LoopGaps() as gaps:
            r = await client.post(
                "/v1/chat/completions",
                content=bomb,
                headers={"Content-Type": "application/json"},
                timeout=30,
            )
        err = assert_error(r, 400)
        assert err["code"] == "json_too_complex"
        assert gaps.worst < 0.25, gaps.worst  # was 3.0 s
        assert _peak_mb() - before < 400  # the body's own copies; was +1,040 MB
        counted = fe.metrics.rejected_requests_total.labels("max_json_values")._value.get()
        assert counted == 1
        ok = await client.post(
            "/v1/chat/completions",
            content=HEAD + b"}",
            headers={"Content-Type": "application/json"},
        )
        assert ok.status_code == 200


async def test_a_bomb_under_the_budget_is_skipped_unbuilt() -> None:
    # 1 MiB of [] in an unknown field: not counted (under twice the budget), and the
    # parse skips it without building a list.
    body = HEAD + b', "x": [' + b"[]," * 300_000 + b"[]]}"
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        async with LoopGaps() as gaps:
            r = await client.post(
                "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
            )
        assert r.status_code == 200, r.text
        assert gaps.worst < 0.1, gaps.worst


@pytest.mark.parametrize("where", ["chat_template_kwargs", "parameters", "arguments"])
async def test_a_bomb_in_free_form_json_is_refused_before_its_decode(where: str) -> None:
    bomb: dict[str, list[list[int]]] = {"x": [[] for _ in range(MAX_JSON_CONTAINERS + 1)]}
    body: dict[str, object] = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if where == "chat_template_kwargs":
        body["chat_template_kwargs"] = bomb
    elif where == "parameters":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": bomb}}]
    else:
        body["messages"] = [
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": bomb}}]}
        ]
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/v1/chat/completions",
            content=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        err = assert_error(r, 400)
        assert "objects and arrays" in err["message"]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 5000])
async def test_deep_nesting_is_a_400_not_a_500(depth: int) -> None:
    nested = "[" * depth + "]" * depth
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        tool = f'{{"function": {{"name": "f", "parameters": {{"a": {nested}}}}}}}'
        for field in (
            f'"chat_template_kwargs": {{"a": {nested}}}',
            f'"tools": [{tool}]',
            f'"x": {nested}',
        ):
            body = HEAD + b", " + field.encode() + b"}"
            r = await client.post(
                "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
            )
            if field.startswith('"x"') and r.status_code == 200:
                continue  # an unknown field nested within msgspec's own bound: skipped
            assert_error(r, 400)


async def test_every_route_refuses_a_bomb() -> None:
    bomb = b', "x": [' + b"[]," * (3 * 1024 * 1024) + b"[]]}"
    bodies = {
        "/v1/chat/completions": HEAD + bomb,
        "/v1/completions": b'{"model": "deepseek-v4", "prompt": "hi"' + bomb,
        "/inference/v1/generate": b'{"token_ids": [1, 2]' + bomb,
    }
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        for path, body in bodies.items():
            r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert assert_error(r, 400)["code"] == "json_too_complex", path
