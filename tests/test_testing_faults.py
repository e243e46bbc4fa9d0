"""headwater.testing's faults, each met through the OpenAI SDK, and its records.

Policy: every server runs in-process in the test's own trio run (no socket), on the
scripted engine, under ``autojump_clock`` unless a test says otherwise: a fault's
timing is asserted exactly in virtual time, and a second run of a scenario must give
the same records. The SDK keeps its own retry behaviour (``max_retries``) where the
test observes it.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import openai
import pytest
import trio
import trio.testing
from openai.types.chat import ChatCompletionMessageParam

from headwater.testing import Headwater, HeadwaterServer, open_server

MODEL = "deepseek-v4"
DELAY = 0.25  # the scripted engine's seconds per token

DSML = "｜DSML｜"
CALL = (
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>"
)
STORY = "Once upon a time a small river ran to the sea, and it never stopped."
SCRIPT: list[dict[str, Any]] = [
    {"prompt_contains": "weather", "text": CALL},
    {"default": True, "text": STORY},
]
TOOLS: list[Any] = [
    {
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
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
pytestmark = pytest.mark.headwater(script=SCRIPT, token_delay=DELAY)


def tokens(server: HeadwaterServer, text: str) -> int:
    """Tokens of an answer of *text*: its own and the EOS."""
    return len(server.frontend.tokenizer.encode_ids(text)) + 1


async def stream_text(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[str, list[float]]:
    """A streamed chat answer's content and the trio time each content piece arrived."""
    stream = await client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs)
    parts, times = [], []
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
                    times.append(trio.current_time())
    return "".join(parts), times


# -- records ------------------------------------------------------------------------------


async def test_a_request_is_recorded_as_the_frontend_saw_it(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    client = server.openai_client()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the weather in Paris?"}
    ]
    r = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    (record,) = server.requests
    assert (record.method, record.path, record.status) == ("POST", "/v1/chat/completions", 200)
    assert record.body["messages"] == messages
    assert record.body["tools"] == TOOLS
    assert record.headers["authorization"] == "Bearer unused"
    assert record.request_id is not None
    assert all(leg.request_id.startswith(record.request_id) for leg in record.legs)
    assert record.workers == ["local-prefill-0", "local-decode-1"]
    assert [leg.role for leg in record.legs] == ["prefill", "decode"]
    assert [leg.outcome for leg in record.legs] == ["finished", "finished"]
    assert record.attempt == 1
    assert record.tokens == tokens(server, CALL)
    assert record.finish_reason == "stop"  # the engine's; the API's is tool_calls
    assert record.json()["choices"][0]["message"]["tool_calls"][0]["id"] == call.id
    # One token per DELAY, on trio's clock: the whole answer took exactly that long.
    decode = record.legs[1]
    assert decode.ended is not None
    assert decode.ended - decode.started == pytest.approx(record.tokens * DELAY)
    assert (
        server.metric("requests_total", endpoint="chat", request_type="unary", status="success")
        == 1
    )


async def test_the_same_scenario_gives_the_same_records_twice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def scenario() -> list[Any]:
        async with open_server(script=SCRIPT, token_delay=DELAY) as server:
            start = trio.current_time()
            server.faults.break_stream(after_tokens=4)
            server.faults.reject()
            text, times = await stream_text(server.openai_client())
            await server.openai_client().chat.completions.create(model=MODEL, messages=ASK)
            return [
                text,
                [t - start for t in times],
                [
                    (
                        r.status,
                        r.started - start,
                        r.faults,
                        [
                            (leg.worker_id, leg.outcome, leg.tokens, leg.started - start)
                            for leg in r.legs
                        ],
                    )
                    for r in server.requests
                ],
            ]

    first = await scenario()
    assert first[0] == STORY
    assert await scenario() == first


# -- a broken stream, a malformed answer, a killed worker: migrations ---------------------


@pytest.mark.parametrize("fault", ["break_stream", "malformed_answer"])
async def test_a_broken_or_malformed_stream_migrates_and_the_sdk_sees_one_answer(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock, fault: str
) -> None:
    server = headwater_server
    getattr(server.faults, fault)(after_tokens=5)
    text, _ = await stream_text(server.openai_client(max_retries=0))
    assert text == STORY  # no token twice, none missing
    record = server.requests[-1]
    assert record.attempt == 2
    assert record.faults == [fault]
    first, again = record.generated
    assert (first.outcome, first.tokens, first.faults) == (
        "broken" if fault == "break_stream" else "malformed",
        5,
        [fault],
    )
    assert (again.outcome, again.request_id) == ("finished", f"{first.request_id}.m1")
    assert record.tokens == tokens(server, STORY)
    assert server.metric("model_migration_total", migration_type="ongoing_request") == 1
    assert server.faults.armed == []


async def test_the_choices_of_one_request_share_its_fault(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.break_stream(after_tokens=3)
    r = await server.openai_client(max_retries=0).chat.completions.create(
        model=MODEL, messages=ASK, n=2
    )
    assert [c.message.content for c in r.choices] == [STORY, STORY]
    await server.settled()
    (record,) = server.requests
    assert record.faults == ["break_stream"]
    assert [leg.outcome for leg in record.generated].count("broken") == 1
    assert record.attempt == 2
    assert record.tokens == 2 * tokens(server, STORY)


async def test_a_worker_killed_mid_stream_leaves_and_its_request_migrates(
    headwater: Headwater, autojump_clock: trio.testing.MockClock
) -> None:
    server = await headwater.start(workers=["prefill", "decode", "decode"])
    assert sorted(server.workers) == ["local-decode-1", "local-decode-2", "local-prefill-0"]
    server.faults.kill_worker(after_tokens=3)
    text, _ = await stream_text(server.openai_client(max_retries=0))
    assert text == STORY
    record = server.requests[-1]
    killed, again = record.generated
    assert (killed.outcome, killed.tokens) == ("killed", 3)
    assert again.worker_id != killed.worker_id
    assert record.attempt == 2
    assert killed.worker_id not in server.workers
    assert server.cluster.killed == [killed.worker_id]
    # The next request goes to the one decode worker left.
    r = await server.openai_client().chat.completions.create(model=MODEL, messages=ASK)
    assert r.choices[0].message.content == STORY
    assert server.requests[-1].generated[0].worker_id == again.worker_id


# -- refusals: by the workers (503), by admission (429 with Retry-After) -------------------


async def test_workers_that_refuse_give_a_503_that_the_sdk_retries(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.refuse()
    start = trio.current_time()
    r = await server.openai_client().chat.completions.create(model=MODEL, messages=ASK)
    assert r.choices[0].message.content == STORY
    await server.settled()
    refused, served = server.requests
    assert refused.status == 503
    assert refused.json()["error"]["code"] == "no_workers"
    assert [(leg.role, leg.outcome) for leg in refused.legs] == [("prefill", "refused")]
    # The frontend waited queue_timeout for another prefill worker before it answered.
    queue_timeout = server.frontend.config.queue_timeout
    assert refused.ended == pytest.approx(start + queue_timeout)
    assert refused.ended is not None
    # Then the SDK's own backoff (0.5 s, less up to a quarter of jitter), and success.
    assert 0.375 <= served.started - refused.ended <= 0.5
    assert served.status == 200


async def test_only_the_worker_named_refuses_and_another_serves(
    headwater: Headwater, autojump_clock: trio.testing.MockClock
) -> None:
    server = await headwater.start(workers=["agg", "agg"])
    server.faults.refuse(worker="local-agg-0", times=2)
    client = server.openai_client(max_retries=0)
    for _ in range(2):  # round-robin: one of the two goes to local-agg-0 first
        r = await client.chat.completions.create(model=MODEL, messages=ASK)
        assert r.choices[0].message.content == STORY
    legs = [leg for record in server.requests for leg in record.legs]
    assert {leg.outcome for leg in legs if leg.worker_id == "local-agg-0"} == {"refused"}
    assert {leg.outcome for leg in legs if leg.worker_id == "local-agg-1"} == {"finished"}
    assert any(leg.request_id.endswith(".r1") for leg in legs)


async def test_admission_answers_429_with_retry_after_and_the_sdk_waits_it(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.reject(times=2)
    with pytest.raises(openai.RateLimitError) as refused:
        await server.openai_client(max_retries=0).chat.completions.create(model=MODEL, messages=ASK)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == "rate_limit_exceeded"
    r = await server.openai_client().chat.completions.create(model=MODEL, messages=ASK)
    assert r.choices[0].message.content == STORY
    _, rejected, served = server.requests
    assert [x.status for x in server.requests] == [429, 429, 200]
    assert rejected.faults == ["reject"]
    assert served.faults == []
    assert rejected.legs == []  # refused before any work
    # The SDK slept exactly Retry-After, in virtual time.
    assert served.started - rejected.started == pytest.approx(1.0, abs=1e-9)
    assert server.metric("rejected_requests_total", reason="max_inflight") == 2


# -- timing: a slow first token, a stalled loop --------------------------------------------


async def test_a_slow_first_token_delays_the_stream_exactly(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.slow_first_token(30)
    start = trio.current_time()
    text, times = await stream_text(server.openai_client())
    assert text == STORY
    assert times[0] - start == pytest.approx(DELAY + 30)
    assert server.requests[-1].generated[0].faults == ["slow_first_token"]


async def test_the_sdk_times_out_on_a_slow_first_token_and_retries(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.slow_first_token(60)
    client = server.openai_client(timeout=10, max_retries=1)
    r = await client.chat.completions.create(model=MODEL, messages=ASK)
    assert r.choices[0].message.content == STORY
    await server.settled()
    left, served = server.requests
    assert left.status is None  # no head before the client gave up
    assert left.generated[0].outcome == "cancelled"  # the frontend cancelled it on the worker
    assert served.started - left.started == pytest.approx(10, abs=0.5)  # + the SDK's backoff
    assert server.metric("disconnected_clients_total") == 1


async def test_a_loop_stall_is_seen_by_the_frontend_and_delays_the_stream(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    server = headwater_server
    server.faults.stall_loop(5, after_tokens=3)
    text, times = await stream_text(server.openai_client())
    assert text == STORY
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) == pytest.approx(5, abs=DELAY)  # the stall, between the 3rd and 4th
    ((start, end),) = server.stalls
    assert 4.9 <= end - start <= 5  # the canary ticks every 0.1 s in virtual time
    assert server.metric("event_loop_stall_total") == 1


async def test_a_real_loop_stall_is_recorded_by_the_stall_detector() -> None:
    # The real clock: the stall detector's watchdog thread runs, and names the culprit.
    async with open_server(script=SCRIPT, token_delay=0.001) as server:
        assert not server.virtual_time
        r = await server.openai_client().chat.completions.create(model=MODEL, messages=ASK)
        assert r.choices[0].message.content == STORY
        started = time.perf_counter()
        server.faults.stall_loop(0.2)
        assert time.perf_counter() - started >= 0.2
        with trio.fail_after(10):
            while not server.stall_records:
                await trio.sleep(0.01)
        (record,) = server.stall_records
        assert record.cause == "loop"
        assert record.duration_s >= 0.2
        assert "stall" in "".join(record.stack)
