"""Attack: ``tools`` and object tool-call arguments went around ``--max-prompt-chars`` and
rendered on the loop: 32 MB of tools cost 2.08 s and a 468 ms stall; nesting ~1,000 deep
gave a 500.

Now their JSON text counts against ``--max-prompt-chars`` with the messages' (the param
names the field that crossed it), their nesting is bounded, and a request whose counted
text is large renders off the loop, whatever part of it is large.

Policy: a real frontend on 127.0.0.1:0 in the test's own loop; a ticker measures how long
the frontend held the loop (generous bounds).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from frontend.limits import RequestLimits

from attack_fixture import LoopGaps
from frontend_fixture import assert_error, serve_frontend

MODEL = "deepseek-v4"


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def _tool(name: str, size: int) -> dict[str, Any]:
    properties = {f"p{i}": {"type": "string", "description": "x" * 90} for i in range(size)}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


async def test_tools_and_object_arguments_count_against_max_prompt_chars() -> None:
    async with (
        serve_frontend(limits=RequestLimits(max_prompt_chars=20_000)) as (fe, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=_chat(tools=[_tool("f", 300)]))
        err = assert_error(r, 400, "tools")
        assert err["code"] == "string_above_max_length"
        big_args = {"x": "y" * 25_000}
        r = await client.post(
            "/v1/chat/completions",
            json=_chat(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": big_args}}],
                    },
                    {"role": "tool", "content": "ok"},
                ]
            ),
        )
        assert_error(r, 400, "messages")
        r = await client.post(
            "/v1/chat/completions", json=_chat(chat_template_kwargs={"x": "y" * 25_000})
        )
        assert_error(r, 400, "chat_template_kwargs")
        counted = fe.metrics.rejected_requests_total.labels("max_prompt_chars")._value.get()
        assert counted == 3
        r = await client.post("/v1/chat/completions", json=_chat(tools=[_tool("f", 10)]))
        assert r.status_code == 200, r.text


async def test_large_tools_render_off_the_loop() -> None:
    # ~1.9 MB of tools within the default limits: rendered in a thread, not on the loop.
    tools = [_tool(f"t{i}", 120) for i in range(128)]
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        async with LoopGaps() as gaps:
            r = await client.post("/v1/chat/completions", json=_chat(tools=tools), timeout=60)
        assert r.status_code in (200, 400), r.text  # 400: past the context, once rendered
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"
        assert gaps.worst < 0.2, gaps.worst  # was a 468 ms stall for 32 MB


async def test_a_tool_nested_1000_deep_is_a_400() -> None:
    deep = '{"type": "object", "properties": {"a": ' * 1000 + "{}" + "}}" * 1000
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}"
    body = orjson.dumps(_chat()).replace(
        b'"messages"', b'"tools": [' + tool.encode() + b'], "messages"'
    )
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert_error(r, 400)
