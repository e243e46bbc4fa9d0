"""Anthropic's Messages API on headwater: driven by the official ``anthropic`` SDK (unary,
its stream helpers, a tool-use loop, thinking, count_tokens, its typed exceptions), the
event stream checked event by event, the translation and the format checked alone.

Policy: frontends bind 127.0.0.1 port 0 in the test's nursery (frontend_fixture); the
scripted engine answers DeepSeek-V4's real output formats (reasoning, DSML tool calls)
with no delay, so the parse stage and the translation run as in production; scripts are
written to the test's tmp_path. The SDK client has retries off: each error is seen once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema_rs
import pytest
import trio
from anthropic.types import (
    MessageParam,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingConfigParam,
    ToolParam,
    ToolUseBlock,
)

from frontend.errors import LimitExceeded
from frontend.http.anthropic.format import MessagesFormat
from frontend.http.anthropic.models import MessagesRequest
from frontend.http.anthropic.translate import translate
from frontend.http.errors import ApiError
from frontend.http.schema import decode, parse_request
from frontend.limits import RequestLimits
from frontend.pipeline import Delta, Prepared
from frontend.postprocess.parsers import ToolCallDelta
from headwater.wire import SamplingParams
from headwater.wire.tokens import token_array
from workers.engines.scripted import ScriptedConfig

from frontend_fixture import eventually, idle, shared_tokenizer, start_frontend
from parser_corpus import BLOCK, BLOCK_END, invoke, param

MODEL = "deepseek-v4"
WEATHER_TOOL: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CLOCK_TOOL: ToolParam = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
CALL = (
    "Let me look.\n\n"
    + BLOCK
    + "\n"
    + invoke("get_weather", [param("city", "Paris"), param("days", 3)])
    + "\n"
    + BLOCK_END
)
TWO_CALLS = (
    BLOCK
    + "\n"
    + invoke("get_weather", [param("city", "Oslo")])
    + "\n"
    + invoke("get_time", [])
    + "\n"
    + BLOCK_END
)
THOUGHT = "The user asks about the weather, so I call the tool."
SCRIPT = [
    {
        "prompt_contains": "<tool_result>22 degrees",
        "text": "I have the result.</think>It is 22 degrees in Paris.",
    },
    {"prompt_contains": "weather in Paris", "text": THOUGHT + "</think>" + CALL},
    {"prompt_contains": "two tools", "text": TWO_CALLS},
    {"prompt_contains": "count to ten", "text": "one two three four five six seven"},
    {"default": True, "text": "Hello! I am a script, not a model."},
]


async def start(nursery: trio.Nursery, tmp_path: Path, **overrides: Any) -> tuple[Any, str]:
    """A frontend on the scripted engine; its Frontend and base URL."""
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in SCRIPT) + "\n")
    delay = overrides.pop("token_delay", 0.0)
    config = ScriptedConfig(script=str(path), token_delay=delay)
    fe, url, _ = await start_frontend(
        nursery, engine="scripted", engine_config=config, mode="agg", **overrides
    )
    return fe, url


def client(url: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs
    )


def user(text: str) -> list[MessageParam]:
    return [{"role": "user", "content": text}]


def text_of(block: object) -> str:
    """A text block's text (the SDK types content as a union of every block kind)."""
    assert isinstance(block, TextBlock), block
    return block.text


def thinking_of(block: object) -> str:
    assert isinstance(block, ThinkingBlock), block
    return block.thinking


def called(blocks: Sequence[object]) -> list[tuple[str, Any]]:
    """The (name, input) of every tool_use block."""
    out = []
    for block in blocks:
        assert isinstance(block, ToolUseBlock), block
        out.append((block.name, block.input))
    return out


def error_body(error: anthropic.APIStatusError) -> dict[str, Any]:
    assert isinstance(error.body, dict), error.body
    return error.body


# -- the SDK: unary, streaming, count_tokens -----------------------------------------------


async def test_the_sdk_gets_a_message_whose_usage_is_the_prompts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fe, url = await start(nursery, tmp_path)
    async with client(url) as c:
        system: list[TextBlockParam] = [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12"},
            {"type": "text", "text": "Be brief."},
        ]
        m = await c.messages.create(
            model=MODEL,
            max_tokens=64,
            system=system,
            messages=user("hi"),
            metadata={"user_id": "u1"},
        )
        assert m.type == "message"
        assert m.role == "assistant"
        assert m.id.startswith("msg_")
        assert m.model == MODEL
        assert [b.type for b in m.content] == ["text"]
        assert text_of(m.content[0]) == "Hello! I am a script, not a model."
        assert m.stop_reason == "end_turn"
        assert m.stop_sequence is None
        # The prompt is the chat template's render of the translated conversation: the
        # billing header (a per-request hash) left out, so the prefix cache keeps working.
        rendered = fe.template.render(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
        prompt = len(shared_tokenizer().hf.encode(rendered, add_special_tokens=False).ids)
        usage = m.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt
        assert usage.cache_creation_input_tokens == 0
        assert (
            usage.output_tokens
            == len(
                shared_tokenizer().hf.encode(text_of(m.content[0]), add_special_tokens=False).ids
            )
            + 1
        )  # and EOS
        counted = await c.messages.count_tokens(model=MODEL, system=system, messages=user("hi"))
        assert counted.input_tokens == prompt


async def test_the_sdks_stream_helpers_get_what_a_unary_call_gets(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        unary = await c.messages.create(model=MODEL, max_tokens=64, messages=user("hi"))
        async with c.messages.stream(model=MODEL, max_tokens=64, messages=user("hi")) as s:
            text = "".join([t async for t in s.text_stream])
            final = await s.get_final_message()
        assert text == text_of(unary.content[0])
        assert text_of(final.content[0]) == text
        assert final.stop_reason == "end_turn"
        assert final.usage.output_tokens == unary.usage.output_tokens
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
            unary.usage.input_tokens + (unary.usage.cache_read_input_tokens or 0)
        )


async def test_the_event_stream_is_anthropics_sequence(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Event by event: the SSE ``event:`` line names each data's type; thinking, text and
    tool_use blocks each start, fill and stop at their index; message_delta carries the
    stop reason and the final usage; nothing follows message_stop; the document's
    schemas validate every event."""
    _, url = await start(nursery, tmp_path)
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "stream": True,
        "tools": [WEATHER_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": user("What is the weather in Paris?"),
    }
    async with httpx.AsyncClient(base_url=url) as c:
        doc = (await c.get("/openapi.json")).json()
        headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
        async with c.stream("POST", "/v1/messages", json=body, headers=headers) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
    events = []
    for chunk in raw.split("\n\n"):
        if not chunk:
            continue
        kind, data = chunk.split("\n")
        assert kind.startswith("event: "), chunk
        assert data.startswith("data: "), chunk
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        events.append(event)
    schema = {
        "anyOf": [
            {"$ref": f"#/components/schemas/{n}"}
            for n in (
                "MessageStartEvent",
                "ContentBlockStartEvent",
                "ContentBlockDeltaEvent",
                "ContentBlockStopEvent",
                "MessageDeltaEvent",
                "MessageStopEvent",
                "PingEvent",
            )
        ],
        "components": doc["components"],
    }
    validator = jsonschema_rs.Draft202012Validator(schema)
    for e in events:
        assert not [x.message for x in validator.iter_errors(e)], e
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    opening = events[0]["message"]
    assert opening["content"] == []
    assert opening["stop_reason"] is None
    blocks: dict[int, dict[str, Any]] = {}
    open_index: int | None = None
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None, "a block starts while another is open"
            open_index = e["index"]
            assert open_index == len(blocks)
            blocks[open_index] = dict(e["content_block"])
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            block, delta = blocks[e["index"]], e["delta"]
            field = {
                "thinking_delta": "thinking",
                "text_delta": "text",
                "input_json_delta": "partial_json",
            }[delta["type"]]
            block[field] = block.get(field, "") + delta[field]
        else:
            assert e == {"type": "content_block_stop", "index": open_index}
            open_index = None
    assert [b["type"] for b in blocks.values()] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == THOUGHT
    assert blocks[1]["text"] == "Let me look.\n\n"
    assert blocks[2]["name"] == "get_weather"
    assert json.loads(blocks[2]["partial_json"]) == {"city": "Paris", "days": 3}
    final = events[-2]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] > 0


# -- tools and thinking ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_use_loop_with_thinking_through_the_sdk(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    """Call, tool result, final answer: the assistant's turn (thinking and tool_use
    blocks, as the SDK returns them) goes back in the history, its tool_result is
    rendered for the model (the script answers only once it sees it)."""
    fe, url = await start(nursery, tmp_path)
    async with client(url) as c:
        history: list[Any] = user("What is the weather in Paris?")
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 2000,
            "tools": [WEATHER_TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }

        async def turn() -> Any:
            if not stream:
                return await c.messages.create(messages=history, **ask)
            async with c.messages.stream(messages=history, **ask) as s:
                return await s.get_final_message()

        first = await turn()
        assert first.stop_reason == "tool_use"
        assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
        thinking, text, call = first.content
        assert thinking.thinking == THOUGHT
        assert text.text == "Let me look.\n\n"
        assert call.name == "get_weather"
        assert call.input == {"city": "Paris", "days": 3}
        history += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees, sunny"}
                ],
            },
        ]
        second = await turn()
        assert second.stop_reason == "end_turn"
        assert [b.type for b in second.content] == ["thinking", "text"]
        assert text_of(second.content[1]) == "It is 22 degrees in Paris."
        # The rendered history holds the call and its result, in DeepSeek-V4's terms.
        counted = await c.messages.count_tokens(
            model=MODEL, messages=history, tools=[WEATHER_TOOL], thinking=ask["thinking"]
        )
        prompt = fe.template.render(
            translate(
                decode({**ask, "messages": history}, MessagesRequest), RequestLimits()
            ).parsed.messages,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": WEATHER_TOOL["description"],
                        "parameters": WEATHER_TOOL["input_schema"],
                    },
                }
            ],
            chat_template_kwargs={"thinking": True},
        )
        assert "<tool_result>22 degrees, sunny</tool_result>" in prompt
        assert 'invoke name="get_weather"' in prompt
        assert THOUGHT in prompt  # with tools, earlier reasoning stays in the prompt
        assert prompt.endswith("<think>")  # thinking mode: the answer starts as reasoning
        assert counted.input_tokens == len(shared_tokenizer().encode_ids(prompt))


async def test_thinking_switches_deepseeks_thinking_mode(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fe, url = await start(nursery, tmp_path)
    async with client(url) as c:
        messages = user("hi")
        counts = {}
        for name, thinking in (
            ("on", {"type": "enabled", "budget_tokens": 1024}),
            ("adaptive", {"type": "adaptive"}),
            ("between", {"type": "between_tools"}),
            ("off", {"type": "disabled"}),
            ("unsaid", None),
        ):
            extra: dict[str, Any] = {"thinking": thinking} if thinking else {}
            counted = await c.messages.count_tokens(model=MODEL, messages=messages, **extra)
            counts[name] = counted.input_tokens
        on = fe.template.render(messages, chat_template_kwargs={"thinking": True})
        off = fe.template.render(messages, chat_template_kwargs={"thinking": False})
        assert on != off
        tok = shared_tokenizer()
        assert counts["on"] == counts["adaptive"] == counts["between"] == len(tok.encode_ids(on))
        assert counts["off"] == counts["unsaid"] == len(tok.encode_ids(off))
        # The answer to a thinking prompt starts as reasoning: a thinking block.
        m = await c.messages.create(
            model=MODEL,
            max_tokens=2000,
            messages=user("weather in Paris"),
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
        assert isinstance(m.content[0], ThinkingBlock)
        assert m.content[0].thinking == THOUGHT
        assert m.content[0].signature == ""
        # display "omitted": the block is there, its text is not.
        hidden: ThinkingConfigParam = {
            "type": "enabled",
            "budget_tokens": 1024,
            "display": "omitted",
        }
        m = await c.messages.create(
            model=MODEL, max_tokens=2000, thinking=hidden, messages=user("weather in Paris")
        )
        assert thinking_of(m.content[0]) == ""
        async with c.messages.stream(
            model=MODEL, max_tokens=2000, thinking=hidden, messages=user("weather in Paris")
        ) as s:
            final = await s.get_final_message()
        assert thinking_of(final.content[0]) == ""
        assert text_of(final.content[1]) == text_of(m.content[1])


async def test_disable_parallel_tool_use_keeps_the_first_call(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 500,
            "messages": user("two tools"),
            "tools": [WEATHER_TOOL, CLOCK_TOOL],
        }
        both = await c.messages.create(**ask)
        assert called(both.content) == [
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {}),
        ]
        assert len({b.id for b in both.content}) == 2
        one = await c.messages.create(
            **ask, tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        )
        assert called(one.content) == [("get_weather", {"city": "Oslo"})]
        assert one.stop_reason == "tool_use"
        async with c.messages.stream(
            **ask, tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        ) as s:
            final = await s.get_final_message()
        assert called(final.content) == [("get_weather", {"city": "Oslo"})]


async def test_stop_sequences_and_max_tokens_are_the_stop_reasons(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        ask: dict[str, Any] = {"model": MODEL, "messages": user("count to ten")}
        m = await c.messages.create(max_tokens=100, stop_sequences=["six", "four"], **ask)
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "four")
        assert m.content[0].text == "one two three "
        async with c.messages.stream(max_tokens=100, stop_sequences=["five"], **ask) as s:
            final = await s.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "five")
        m = await c.messages.create(max_tokens=2, **ask)
        assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
        assert m.usage.output_tokens == 2


# -- errors ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_errors_are_the_sdks_typed_exceptions(nursery: trio.Nursery, tmp_path: Path) -> None:
    fe, url = await start(
        nursery, tmp_path, api_keys=("k1",), max_body_bytes=1 << 20, max_inflight=1
    )
    ok: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": user("hi")}
    async with client(url, api_key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await c.messages.create(**ok)
        assert error_body(auth.value)["error"]["type"] == "authentication_error"
    # The key as x-api-key (what the SDK sends) or as a bearer token (ANTHROPIC_AUTH_TOKEN).
    async with client(url, api_key="k1") as c:
        assert (await c.messages.create(**ok)).stop_reason == "end_turn"
    async with client(url, api_key=None, auth_token="k1") as c:
        assert (await c.messages.create(**ok)).stop_reason == "end_turn"
    async with client(url, api_key="k1") as c:
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # required
            await c.post(
                "/v1/messages",
                cast_to=anthropic.types.Message,
                body={"model": MODEL, "messages": user("hi")},
            )
        bad: list[dict[str, Any]] = [
            {**ok, "messages": []},
            {
                **ok,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBORw0KGgo=",
                                },
                            }
                        ],
                    }
                ],
            },
            {**ok, "thinking": {"type": "enabled", "budget_tokens": 1024}},  # >= max_tokens
            {**ok, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
            {**ok, "tool_choice": {"type": "any"}},  # and no tools
            # A forced call needs constrained decoding, top_k a top-k sampler: the
            # scripted engine declares neither.
            {**ok, "tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}},
            {**ok, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}},
            {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            {**ok, "extra_body": {"top_k": 5}},
            {**ok, "extra_body": {"temperature": 1.5}},
        ]
        for body in bad:
            with pytest.raises(anthropic.BadRequestError) as err:
                await c.messages.create(**body)
            assert error_body(err.value)["type"] == "error"
            assert error_body(err.value)["error"]["type"] == "invalid_request_error", body
            assert error_body(err.value)["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match="text-only model"):
            await c.messages.create(**bad[1])
        with pytest.raises(anthropic.NotFoundError) as nf:
            await c.messages.create(**{**ok, "model": "claude-sonnet-4-5"})
        assert error_body(nf.value)["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.ContentTooLargeError) as big:
            await c.messages.create(**{**ok, "messages": user("x" * (2 << 20))})
        assert error_body(big.value)["error"]["type"] == "request_too_large"
        # At --max-inflight: 429; draining: 529, Anthropic's overloaded.
        await eventually(idle(fe))
        assert fe.admission.admit() is None
        try:
            with pytest.raises(anthropic.RateLimitError) as limited:
                await c.messages.create(**ok)
            assert error_body(limited.value)["error"]["type"] == "rate_limit_error"
        finally:
            fe.admission.release()
        fe.admission.drain()
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            await c.messages.create(**ok)
        assert error_body(overloaded.value)["error"]["type"] == "overloaded_error"
        with pytest.raises(anthropic.OverloadedError):
            await c.messages.count_tokens(model=MODEL, messages=user("hi"))


@pytest.mark.slow
async def test_a_deadline_is_a_504_timeout_error_or_an_error_event(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(
        nursery, tmp_path, token_delay=0.2, limits=RequestLimits(request_timeout=0.5)
    )
    async with client(url) as c:
        with pytest.raises(anthropic.GatewayTimeoutError) as late:
            await c.messages.create(model=MODEL, max_tokens=64, messages=user("hi"))
        assert error_body(late.value)["error"]["type"] == "timeout_error"
    # Mid-stream, the error is an `error` event in Anthropic's shape (which the SDK
    # raises as an APIStatusError), and the stream ends there.
    async with httpx.AsyncClient(base_url=url) as h:
        body = {"model": MODEL, "max_tokens": 64, "messages": user("hi"), "stream": True}
        async with h.stream("POST", "/v1/messages", json=body) as r:
            raw = (await r.aread()).decode()
    last = raw.rstrip("\n").rsplit("\n\n", 1)[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ", 1)[1]) == {
        "type": "error",
        "error": {
            "type": "timeout_error",
            "message": "The request did not complete within this server's limit of 0.5 seconds",
        },
    }
    assert raw.startswith("event: message_start")


async def test_other_routes_keep_openais_error_shape(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, url = await start(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/chat/completions", json={"model": "nope", "messages": user("hi")})
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await c.post(
            "/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": user("hi")}
        )
        assert r.status_code == 404
        assert r.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model 'nope' does not exist"},
        }
        r = await c.get("/v1/messages/batches")  # an unknown path under the API: its shape
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        # Claude Code's form of the path: a query string, and the beta header.
        r = await c.post(
            "/v1/messages?beta=true",
            json={"model": MODEL, "max_tokens": 4, "messages": user("hi")},
            headers={"anthropic-beta": "x-2025"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["type"] == "message"
        r = await c.post("/v1/messages", content=b"hi")  # not JSON: Anthropic's 400
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"


# -- the translation and the format alone ----------------------------------------------


def test_tool_use_and_tool_result_blocks_become_the_templates_calls_and_results() -> None:
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "t2",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "22 degrees"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no station"}],
                    },
                    {
                        "type": "text",
                        "text": "And tomorrow?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "auto"},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"user_id": "u"},
    }
    out = translate(decode(body, MessagesRequest), RequestLimits())
    p = out.parsed
    assert p.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "t2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "22 degrees"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no station"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert p.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER_TOOL["input_schema"],
            },
        }
    ]
    assert p.tool_choice == "auto"
    assert out.max_tool_calls is None
    assert (p.stop, p.user, p.stream) == (("END",), "u", False)
    assert (p.sampling.max_tokens, p.sampling.temperature, p.sampling.top_p) == (100, 0.5, 0.9)
    assert p.chat_template_kwargs == {}
    # What DeepSeek-V4's template makes of it: DSML calls, both results in one user turn.
    from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate

    text = DeepSeekV4ChatTemplate().render(p.messages, tools=p.tools)
    assert "<tool_result>22 degrees</tool_result>\n\n<tool_result>Error: no station" in text
    assert text.count('invoke name="get_weather"') == 2


def test_limits_apply_to_the_translated_conversation() -> None:
    ok = {"model": MODEL, "max_tokens": 10, "messages": user("hi")}
    with pytest.raises(LimitExceeded, match="max_tokens"):
        translate(
            decode({**ok, "max_tokens": 100}, MessagesRequest), RequestLimits(max_tokens_cap=50)
        )
    limited = RequestLimits(max_messages=1, max_prompt_chars=10, max_stop_strings=1)
    for body, field, limit in (
        ({**ok, "messages": user("a") * 2}, "messages", "max_messages"),
        ({**ok, "messages": user("x" * 11)}, "messages", "max_prompt_chars"),
        ({**ok, "stop_sequences": ["a", "b"]}, "stop_sequences", "max_stop_strings"),
    ):
        with pytest.raises(LimitExceeded) as e:
            translate(decode(body, MessagesRequest), limited)
        assert (e.value.param, e.value.limit) == (field, limit)


def _prep() -> Prepared[Any]:
    from frontend.request import ParsedRequest

    return Prepared(
        request_id="abc",
        parsed=ParsedRequest(endpoint="chat", model=MODEL),
        prompt_ids=token_array([1] * 10),
        sampling=SamplingParams(max_tokens=9),
        created=0.0,
        started=0.0,
    )


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for chunk in data.decode().split("\n\n"):
        if chunk:
            kind, payload = chunk.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            out.append(event)
    return out


def test_the_format_makes_blocks_of_any_deltas() -> None:
    """Hand-written deltas (what the parse stage yields): reasoning, then text, then two
    calls whose arguments come in fragments; the stream's events and the unary Message
    say the same, and the usage splits the prompt into cached and not."""
    deltas = [
        Delta("", 1, reasoning="Think", cached_tokens=4),
        Delta("", 2, reasoning="ing.", cached_tokens=4),
        Delta("Hi ", 3, reasoning="", cached_tokens=4),
        Delta("there", 4, tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a": '),), cached_tokens=4),
        Delta(
            "",
            5,
            tool_calls=(ToolCallDelta(0, arguments="1}"), ToolCallDelta(1, "call_2", "g", "{}")),
            cached_tokens=4,
        ),
        Delta("", 6, finish_reason="tool_calls", cached_tokens=4),
    ]
    message = json.loads(MessagesFormat(_prep()).unary(deltas))
    assert message["content"] == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""},
        {"type": "text", "text": "Hi there"},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "call_2", "name": "g", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 6,
        "output_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    fmt = MessagesFormat(_prep())
    events = _events(b"".join(fmt.event(d) for d in deltas))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 4
    assert events[-2]["usage"] == message["usage"]
    # One call only (disable_parallel_tool_use): the second call is not in the answer.
    one = json.loads(MessagesFormat(_prep(), max_tool_calls=1).unary(deltas))
    assert [b.get("name") for b in one["content"]] == [None, None, "f"]


def test_an_empty_answer_is_one_empty_text_block_and_errors_are_events() -> None:
    last = Delta("", 1, finish_reason="length")
    assert json.loads(MessagesFormat(_prep()).unary([last]))["content"] == [
        {"type": "text", "text": ""}
    ]
    events = _events(MessagesFormat(_prep()).event(last))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert _events(MessagesFormat(_prep()).error(ApiError(503, "busy"))) == [
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    ]


def test_forced_calls_and_formats_ask_what_their_chat_equivalents_ask() -> None:
    # `any` and `tool` are chat's `required` and named function, `output_config.format`
    # chat's json_schema response_format, `top_k` chat's: the same constraint, the same
    # feature checked against the workers, the same parallel switch.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    base = {"model": MODEL, "max_tokens": 64, "messages": user("Weather in Paris?")}
    chat = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}},
            {"tools": [chat_tool], "tool_choice": "required"},
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {
                    "type": "tool",
                    "name": "get_weather",
                    "disable_parallel_tool_use": True,
                },
            },
            {"tools": [chat_tool], "tool_choice": named, "parallel_tool_calls": False},
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                }
            },
        ),
        ({"top_k": 5}, {"top_k": 5}),
    ]
    for messages_body, chat_body in cases:
        got = translate(decode({**base, **messages_body}, MessagesRequest), RequestLimits()).parsed
        want = parse_request({**chat, **chat_body}, "chat")
        assert got.tool_choice == want.tool_choice, messages_body
        assert got.parallel_tool_calls == want.parallel_tool_calls, messages_body
        assert got.sampling.top_k == want.sampling.top_k
        if want.constraint is None:
            assert got.constraint is None
        else:
            assert got.constraint is not None
            assert (got.constraint.kind, got.constraint.schema, got.constraint.tools) == (
                want.constraint.kind,
                want.constraint.schema,
                want.constraint.tools,
            )
        assert [f for f, _ in got.needs] == [f for f, _ in want.needs], messages_body
    # A forced call and a format at once: refused, as chat refuses them.
    both = {
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any"},
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    with pytest.raises(ApiError, match=r"output_config\.format"):
        translate(decode({**base, **both}, MessagesRequest), RequestLimits())
    bad = {"output_config": {"format": {"type": "regex", "pattern": "x"}}}
    with pytest.raises(ApiError, match="json_schema"):
        translate(decode({**base, **bad}, MessagesRequest), RequestLimits())
    # null is absent, as Anthropic's SDK may send it
    none = {"output_config": {"format": None}}
    assert (
        translate(decode({**base, **none}, MessagesRequest), RequestLimits()).parsed.constraint
        is None
    )
