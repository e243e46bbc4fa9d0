"""Agentic answers over HTTP: the parse stage's reasoning and tool calls in OpenAI's
shapes (unary and streamed), on the scripted engine with DeepSeek-V4's real formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from workers.engines.scripted import ScriptedConfig

from frontend_fixture import sse_events, start_frontend
from parser_corpus import BLOCK, BLOCK_END, TOOLS, D, invoke, param

CALL = (
    "Let me look.\n\n"
    + BLOCK
    + "\n"
    + invoke("get_weather", [param("city", "Paris"), param("days", 3)])
    + "\n"
    + invoke("noop", [])
    + "\n"
    + BLOCK_END
)
THOUGHT = "The user wants the weather.</think>"
SCRIPT = [
    {"prompt_contains": "WEATHER-Q", "text": THOUGHT + CALL},
    {"prompt_contains": "THINK-ONLY", "text": "Still thinking about it"},
    {"prompt_contains": "FAKE-CALL", "text": CALL},
    {"default": True, "text": "<think>Easy.</think>It is 4."},
]


async def frontend(nursery: trio.Nursery, tmp_path: Path, **overrides: Any) -> str:
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in SCRIPT) + "\n")
    config = ScriptedConfig(script=str(path), token_delay=0)
    _, url, _ = await start_frontend(
        nursery, engine="scripted", engine_config=config, mode="agg", **overrides
    )
    return url


def chat(content: str, *, thinking: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "deepseek-v4",
        "messages": [{"role": "user", "content": content}],
        "chat_template_kwargs": {"thinking": thinking},
        "tools": TOOLS,
        **extra,
    }


@pytest.mark.slow
async def test_a_unary_answer_has_reasoning_content_and_tool_calls(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    url = await frontend(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", json=chat("WEATHER-Q in Paris?"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Let me look.\n\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


async def test_a_stream_says_the_same_in_openais_incremental_shape(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    url = await frontend(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as client:
        unary = (await client.post("/v1/chat/completions", json=chat("WEATHER-Q"))).json()
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("WEATHER-Q", stream=True)
        ) as r:
            events = await sse_events(r)
    assert events[-1] == "DONE"
    chunks = [e for e in events[:-1] if e["choices"]]
    content = reasoning = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for step in delta.get("tool_calls", []):
            if "id" in step:  # a call's first step: index, id, type and name
                assert step["index"] not in calls
                assert step["type"] == "function"
                assert step["function"]["name"]
                calls[step["index"]] = {"name": step["function"]["name"], "arguments": ""}
            calls[step["index"]]["arguments"] += step["function"]["arguments"]
        assert D not in (delta.get("content") or "")
        assert "<think>" not in content
    message = unary["choices"][0]["message"]
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_reasoning_cut_by_max_tokens_stays_reasoning(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    url = await frontend(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", json=chat("THINK-ONLY", max_tokens=3))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"]
    assert "Still thinking about it".startswith(choice["message"]["reasoning_content"])
    assert choice["message"]["content"] == ""


async def test_a_call_cut_by_max_tokens_is_not_returned(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    url = await frontend(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as client:
        whole = (await client.post("/v1/chat/completions", json=chat("FAKE-CALL"))).json()
        tokens = whole["usage"]["completion_tokens"]
        r = await client.post("/v1/chat/completions", json=chat("FAKE-CALL", max_tokens=tokens - 8))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    names = [c["function"]["name"] for c in choice["message"].get("tool_calls") or []]
    assert names == ["get_weather"]  # the second call was cut: not returned


@pytest.mark.parametrize("tool_choice", ["none", None])
async def test_without_tools_offered_a_call_is_text(
    nursery: trio.Nursery, tmp_path: Path, tool_choice: str | None
) -> None:
    """As vLLM's: calls are parsed only for a request that offered tools (and did not
    say tool_choice "none"); the reasoning is parsed either way."""
    url = await frontend(nursery, tmp_path)
    body = chat("FAKE-CALL", thinking=False)
    if tool_choice is None:
        del body["tools"]
    else:
        body["tool_choice"] = tool_choice
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert BLOCK in choice["message"]["content"]


async def test_the_reasoning_field_and_the_parsers_are_options(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    url = await frontend(nursery, tmp_path, reasoning_field="reasoning")
    raw = await frontend(nursery, tmp_path, reasoning_parser="none", tool_call_parser="none")
    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/chat/completions", json=chat("2+2?", thinking=False))
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("Easy.", "It is 4.")
        assert "reasoning_content" not in message
        r = await client.post(raw + "/v1/chat/completions", json=chat("WEATHER-Q"))
        message = r.json()["choices"][0]["message"]
        assert message["content"] == THOUGHT + CALL
        assert "tool_calls" not in message


async def test_completions_stay_raw(nursery: trio.Nursery, tmp_path: Path) -> None:
    url = await frontend(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/completions", json={"model": "deepseek-v4", "prompt": "2+2?"})
    assert r.json()["choices"][0]["text"] == "<think>Easy.</think>It is 4."


def test_an_unknown_parser_is_a_bad_option() -> None:
    from headwater.cli import main

    assert main(["serve", "--tool-call-parser", "nonesuch"]) == 2
