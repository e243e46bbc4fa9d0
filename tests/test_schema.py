"""Request validation without a server: the models (frontend/http/models.py), the errors'
``param``, the request limits (frontend/limits.py) and the per-request deadline.

Policy: pure functions, except the deadline's tests, which run on trio's virtual clock
(``autojump_clock``) and assert exact times.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import orjson
import pytest
import trio

from frontend.deadline import Deadline
from frontend.errors import LimitExceeded, RequestTimeout
from frontend.http.errors import ApiError
from frontend.http.models import CompletionRequest
from frontend.http.schema import parse_generate_request, parse_request, validation_error
from frontend.limits import RequestLimits
from frontend.request import SamplingOptions
from scripts.bench.prompts import WORDS

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, **fields}


def _refusal(body: Any, endpoint: str = "chat", limits: RequestLimits | None = None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_request(body, endpoint, limits or RequestLimits())
    assert caught.value.status == 400
    return caught.value


# -- msgspec's error text, as the parser reads it -----------------------------------------


class Inner(msgspec.Struct):
    n: int


class Outer(msgspec.Struct):
    inner: Inner
    items: list[Inner]
    mapping: dict[str, int]


@pytest.mark.parametrize(
    ("body", "param", "where"),
    [
        ({"messages": CHAT}, "model", "'model' is required"),  # missing at the root
        (_chat(max_tokens="5"), "max_tokens", "'max_tokens'"),
        (
            _chat(stream_options={"include_usage": 1}),
            "stream_options.include_usage",
            "'stream_options.include_usage'",
        ),
        (_chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "'messages[0].role'"),
        (
            _chat(messages=[CHAT[0], {"role": "user"}]),
            "messages",
            "'messages[1].content' is required",
        ),  # missing below an index
        (_chat(stop=["a", ""]), "stop", "'stop[1]'"),
        (
            _chat(chat_template_kwargs={"a": {"b": 1}}, tools=[{"function": {}}]),
            "tools",
            "'tools[0].function.name' is required",
        ),
    ],
)
def test_a_validation_error_names_the_field_and_the_exact_place(
    body: dict[str, Any], param: str, where: str
) -> None:
    err = _refusal(body)
    assert err.param == param
    assert where in err.message
    assert err.type == "invalid_request_error"


def test_the_error_text_of_msgspec_is_the_one_the_parser_reads() -> None:
    """msgspec formats its errors as text; the parser depends on the format (pinned
    here, so that an upgrade that changes it fails in this test)."""

    def err(obj: Any) -> ApiError:
        with pytest.raises(msgspec.ValidationError) as caught:
            msgspec.convert(obj, Outer)
        return validation_error(caught.value)

    ok = {"inner": {"n": 1}, "items": [{"n": 1}], "mapping": {"a": 1}}
    assert err({**ok, "inner": {"n": "1"}}).param == "inner.n"
    assert err({**ok, "items": [{"n": 1}, {}]}).param == "items"
    assert "'items[1].n' is required" in err({**ok, "items": [{"n": 1}, {}]}).message
    assert err({**ok, "mapping": {"a": "b"}}).param == "mapping"
    assert err({**ok, "mapping": {1: 1}}).param == "mapping"  # a key
    assert err({"items": [], "mapping": {}}).param == "inner"
    assert err([]).message == "the request body must be a JSON object"


# -- strict types, lenient fields ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", True),
        ("max_tokens", "5"),
        ("max_tokens", 1.5),
        ("seed", "7"),
        ("temperature", "1"),
        ("temperature", True),
        ("stream", 1),
        ("stop", 3),
        ("n", 1.0),
        ("n", 129),
        ("top_p", 1.01),
        ("presence_penalty", -3),
        ("logprobs", 1),
        ("top_logprobs", -1),
    ],
)
def test_types_are_strict(field: str, value: Any) -> None:
    assert _refusal(_chat(**{field: value})).param == field


def test_an_infinite_number_is_out_of_range() -> None:
    body = orjson.dumps(_chat()).replace(b'"messages"', b'"temperature": 1e999, "messages"')
    assert _refusal(body).param == "temperature"


def test_unknown_fields_pass_and_an_integer_is_a_number() -> None:
    parsed = parse_request(
        _chat(
            temperature=1,
            top_p=0,
            tool_choice="auto",
            x={"y": [1]},
            max_tokens=None,
            logprobs=False,
        ),
        "chat",
    )
    assert parsed.sampling == SamplingOptions(temperature=1.0, top_p=0.0)
    assert parsed.messages == CHAT


# -- logprobs, n and echo ------------------------------------------------------------------


def test_logprobs_n_and_echo_become_sampling_options() -> None:
    chat = parse_request(_chat(logprobs=True, top_logprobs=5, n=3, best_of=3, seed=7), "chat")
    assert chat.sampling == SamplingOptions(seed=7, n=3, logprobs=5)
    assert parse_request(_chat(logprobs=True), "chat").sampling.logprobs == 0
    # top_logprobs 0 asks for nothing, so it passes without logprobs (vLLM's rule).
    assert parse_request(_chat(top_logprobs=0), "chat").sampling.logprobs is None
    completion = {"model": MODEL, "prompt": "Once", "logprobs": 2, "echo": True}
    parsed = parse_request(completion, "completions")
    assert (parsed.echo, parsed.sampling.logprobs, parsed.sampling.prompt_logprobs) == (True, 2, 2)
    plain = parse_request({**completion, "logprobs": False}, "completions")
    assert plain.echo
    assert (plain.sampling.logprobs, plain.sampling.prompt_logprobs) == (None, None)
    generate = parse_generate_request(
        {"token_ids": [5], "sampling_params": {"n": 2, "logprobs": 0, "prompt_logprobs": 20}}
    )
    assert (generate.sampling.n, generate.sampling.logprobs, generate.sampling.prompt_logprobs) == (
        2,
        0,
        20,
    )


@pytest.mark.parametrize(
    ("body", "endpoint", "param", "says"),
    [
        (_chat(top_logprobs=3), "chat", "top_logprobs", "needs 'logprobs'"),
        (_chat(logprobs=True, top_logprobs=21), "chat", "top_logprobs", "<= 20"),
        (_chat(n=2, best_of=1), "chat", "best_of", "less than 'n'"),
        (_chat(n=2, best_of=4), "chat", "best_of", "not supported"),
        (_chat(best_of=2), "chat", "best_of", "not supported"),
        (
            {"model": MODEL, "prompt": "x", "logprobs": True},
            "completions",
            "logprobs",
            "an integer",
        ),
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, "completions", "logprobs", "<= 20"),
        (
            {"model": MODEL, "prompt": "x", "top_logprobs": 1},
            "completions",
            "top_logprobs",
            "chat field",
        ),
    ],
)
def test_logprobs_and_n_refusals_name_the_field(
    body: dict[str, Any], endpoint: str, param: str, says: str
) -> None:
    err = _refusal(body, endpoint)
    assert err.param == param
    assert says in err.message


def test_the_token_in_api_does_not_stream_prompt_logprobs() -> None:
    body = {"token_ids": [5], "stream": True, "sampling_params": {"prompt_logprobs": 0}}
    with pytest.raises(ApiError) as caught:
        parse_generate_request(body)
    assert caught.value.param == "sampling_params.prompt_logprobs"
    body["stream"] = False
    assert parse_generate_request(body).sampling.prompt_logprobs == 0


def test_messages_reach_the_template_with_the_fields_the_models_declare() -> None:
    """As vLLM's server passes them: role, content, name, tool calls, reasoning; a field
    the models do not declare is dropped (a bomb in one costs nothing)."""
    messages = [
        {"role": "user", "content": "hi", "name": "ann", "x-custom": [[]] * 1000},
        {
            "role": "assistant",
            "content": None,
            "prefix": True,
            "reasoning": "r",
            "tool_calls": [
                {"function": {"name": "f", "arguments": "{}"}, "extra": 1},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": {"x": [1]}},
                },
            ],
        },
        {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c2"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "strict": True, "parameters": {"type": "object"}},
        }
    ]
    parsed = parse_request(
        _chat(messages=messages, tools=tools, chat_template_kwargs={"thinking": True}), "chat"
    )
    assert parsed.messages == [
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "r",
            "tool_calls": [
                {"function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": {"x": [1]}},
                },
            ],
        },
        {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c2"},
    ]
    assert parsed.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert parsed.chat_template_kwargs == {"thinking": True}


class Narrower(CompletionRequest, kw_only=True):
    suffix: int | None = None  # type: ignore[assignment]


def test_the_route_model_is_the_one_given() -> None:
    body = {"model": MODEL, "prompt": "x", "suffix": "not an int"}
    parse_request(body, "completions")  # unknown to the default model: ignored
    with pytest.raises(ApiError) as caught:
        parse_request(body, "completions", model=Narrower)
    assert caught.value.param == "suffix"


# -- limits --------------------------------------------------------------------------------


def _limit(body: Any, limits: RequestLimits, endpoint: str = "chat") -> LimitExceeded:
    with pytest.raises(LimitExceeded) as caught:
        parse_request(body, endpoint, limits)
    return caught.value


@pytest.mark.parametrize(
    ("limits", "over", "at", "limit", "param", "code"),
    [
        (
            RequestLimits(max_tokens_cap=64),
            _chat(max_tokens=65),
            _chat(max_tokens=64),
            "max_tokens_cap",
            "max_tokens",
            "integer_above_max_value",
        ),
        (
            RequestLimits(max_tokens_cap=64),
            _chat(max_completion_tokens=65),
            _chat(max_completion_tokens=64),
            "max_tokens_cap",
            "max_completion_tokens",
            "integer_above_max_value",
        ),
        (
            RequestLimits(max_messages=3),
            _chat(messages=CHAT * 4),
            _chat(messages=CHAT * 3),
            "max_messages",
            "messages",
            "array_above_max_length",
        ),
        (
            RequestLimits(max_prompt_chars=10),
            _chat(
                messages=[
                    {"role": "system", "content": "12345"},
                    {"role": "user", "content": [{"type": "text", "text": "123456"}]},
                ]
            ),
            _chat(
                messages=[
                    {"role": "system", "content": "12345"},
                    {"role": "user", "content": [{"type": "text", "text": "12345"}]},
                ]
            ),
            "max_prompt_chars",
            "messages",
            "string_above_max_length",
        ),
        (
            RequestLimits(max_prompt_chars=10),
            _chat(
                messages=[
                    {
                        "role": "assistant",
                        "content": "1",
                        "reasoning_content": "23456",
                        "tool_calls": [{"function": {"name": "f", "arguments": "78901"}}],
                    }
                ]
            ),
            _chat(
                messages=[
                    {
                        "role": "assistant",
                        "content": "1",
                        "reasoning_content": "2345",
                        "tool_calls": [{"function": {"name": "f", "arguments": "78901"}}],
                    }
                ]
            ),
            "max_prompt_chars",
            "messages",
            "string_above_max_length",
        ),
        (
            RequestLimits(max_stop_strings=2),
            _chat(stop=["a", "b", "c"]),
            _chat(stop=["a", "b"]),
            "max_stop_strings",
            "stop",
            "array_above_max_length",
        ),
        (
            RequestLimits(max_stop_length=4),
            _chat(stop="abcde"),
            _chat(stop="abcd"),
            "max_stop_length",
            "stop",
            "string_above_max_length",
        ),
        (
            RequestLimits(max_stop_length=4),
            _chat(stop=["a", "abcde"]),
            _chat(stop=["abcd"]),
            "max_stop_length",
            "stop",
            "string_above_max_length",
        ),
    ],
)
def test_each_limit_refuses_one_past_it_and_takes_it(
    limits: RequestLimits,
    over: dict[str, Any],
    at: dict[str, Any],
    limit: str,
    param: str,
    code: str,
) -> None:
    err = _limit(over, limits)
    assert (err.limit, err.param, err.code) == (limit, param, code)
    assert str(getattr(limits, limit)) in err.message
    parse_request(at, "chat", limits)
    # 0 turns the limit off.
    parse_request(over, "chat", RequestLimits(**{limit: 0}))


def test_completions_and_token_in_limits() -> None:
    limits = RequestLimits(max_prompt_chars=5, max_tokens_cap=8)
    err = _limit({"model": MODEL, "prompt": "123456"}, limits, "completions")
    assert (err.limit, err.param) == ("max_prompt_chars", "prompt")
    err = _limit({"model": MODEL, "prompt": ["123456"]}, limits, "completions")
    assert (err.limit, err.param) == ("max_prompt_chars", "prompt")
    parse_request({"model": MODEL, "prompt": [1] * 100}, "completions", limits)  # ids: context
    with pytest.raises(LimitExceeded) as caught:
        parse_generate_request({"token_ids": [1], "sampling_params": {"max_tokens": 9}}, limits)
    assert (caught.value.limit, caught.value.param) == (
        "max_tokens_cap",
        "sampling_params.max_tokens",
    )
    parse_generate_request({"token_ids": [1], "sampling_params": {"max_tokens": 8}}, limits)


def test_a_benchmark_long_prompt_passes_the_default_limits() -> None:
    """The suite's ~40k-token prompts (docs/performance.md) are within every default."""
    words = random.Random(1).choices(WORDS, k=40_000)
    body = orjson.loads(
        orjson.dumps(
            _chat(
                messages=[
                    {"role": "system", "content": " ".join(words)},
                    {"role": "user", "content": " ".join(words[:100])},
                ],
                stop=["\n\nUser:"] * 16,
            )
        )
    )
    parse_request(body, "chat")
    parse_request({"model": MODEL, "prompt": " ".join(words)}, "completions")


@pytest.mark.parametrize("field", ["max_messages", "request_timeout", "max_stop_length"])
@pytest.mark.parametrize("value", [-1, math.nan, math.inf])
def test_a_limit_below_zero_or_not_finite_is_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RequestLimits(**{field: value})  # type: ignore[arg-type]


def test_the_cap_bounds_the_default_max_tokens() -> None:
    assert RequestLimits(max_tokens_cap=64).default_max_tokens(1000) == 64
    assert RequestLimits(max_tokens_cap=64).default_max_tokens(10) == 10
    assert RequestLimits().default_max_tokens(1000) == 1000


# -- the deadline, on virtual time ---------------------------------------------------------


async def _slow(closed: list[str], every: float = 10.0) -> AsyncGenerator[int, None]:
    try:
        for i in range(100):
            await trio.sleep(every)
            yield i
    finally:
        closed.append("closed")


async def test_a_stream_ends_at_its_deadline_and_closes_its_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[str] = []
    deadline = Deadline(25.0)
    got = []

    async def consume() -> None:
        async for item in deadline.iterate(_slow(closed)):
            got.append(item)
            await trio.sleep(1)  # the consumer's time counts too

    with pytest.raises(RequestTimeout) as caught:
        await consume()
    assert trio.current_time() == 25.0
    assert got == [0, 1]
    assert closed == ["closed"]
    assert caught.value.code == "request_timeout"
    assert caught.value.limit == "request_timeout"


async def test_a_stage_ends_at_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    deadline = Deadline(5.0)

    async def four_seconds() -> str:
        await trio.sleep(4)
        return "done"

    assert await deadline.run(four_seconds) == "done"
    with pytest.raises(RequestTimeout):
        await deadline.run(four_seconds)
    assert trio.current_time() == 5.0


async def test_no_deadline_cuts_nothing(autojump_clock: trio.testing.MockClock) -> None:
    closed: list[str] = []
    items = _slow(closed)
    assert Deadline(0).iterate(items) is items  # no scope, no extra generator per item
    got = [i async for i in Deadline(0).iterate(items)]
    assert len(got) == 100
    assert trio.current_time() == 1000.0
    assert closed == ["closed"]


async def test_a_stream_the_consumer_leaves_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from contextlib import aclosing

    closed: list[str] = []
    async with aclosing(Deadline(100).iterate(_slow(closed))) as items:
        async for item in items:
            if item == 2:
                break
    assert closed == ["closed"]
    assert trio.current_time() == 30.0
