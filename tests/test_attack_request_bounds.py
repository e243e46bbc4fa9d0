"""Attack: an unbounded list in a request cut a worker's whole plane connection.

~140,000 ``stop_token_ids`` (a 420 kB body) went to a worker in one frame past its codec's
budget, and the worker dropped the connection with every request on it. Every list,
string and mapping of every request model is now bounded, from frontend/limits.py, and
the bounds are published in ``/openapi.json``.

Policy: the document's schemas walked as published (every request body, through its
references); hypothesis picks bounds and bodies at them or one past, sent to a real
frontend on 127.0.0.1:0 in a thread of its own (frontend_in_thread), each answered within
a deadline; the frontend's own stall log must not grow past a generous bound meanwhile.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.http import models
from frontend.http.openapi import openapi_document
from frontend.limits import MAX_NAME_CHARS, MAX_PARTS, RequestLimits

from attack_fixture import LoopGaps
from frontend_fixture import assert_error, frontend_in_thread, serve_frontend

MODEL = "deepseek-v4"
LIMITS = RequestLimits()


def _unbounded(schemas: dict[str, Any], root: dict[str, Any]) -> list[str]:
    """The places below *root* where a list, string or mapping has no bound."""
    found: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[Any, str]] = [(root, "$")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        if (ref := node.get("$ref")) is not None:
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                seen.add(name)
                stack.append((schemas[name], name))
            continue
        kind = node.get("type")
        if kind == "string" and "maxLength" not in node and "enum" not in node:
            found.append(where)
        if kind == "array" and "maxItems" not in node:
            found.append(where)
        if kind == "object" and "properties" not in node and "maxProperties" not in node:
            found.append(where)
        for key, value in node.items():
            if key in ("properties",):
                stack.extend((v, f"{where}.{k}") for k, v in value.items())
            elif key in ("items", "additionalProperties"):
                stack.append((value, f"{where}[]"))
            elif key in ("anyOf", "oneOf", "allOf"):
                stack.extend((v, where) for v in value)
    return found


def test_every_list_string_and_mapping_of_every_request_model_is_bounded() -> None:
    doc = openapi_document(
        models.REQUEST_MODELS, limits=LIMITS, context_length=131072, api_keys=False
    )
    schemas = doc["components"]["schemas"]
    for model in models.REQUEST_MODELS.values():
        assert _unbounded(schemas, schemas[model.__name__]) == [], model.__name__
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["stop_token_ids"]["anyOf"][0]["maxItems"] == LIMITS.max_stop_token_ids
    assert chat["tools"]["anyOf"][0]["maxItems"] == LIMITS.max_tools
    assert schemas["FunctionCall"]["properties"]["name"]["maxLength"] == MAX_NAME_CHARS


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/inference/v1/generate"])
async def test_140000_stop_token_ids_are_a_400_before_any_worker_sees_them(path: str) -> None:
    ids = [2] * 140_000
    body: dict[str, Any] = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": ids}
        if path.startswith("/v1")
        else {"token_ids": [5, 6], "sampling_params": {"stop_token_ids": ids}}
    )
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.post(path, json=body)
        err = assert_error(r, 400)
        assert err["code"] == "array_above_max_length"
        assert str(err["param"]).endswith("stop_token_ids")
        assert fe.metrics.rejected_requests_total.labels("max_stop_token_ids")._value.get() == 1
        at = ids[: LIMITS.max_stop_token_ids]
        ok = (
            dict(body, stop_token_ids=at)
            if path.startswith("/v1")
            else dict(body, sampling_params={"stop_token_ids": at, "max_tokens": 2})
        )
        assert (
            await client.post(path, json={**ok, "max_tokens": 2} if path.startswith("/v1") else ok)
        ).status_code == 200


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def _call(n: int) -> dict[str, Any]:
    return {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}


# Each bound: a body holding *n* of what it bounds; the bound; the param refused past it.
BOUNDS: dict[str, tuple[Any, int, str]] = {
    "messages": (
        lambda n: _chat(messages=[{"role": "user", "content": "hi"}] * n),
        LIMITS.max_messages,
        "messages",
    ),
    "tools": (
        lambda n: _chat(
            tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]
        ),
        LIMITS.max_tools,
        "tools",
    ),
    "stop": (lambda n: _chat(stop=[f"s{i}" for i in range(n)]), LIMITS.max_stop_strings, "stop"),
    "stop length": (lambda n: _chat(stop="s" * n), LIMITS.max_stop_length, "stop"),
    "stop_token_ids": (
        lambda n: _chat(stop_token_ids=[2] * n),
        LIMITS.max_stop_token_ids,
        "stop_token_ids",
    ),
    "content parts": (
        lambda n: _chat(
            messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * n}]
        ),
        MAX_PARTS,
        "messages",
    ),
    "tool calls": (
        lambda n: _chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_call(i) for i in range(n)]},
                {"role": "user", "content": "go on"},
            ]
        ),
        MAX_PARTS,
        "messages",
    ),
    "model name": (lambda n: {**_chat(), "model": "m" * n}, MAX_NAME_CHARS, "model"),
    "prompt chars": (
        lambda n: _chat(messages=[{"role": "user", "content": "a" * n}]),
        LIMITS.max_prompt_chars,
        "messages",
    ),
    "tools chars": (
        lambda n: _chat(tools=[{"function": {"name": "f", "description": "d" * (n - 3)}}]),
        LIMITS.max_prompt_chars,
        "tools",
    ),
}


@pytest.mark.slow  # ~10 s: a request at and past every bound
@settings(
    max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(name=st.sampled_from(sorted(BOUNDS)), past=st.booleans())
def test_a_body_at_each_bound_is_served_and_one_past_it_refused(
    served: str, name: str, past: bool
) -> None:
    make, bound, param = BOUNDS[name]
    body = make(bound + 1 if past else bound)
    with httpx.Client(base_url=served, timeout=30) as client:
        r = client.post("/v1/chat/completions", json=body)
    if past:
        error = r.json()["error"]
        assert r.status_code in (400, 404), r.text  # 404: a model name nobody serves
        assert error["param"] == param, error
    else:
        # At the bound the request passes the bounds; the model name is not this one's
        # and the long prompt is past the context: refused there, not at the bound.
        if name == "model name":
            assert r.status_code == 404, r.text
        elif name in ("prompt chars", "tools chars"):
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        else:
            assert r.status_code == 200, (name, r.text)


@pytest.fixture(scope="module")
def served() -> Any:
    with frontend_in_thread() as url:
        yield url


async def test_the_largest_body_the_bounds_allow_does_not_stall_the_loop() -> None:
    body = _chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 8}]
        * LIMITS.max_messages,
        stop_token_ids=[2] * LIMITS.max_stop_token_ids,
        tools=[
            {"function": {"name": f"t{i}", "parameters": {"type": "object"}}}
            for i in range(LIMITS.max_tools)
        ],
    )
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        async with LoopGaps() as gaps:
            r = await client.post("/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        # The template walks the 2,048 messages on the loop (a short conversation is
        # rendered there); the parse itself takes a few ms. Generous: a loaded machine.
        assert gaps.worst < 0.5, gaps.worst
