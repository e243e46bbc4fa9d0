"""Property-based tests of request bodies against a real frontend: built from the
published schema (``/openapi.json``), valid and nearly valid, the answer is never a 5xx,
never late, and every error is in its API's shape: OpenAI's, Anthropic's on the Messages
API's routes.

Policy: one frontend per test module on 127.0.0.1:0, run in a thread of its own
(frontend_fixture.frontend_in_thread), since Hypothesis runs each example as a plain
call; in-process mocker workers at 1000x, a 4096-token context and ``max_tokens`` capped
at 32, so that any valid body is answered in milliseconds. Every request has a 30 s
timeout (a hang fails the example). Examples are bounded per test and derandomized under
``CI=true``: the same inputs each run, no flaky shrinking in CI.

"Nearly valid": a valid body with one thing wrong: a field of another JSON type, a
number out of its range, a required field missing, a huge string, deep nesting, a lone
surrogate, an unknown field, or not an object at all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.http.models import REQUEST_MODELS
from frontend.http.openapi import openapi_document
from frontend.limits import RequestLimits

from frontend_fixture import frontend_in_thread

# Long-running (a live frontend fed hundreds of generated bodies):
# the full suite's, not `make test-fast`'s.
pytestmark = pytest.mark.slow

MODEL = "deepseek-v4"
LIMITS = RequestLimits(max_tokens_cap=32)
CONTEXT = 4096
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/inference/v1/generate",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "responses": "/v1/responses",
}
#: The routes that answer in Anthropic's shape, and the streams with no [DONE].
ANTHROPIC = frozenset({"messages", "count_tokens"})
NAMED_EVENTS = frozenset({"messages", "responses"})
SCHEMAS: dict[str, Any] = openapi_document(
    REQUEST_MODELS, limits=LIMITS, context_length=CONTEXT, api_keys=False, model_names=[MODEL]
)["components"]["schemas"]

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=os.environ.get("CI") == "true",
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid against *schema*, for the JSON Schema the models produce (refs into
    SCHEMAS, anyOf, enum/const, objects, arrays, strings, numbers); small sizes."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(SCHEMAS[name]))
    if "oneOf" in schema and "properties" in schema:  # an object, refined by each branch
        base = {k: v for k, v in schema.items() if k != "oneOf"}
        exclusive = {name for b in schema["oneOf"] for name in b["required"]}
        return st.one_of(
            [from_schema(_refined(base, b["required"], exclusive)) for b in schema["oneOf"]]
        )
    if "anyOf" in schema:
        return st.one_of([from_schema(b) for b in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if not props:
            return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(
            from_schema(schema.get("items", {})),
            min_size=low,
            max_size=max(low, min(schema.get("maxItems", 4), 4)),
        )
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 30), 30)))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(
            schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def _refined(base: dict[str, Any], required: list[str], exclusive: set[str]) -> dict[str, Any]:
    """An object's schema *base* with *required* fields required and the other fields
    of its one-of (*exclusive*) left out."""
    properties = {
        k: v for k, v in base["properties"].items() if k in required or k not in exclusive
    }
    return {**base, "properties": properties, "required": [*base.get("required", []), *required]}


def valid(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    return from_schema({"$ref": f"#/components/schemas/{REQUEST_MODELS[endpoint].__name__}"})


DEEP = "\x00deep\x00"  # replaced by deeply nested JSON once the body is encoded
SURROGATE = "\x00surrogate\x00"  # replaced by a lone surrogate's escape


@st.composite
def nearly_valid(draw: st.DrawFn, endpoint: str) -> bytes:
    """A valid body with one thing wrong, encoded (some faults exist only as bytes)."""
    body: Any = draw(valid(endpoint))
    schema = SCHEMAS[REQUEST_MODELS[endpoint].__name__]
    field = draw(st.sampled_from(sorted(schema["properties"])))
    fault = draw(
        st.sampled_from(
            ["type", "range", "missing", "huge", "deep", "surrogate", "unknown", "not_object"]
        )
    )
    if fault == "type":
        body[field] = draw(JSON)
    elif fault == "range":
        body[field] = draw(st.sampled_from([-1, 0, -(2**70), 2**70, 1e308, -1e308, 0.5]))
    elif fault == "missing":
        body.pop(draw(st.sampled_from(schema.get("required") or [field])), None)
    elif fault == "huge":
        size = draw(st.sampled_from([10_000, 300_000, 3_000_000]))
        body[field] = draw(st.sampled_from(["x" * size, ["y" * size], [1] * (size // 10)]))
    elif fault == "deep":
        body[field] = DEEP
    elif fault == "surrogate":
        body[field] = SURROGATE
    elif fault == "unknown":
        body[draw(st.text(min_size=1, max_size=10))] = draw(JSON)
    else:
        body = draw(JSON.filter(lambda v: not isinstance(v, dict)))
    depth = draw(st.integers(10, 5000))
    return (
        _encode(body)
        .replace(_encode(DEEP), b"[" * depth + b"]" * depth)
        .replace(_encode(SURROGATE), b'"\\ud800x"')
    )


def _encode(body: Any) -> bytes:
    """JSON, integers of any size included (orjson stops at 64 bits)."""
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with frontend_in_thread(context_length=CONTEXT, limits=LIMITS, max_body_bytes=8 << 20) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


def _answered_well(r: httpx.Response, endpoint: str) -> None:
    """Not a 5xx; an error is its API's shape; a success is whole JSON or a whole
    stream."""
    assert r.status_code < 500, r.text[:2000]
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        body = r.json()
        if endpoint in ANTHROPIC:
            assert body["type"] == "error", body
            error = body["error"]
            assert set(error) == {"type", "message"}, error
        else:
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))
        assert isinstance(error["message"], str)
        assert error["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = [chunk for chunk in r.text.split("\n\n") if chunk]
        if endpoint in NAMED_EVENTS:  # `event: <type>` lines, and no [DONE]
            events = [chunk.split("\ndata: ", 1)[1] for chunk in chunks]
            assert orjson.loads(events[-1])["type"] in (
                "message_stop",
                "response.completed",
                "response.incomplete",
            ), events[-1]
        else:
            events = [chunk[6:] for chunk in chunks]
            assert events[-1] == "[DONE]", events[-3:]
            events = events[:-1]
        for data in events:
            event = orjson.loads(data)
            assert "error" not in event, event  # a valid request's stream does not fail
            assert event.get("type") not in ("error", "response.failed"), event
    else:
        assert isinstance(r.json(), dict)


def _post(client: httpx.Client, endpoint: str, content: bytes) -> httpx.Response:
    return client.post(
        PATHS[endpoint], content=content, headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize("endpoint", sorted(PATHS))
def test_schema_valid_bodies_are_answered_without_a_server_error(
    client: httpx.Client, endpoint: str
) -> None:
    @FUZZ
    @given(body=valid(endpoint))
    def check(body: dict[str, Any]) -> None:
        _answered_well(_post(client, endpoint, _encode(body)), endpoint)

    check()


@pytest.mark.parametrize("endpoint", sorted(PATHS))
def test_nearly_valid_bodies_are_refused_in_their_apis_way(
    client: httpx.Client, endpoint: str
) -> None:
    @FUZZ
    @given(content=nearly_valid(endpoint))
    def check(content: bytes) -> None:
        _answered_well(_post(client, endpoint, content), endpoint)

    check()
    # And the server still serves.
    ok = client.post(
        "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    )
    assert ok.status_code == 200, ok.text
