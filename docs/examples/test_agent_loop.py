"""An agent loop with tools, tested against headwater on the scripted engine.

The agent is ordinary OpenAI-SDK code: ask, run the tools the model calls, send their
results back, until the model answers in words. The script plays DeepSeek-V4: its
answers are the model's own tool-call markup (DSML), which headwater's parser turns
into OpenAI ``tool_calls``, as it does for the real model. docs/testing.md explains
the fixtures.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio.testing

from headwater.testing import Headwater, HeadwaterServer

pytestmark = pytest.mark.trio  # not needed with trio_mode = true

MODEL = "deepseek-v4"
DSML = "｜DSML｜"


def tool_call(name: str, **arguments: str) -> str:
    """What DeepSeek-V4 writes to call a tool: DSML markup."""
    params = "".join(
        f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>\n'
        for key, value in arguments.items()
    )
    return (
        f'<{DSML}tool_calls>\n<{DSML}invoke name="{name}">\n{params}'
        f"</{DSML}invoke>\n</{DSML}tool_calls>"
    )


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
#: The tool's result comes back in a later prompt (DeepSeek-V4 writes it in a
#: <tool_result> block): that rule first, since the question is in that prompt too.
SCRIPT = [
    {"prompt_contains": "<tool_result>", "text": "It is 22 degrees and sunny in Paris."},
    {"prompt_contains": "weather", "text": tool_call("get_weather", city="Paris")},
    {"default": True, "text": "I can only tell you about the weather."},
]


class TooManySteps(Exception):
    pass


async def run_agent(
    client: openai.AsyncOpenAI, question: str, tools: dict[str, Any], max_steps: int = 5
) -> tuple[str, list[str]]:
    """The agent under test: its final answer and the tools it ran, in order."""
    messages: list[Any] = [{"role": "user", "content": question}]
    schemas = [WEATHER_TOOL]
    ran: list[str] = []
    for _ in range(max_steps):
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=schemas
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content or "", ran
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            name = call.function.name  # type: ignore[union-attr]
            arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
            ran.append(name)
            result = tools[name](**arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise TooManySteps(f"no answer after {max_steps} steps")


def weather(city: str) -> str:
    return f"22 degrees, sunny in {city}"


@pytest.mark.headwater(script=SCRIPT)
async def test_the_agent_calls_the_tool_and_answers(headwater_server: HeadwaterServer) -> None:
    # No clock fixture: real time, and the scripted engine's default pace (1 ms a token).
    answer, ran = await run_agent(
        headwater_server.openai_client(),
        "What is the weather in Paris?",
        {"get_weather": weather},
    )
    assert answer == "It is 22 degrees and sunny in Paris."
    assert ran == ["get_weather"]
    # What the model was sent on its second turn: the tool's result.
    second = headwater_server.requests[1].body
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": second["messages"][-2]["tool_calls"][0]["id"],
        "content": "22 degrees, sunny in Paris",
    }


async def test_a_broken_stream_does_not_reach_the_agent(
    headwater: Headwater, autojump_clock: trio.testing.MockClock
) -> None:
    server = await headwater.start(script=SCRIPT)
    server.faults.break_stream(after_tokens=5)  # the first answer's stream breaks
    answer, ran = await run_agent(
        server.openai_client(), "What is the weather in Paris?", {"get_weather": weather}
    )
    assert ran == ["get_weather"]
    assert answer == "It is 22 degrees and sunny in Paris."
    # headwater moved the broken request to another attempt: the agent never knew.
    assert server.requests[0].attempt == 2
    assert server.requests[1].attempt == 1


async def test_the_agent_gives_up_on_a_model_that_only_calls_tools(
    headwater: Headwater, autojump_clock: trio.testing.MockClock
) -> None:
    server = await headwater.start(
        script=[{"default": True, "text": tool_call("get_weather", city="Paris")}]
    )
    with pytest.raises(TooManySteps):
        await run_agent(server.openai_client(), "Weather?", {"get_weather": weather}, max_steps=3)
    assert len(server.requests) == 3
