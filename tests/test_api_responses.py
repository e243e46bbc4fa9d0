"""OpenAI's Responses API on headwater: driven by the official ``openai`` SDK's
``client.responses`` (unary, streaming and its stream helper, a function-call loop,
``previous_response_id`` chaining, retrieve and delete, its typed exceptions), the event
stream checked event by event, the translation, the format and the store alone.

Policy: frontends bind 127.0.0.1 port 0 in the test's nursery (frontend_fixture); the
scripted engine answers DeepSeek-V4's real output formats with no delay; scripts are
written to the test's tmp_path. The SDK client has retries off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
import trio
from openai.types.responses import (
    FunctionToolParam,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
)
from openai.types.shared_params import Reasoning, ReasoningEffort

from frontend.http.errors import ApiError
from frontend.http.responses_api.format import ResponsesFormat
from frontend.http.responses_api.models import ResponsesWire
from frontend.http.responses_api.store import ChainBroken, ResponseStore, StoreConfig
from frontend.http.responses_api.translate import decrypt, encrypt, translate
from frontend.http.schema import decode, parse_request
from frontend.limits import RequestLimits
from frontend.pipeline import Delta, Prepared
from frontend.postprocess.parsers import ToolCallDelta
from frontend.request import ParsedRequest
from headwater.wire import SamplingParams
from headwater.wire.tokens import token_array
from workers.engines.scripted import ScriptedConfig

from frontend_fixture import shared_tokenizer, start_frontend
from parser_corpus import BLOCK, BLOCK_END, invoke, param

MODEL = "deepseek-v4"
TOOL: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "strict": None,
}
THOUGHT = "The user asks about the weather, so I call the tool."
CALL = (
    "Let me look.\n\n"
    + BLOCK
    + "\n"
    + invoke("get_weather", [param("city", "Paris"), param("days", 3)])
    + "\n"
    + BLOCK_END
)
SCRIPT = [
    {
        "prompt_contains": "<tool_result>22 degrees",
        "text": "I have it.</think>It is 22 degrees in Paris.",
    },
    {"prompt_contains": "weather in Paris", "text": THOUGHT + "</think>" + CALL},
    {"prompt_contains": "NOTE-EVERY-TURN", "text": "I saw the note."},
    {"prompt_contains": "count to ten", "text": "one two three four five six seven"},
    # Which mode the prompt opened: DeepSeek-V4's maximum effort, thinking, or chat.
    {"prompt_contains": "Reasoning Effort: Absolute maximum", "text": "m</think>MAX"},
    {"prompt_contains": "MODE?<｜Assistant｜><think>", "text": "t</think>THINKING"},
    {"prompt_contains": "MODE?<｜Assistant｜></think>", "text": "CHAT"},
    {"default": True, "text": "Hello! I am a script, not a model."},
]
THINK = {"effort": "high"}


def error_body(error: openai.APIError) -> dict[str, Any]:
    """The JSON error object an API error carried."""
    assert isinstance(error.body, dict)
    return error.body


async def start(nursery: trio.Nursery, tmp_path: Path, **overrides: Any) -> tuple[Any, str]:
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in SCRIPT) + "\n")
    config = ScriptedConfig(script=str(path), token_delay=0.0)
    fe, url, _ = await start_frontend(
        nursery, engine="scripted", engine_config=config, mode="agg", **overrides
    )
    return fe, url


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def prompt_tokens(fe: Any, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    return len(shared_tokenizer().encode_ids(fe.template.render(messages, **kwargs)))


# -- the SDK: unary and streamed ------------------------------------------------------------


async def test_the_sdk_gets_a_response_whose_usage_is_the_prompts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fe, url = await start(nursery, tmp_path)
    async with client(url) as c:
        r = await c.responses.create(
            model=MODEL, input="hi", instructions="Be brief.", metadata={"k": "v"}, user="u1"
        )
        assert r.object == "response"
        assert r.id.startswith("resp_")
        assert r.status == "completed"
        assert r.incomplete_details is None
        assert r.output_text == "Hello! I am a script, not a model."
        [message] = r.output
        assert isinstance(message, ResponseOutputMessage)
        assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
        assert message.id.startswith("msg_")
        # store: not in this SDK's model of a response, read as an extra field.
        assert (r.instructions, r.metadata, r.user, r.store) == (  # type: ignore[attr-defined]
            "Be brief.",
            {"k": "v"},
            "u1",
            True,
        )
        assert r.usage is not None
        assert r.usage.input_tokens == prompt_tokens(
            fe, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
        assert r.usage.output_tokens == len(shared_tokenizer().encode_ids(r.output_text)) + 1
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        # Items as input, the "easy" message (no type) among them.
        again = await c.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        )
        assert again.usage is not None
        assert again.usage.input_tokens == r.usage.input_tokens


async def test_a_stream_is_the_responses_event_sequence(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Event by event: sequence numbers from 0 without a gap, the lifecycle around
    items that are added, filled and done in order, the deltas adding up to the done
    events' text, and every event valid against the published schema."""
    _, url = await start(nursery, tmp_path)
    body = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [TOOL],
        "reasoning": THINK,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=url) as h:
        doc = (await h.get("/openapi.json")).json()
        async with h.stream("POST", "/v1/responses", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
    events = []
    for chunk in raw.split("\n\n"):
        if chunk:
            kind, data = chunk.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            events.append(event)
    validator = jsonschema_rs.Draft202012Validator(
        {"$ref": "#/components/schemas/ResponsesStreamEvent", "components": doc["components"]}
    )
    for e in events:
        assert not [x.message for x in validator.iter_errors(e)], e
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    texts: dict[int, str] = {}
    for e in events[2:-1]:
        index = e.get("output_index")
        if e["type"] == "response.output_item.added":
            assert index == len(texts)
            texts[index] = ""
            assert e["item"]["status"] == "in_progress"
        elif e["type"].endswith(".delta"):
            texts[index] += e["delta"]
            assert e["item_id"] == final["output"][index]["id"]
        elif e["type"] == "response.output_item.done":
            assert e["item"] == final["output"][index]
    reasoning, message, call = final["output"]
    assert texts == {
        0: reasoning["content"][0]["text"],
        1: message["content"][0]["text"],
        2: call["arguments"],
    }
    assert reasoning["content"][0]["text"] == THOUGHT
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": 3}
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


@pytest.mark.slow
async def test_the_sdks_stream_helper_gets_what_a_unary_call_gets(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        ask: dict[str, Any] = {
            "model": MODEL,
            "input": "What is the weather in Paris?",
            "tools": [TOOL],
            "reasoning": THINK,
        }
        unary = await c.responses.create(**ask)
        async with c.responses.stream(**ask) as s:
            deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        assert "".join(deltas) == unary.output_text == final.output_text == "Let me look.\n\n"
        assert [i.type for i in final.output] == [i.type for i in unary.output]
        final_call, unary_call = final.output[2], unary.output[2]
        assert isinstance(final_call, ResponseFunctionToolCall)
        assert isinstance(unary_call, ResponseFunctionToolCall)
        assert final_call.arguments == unary_call.arguments
        streamed = await c.responses.create(**ask, stream=True)
        kinds = [e.type async for e in streamed]
        assert kinds[-1] == "response.completed"
        assert "response.function_call_arguments.done" in kinds


# -- function calls, chaining, the store ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_call_loop_stateless_and_chained(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    """Call, output, answer, three ways: the whole conversation sent back (its
    reasoning as content, or as headwater's encrypted_content), or only the output with
    previous_response_id; the model's prompt is the same each time."""
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:

        async def create(**ask: Any) -> Any:
            ask = {"model": MODEL, "tools": [TOOL], "reasoning": THINK, **ask}
            if not stream:
                return await c.responses.create(**ask)
            async with c.responses.stream(**ask) as s:
                return await s.get_final_response()

        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = await create(input=question, include=["reasoning.encrypted_content"])
        reasoning, _, call = first.output
        assert call.type == "function_call"
        assert call.call_id.startswith("call_")
        assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
        assert decrypt(reasoning.encrypted_content, "x") == THOUGHT
        result = {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": "22 degrees, sunny",
        }

        chained = await create(previous_response_id=first.id, input=[result])
        assert chained.previous_response_id == first.id
        assert chained.output_text == "It is 22 degrees in Paris."
        items = [i.model_dump(exclude_none=True) for i in first.output]
        stateless = await create(input=question + items + [result], store=False)
        assert stateless.output_text == chained.output_text
        assert stateless.usage.input_tokens == chained.usage.input_tokens
        hidden = [{k: v for k, v in items[0].items() if k != "content"}, *items[1:]]
        encrypted = await create(input=question + hidden + [result], store=False)
        assert encrypted.usage.input_tokens == chained.usage.input_tokens
        # Without the reasoning, the prompt is another: the reasoning was rendered.
        bare = await create(input=question + items[1:] + [result], store=False)
        assert bare.usage.input_tokens < chained.usage.input_tokens
        with pytest.raises(openai.NotFoundError):  # store false: not stored
            await c.responses.retrieve(stateless.id)


async def test_stored_responses_are_retrieved_deleted_and_chained_without_instructions(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c, httpx.AsyncClient(base_url=url) as h:
        first = await c.responses.create(model=MODEL, input="hi", instructions="NOTE-EVERY-TURN")
        assert first.output_text == "I saw the note."
        got = await h.get(f"/v1/responses/{first.id}")
        assert got.json() == first.model_dump(mode="json", exclude_unset=True)
        assert (await c.responses.retrieve(first.id)).output_text == first.output_text
        # Instructions are not carried over by previous_response_id, as OpenAI's.
        second = await c.responses.create(
            model=MODEL, input="and now?", previous_response_id=first.id
        )
        assert second.output_text == "Hello! I am a script, not a model."
        third = await c.responses.create(
            model=MODEL,
            input="and now?",
            instructions=("NOTE-EVERY-TURN"),
            previous_response_id=second.id,
        )
        assert third.output_text == "I saw the note."
        # Deleted: gone for GET, DELETE and previous_response_id alike.
        r = await h.delete(f"/v1/responses/{first.id}")
        assert r.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
        for call in (
            c.responses.retrieve(first.id),
            c.responses.delete(first.id),
            c.responses.create(model=MODEL, input="x", previous_response_id=first.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        # A chain whose start is gone cannot be continued, and says why.
        with pytest.raises(openai.NotFoundError, match="no longer stored") as e:
            await c.responses.create(model=MODEL, input="x", previous_response_id=third.id)
        assert error_body(e.value)["param"] == "previous_response_id"
        assert (await c.responses.retrieve(third.id)).id == third.id


async def test_the_store_is_bounded_oldest_first_and_per_process(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path, responses_store=StoreConfig(responses_store_entries=2))
    _, other = await start(nursery, tmp_path)
    async with client(url) as c, client(other) as o:
        ids = [(await c.responses.create(model=MODEL, input=f"hi {i}")).id for i in range(3)]
        with pytest.raises(openai.NotFoundError, match="not found"):
            await c.responses.retrieve(ids[0])
        assert [(await c.responses.retrieve(i)).id for i in ids[1:]] == ids[1:]
        # Another frontend process has a store of its own (docs/api.md says so).
        with pytest.raises(openai.NotFoundError):
            await o.responses.retrieve(ids[2])


# -- limits, options, errors --------------------------------------------------------------------


async def test_max_output_tokens_makes_an_incomplete_response(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        r = await c.responses.create(model=MODEL, input="count to ten", max_output_tokens=3)
        assert r.status == "incomplete"
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        last = r.output[-1]
        assert isinstance(last, ResponseOutputMessage)
        assert last.status == "incomplete"
        assert r.usage is not None
        assert r.usage.output_tokens == 3
        stream = await c.responses.create(
            model=MODEL, input="count to ten", max_output_tokens=3, stream=True
        )
        events = [e async for e in stream]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == r.output_text


async def test_reasoning_effort_picks_deepseeks_mode(nursery: trio.Nursery, tmp_path: Path) -> None:
    fe, url = await start(nursery, tmp_path)
    messages = [{"role": "user", "content": "MODE?"}]
    async with client(url) as c:
        cases: list[tuple[ReasoningEffort | None, dict[str, Any], str]] = [
            ("none", {"thinking": False}, "CHAT"),
            ("minimal", {"thinking": True}, "THINKING"),
            ("high", {"thinking": True}, "THINKING"),
            (None, {}, "CHAT"),
            ("xhigh", {"thinking": True, "reasoning_effort": "max"}, "MAX"),
            ("max", {"thinking": True, "reasoning_effort": "max"}, "MAX"),
        ]
        for effort, kwargs, answer in cases:
            reasoning: Reasoning | None = {"effort": effort} if effort else None
            r = await c.responses.create(model=MODEL, input="MODE?", reasoning=reasoning)
            assert r.output_text == answer, effort
            assert r.usage is not None
            expected = prompt_tokens(fe, messages, chat_template_kwargs=kwargs)
            assert r.usage.input_tokens == expected, effort
            assert r.reasoning is not None
            assert r.reasoning.effort == effort


def cities(r: Response) -> list[str]:
    """The city each of *r*'s output items, all tool calls, asks about."""
    asked = []
    for item in r.output:
        assert isinstance(item, ResponseFunctionToolCall)
        asked.append(json.loads(item.arguments)["city"])
    return asked


async def test_parallel_tool_calls_false_keeps_one_call(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    two = (
        BLOCK
        + "\n"
        + invoke("get_weather", [param("city", "Oslo")])
        + "\n"
        + invoke("get_weather", [param("city", "Rome")])
        + "\n"
        + BLOCK_END
    )
    SCRIPT.insert(0, {"prompt_contains": "two cities", "text": two})
    try:
        _, url = await start(nursery, tmp_path)
    finally:
        SCRIPT.pop(0)
    async with client(url) as c:
        both = await c.responses.create(model=MODEL, input="two cities", tools=[TOOL])
        assert cities(both) == ["Oslo", "Rome"]
        for cap in ({"parallel_tool_calls": False}, {"max_tool_calls": 1}):
            one = await c.responses.create(model=MODEL, input="two cities", tools=[TOOL], **cap)
            assert cities(one) == ["Oslo"]


async def test_what_cannot_be_honoured_is_refused_the_openai_way(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, url = await start(nursery, tmp_path)
    async with client(url) as c:
        bad: list[tuple[dict[str, Any], str]] = [
            (
                {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
                "text.format",
            ),
            (
                {
                    "input": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_image", "image_url": "https://example.com/a.png"}
                            ],
                        }
                    ]
                },
                "input",
            ),
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"tool_choice": "required"}, "tool_choice"),
            # A forced call and a JSON format need constrained decoding, which the
            # scripted engine does not declare.
            ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
            (
                {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
                "tool_choice",
            ),
            ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
            ({"truncation": "auto"}, "truncation"),
            ({"background": True}, "background"),
            ({"include": ["message.output_text.logprobs"]}, "include"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
            (
                {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]},
                "input",
            ),
            ({"temperature": 3}, "temperature"),
        ]
        for extra, field in bad:
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(**{"model": MODEL, "input": "hi", **extra})
            assert error_body(e.value)["param"] == field, (extra, e.value.body)
        with pytest.raises(openai.NotFoundError) as nf:
            await c.responses.create(model="gpt-5", input="hi")
        assert error_body(nf.value)["code"] == "model_not_found"


# -- the translation, the format and the store alone -------------------------------------------


def test_input_items_become_the_templates_conversation() -> None:
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call it."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "22 degrees"},
            {"type": "reasoning", "summary": [], "encrypted_content": encrypt("Now answer.")},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 22.", "annotations": []}],
            },
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "max_output_tokens": 50,
        "temperature": 0.2,
    }
    out = translate(decode(body, ResponsesWire), RequestLimits(), ResponseStore())
    assert out.parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call it.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"},
        {"role": "assistant", "content": "It is 22.", "reasoning_content": "Now answer."},
        {"role": "user", "content": "Thanks"},
    ]
    assert out.turn == out.parsed.messages[1:]  # what is stored: not the instructions
    assert out.parsed.tool_choice == "auto"
    assert out.parsed.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": TOOL["parameters"],
            },
        }
    ]
    assert (out.parsed.sampling.max_tokens, out.parsed.sampling.temperature) == (50, 0.2)
    assert out.echo["tool_choice"] == "auto"


def test_the_store_evicts_oldest_first_by_count_and_by_bytes() -> None:
    store = ResponseStore(StoreConfig(responses_store_entries=3, responses_store_mb=1))
    turn = [{"role": "user", "content": "x"}]
    for i in range(4):
        store.put(f"r{i}", b"{}", f"r{i - 1}" if i else None, turn, 10)
    assert store.get("r0") is None
    assert store.statistics().entries == 3
    assert store.statistics().evicted_total == 1
    with pytest.raises(ChainBroken):
        store.conversation("r3")
    big = b"x" * (600 << 10)
    store.put("a", big, None, turn, 10)
    store.put("b", big, None, turn, 10)  # two of 600 KiB pass 1 MiB: "a" goes
    assert store.get("a") is None
    assert store.get("b") is not None
    assert store.statistics().bytes <= 1 << 20
    store.put("huge", b"x" * (2 << 20), None, turn, 10)  # over the whole bound: not kept
    assert store.get("huge") is None
    assert store.get("b") is not None
    with pytest.raises(KeyError):
        store.conversation("nope")
    with pytest.raises(ValueError, match="responses_store_mb"):
        StoreConfig(responses_store_mb=-1)


def _prep() -> Prepared[Any]:
    return Prepared(
        request_id="abc",
        parsed=ParsedRequest(endpoint="chat", model=MODEL),
        prompt_ids=token_array([1] * 10),
        sampling=SamplingParams(max_tokens=9),
        created=0.0,
        started=0.0,
    )


def test_the_format_makes_items_of_any_deltas_and_hands_the_finished_response_over() -> None:
    deltas = [
        Delta("", 2, reasoning="Think.", cached_tokens=3),
        Delta("Hi", 3, tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a"'),), cached_tokens=3),
        Delta("", 4, tool_calls=(ToolCallDelta(0, arguments=": 1}"),), cached_tokens=3),
        Delta("", 5, finish_reason="tool_calls", cached_tokens=3),
    ]
    done: list[tuple[str, bytes, dict[str, Any]]] = []
    fmt = ResponsesFormat(_prep(), echo={}, on_done=lambda *a: done.append(a))
    response = json.loads(fmt.unary(deltas))
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["arguments"] == '{"a": 1}'
    assert response["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 15,
    }
    [(response_id, body, answer)] = done
    assert response_id == "resp_abc"
    assert json.loads(body) == response
    assert answer == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "Think.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    # Streamed: the same response at the end, and the same hand-over.
    fmt = ResponsesFormat(_prep(), echo={}, on_done=lambda *a: done.append(a))
    raw = b"".join(fmt.event(d) for d in deltas).decode()
    events = [json.loads(c.split("\ndata: ")[1]) for c in raw.split("\n\n") if c]
    assert events[-1]["response"]["output"] == response["output"]
    assert json.loads(done[1][1]) == events[-1]["response"]
    # An error after the start: an error event, then response.failed; nothing stored.
    fmt = ResponsesFormat(_prep(), echo={}, on_done=lambda *a: done.append(a))
    raw = (fmt.event(deltas[0]) + fmt.error(ApiError(503, "busy", code="no_workers"))).decode()
    events = [json.loads(c.split("\ndata: ")[1]) for c in raw.split("\n\n") if c]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "no_workers"
    assert events[-1]["response"]["error"] == {"code": "no_workers", "message": "busy"}
    assert len(done) == 2


def test_forced_calls_and_formats_ask_what_their_chat_equivalents_ask() -> None:
    # `required` and a named function are chat's, text.format json_schema and
    # json_object chat's response_format: the same constraint, the same feature checked
    # against the workers, the same parallel switch.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    base = {"model": "deepseek-v4", "input": "Weather in Paris?"}
    chat = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "x"}]}
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (
            {"tools": [TOOL], "tool_choice": "required"},
            {"tools": [chat_tool], "tool_choice": "required"},
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "parallel_tool_calls": False,
            },
            {
                "tools": [chat_tool],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": False,
            },
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                }
            },
        ),
        (
            {"text": {"format": {"type": "json_object"}}},
            {"response_format": {"type": "json_object"}},
        ),
    ]
    for responses_body, chat_body in cases:
        out = translate(
            decode({**base, **responses_body}, ResponsesWire), RequestLimits(), ResponseStore()
        )
        got, want = out.parsed, parse_request({**chat, **chat_body}, "chat")
        assert got.tool_choice == want.tool_choice, responses_body
        assert got.parallel_tool_calls == want.parallel_tool_calls, responses_body
        assert got.constraint is not None
        assert want.constraint is not None
        assert (got.constraint.kind, got.constraint.schema, got.constraint.tools) == (
            want.constraint.kind,
            want.constraint.schema,
            want.constraint.tools,
        )
        assert [f for f, _ in got.needs] == [f for f, _ in want.needs] == ["structured_outputs"]
    # The response repeats the format it was held to.
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    out = translate(
        decode({**base, "text": {"format": fmt}}, ResponsesWire), RequestLimits(), ResponseStore()
    )
    assert out.echo["text"] == {"format": fmt}
    both = {
        "tools": [TOOL],
        "tool_choice": "required",
        "text": {"format": {"type": "json_object"}},
    }
    with pytest.raises(ApiError, match=r"text\.format"):
        translate(decode({**base, **both}, ResponsesWire), RequestLimits(), ResponseStore())
