"""``GET /openapi.json``: generated from the models the server validates with, so it cannot
drift; its limits are the configured ones; live responses match its response schemas.

Policy: a real frontend on 127.0.0.1:0 (frontend_fixture) with in-process simulated
workers; response bodies are checked with jsonschema_rs (schemathesis' validator).
"""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import jsonschema_rs
import msgspec
import orjson
import pytest

from frontend.http import models
from frontend.http.models import ChatCompletionRequest
from frontend.http.openapi import openapi_document
from frontend.limits import RequestLimits

from frontend_fixture import assert_error, serve_frontend, sse_events

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]
PUBLIC = {
    "/v1/chat/completions": "post",
    "/v1/completions": "post",
    "/inference/v1/generate": "post",
    "/tokenize": "post",
    "/detokenize": "post",
    "/v1/messages": "post",
    "/v1/messages/count_tokens": "post",
    "/v1/responses": "post",
    "/v1/responses/{response_id}": "get",
    "/v1/models": "get",
    "/v1/models/{model_id}": "get",
    "/health": "get",
    "/live": "get",
}


def _doc(**kwargs: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "limits": RequestLimits(),
        "context_length": 131072,
        "api_keys": False,
        **kwargs,
    }
    return openapi_document(models.REQUEST_MODELS, **settings)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _validator(doc: dict[str, Any], name: str) -> Any:
    """A JSON Schema validator of component *name*, its refs resolved in *doc*."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


def test_the_document_describes_every_public_route() -> None:
    doc = _doc()
    assert doc["openapi"] == "3.1.0"
    assert {path: next(iter(ops)) for path, ops in doc["paths"].items()} == PUBLIC
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    for name in schemas:  # each one a valid JSON Schema 2020-12
        _validator(doc, name)
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert set(chat["responses"]) == {"200", "400", "404", "413", "415", "429", "500", "502", "503"}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "500", "503"}
    assert "security" not in doc
    assert "securitySchemes" not in doc["components"]
    # The request models' constraints are the validator's own.
    generate = schemas["GenerateRequest"]
    assert generate["required"] == ["token_ids"]
    assert generate["properties"]["token_ids"]["minItems"] == 1
    assert generate["properties"]["token_ids"]["items"]["minimum"] == 0


def test_keys_and_a_deadline_add_their_statuses_and_the_bearer_scheme() -> None:
    doc = _doc(api_keys=True, limits=RequestLimits(request_timeout=30))
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "Authorization: Bearer <one of --api-key>",
    }
    for path, ops in doc["paths"].items():
        op = next(iter(ops.values()))
        open_route = path in ("/health", "/live")
        assert ("401" in op["responses"]) is not open_route, path
        assert (op.get("security") == []) is open_route, path
        assert ("504" in op["responses"]) is (ops.get("post") is not None), path


def test_the_limits_in_the_document_are_the_configured_ones() -> None:
    limits = RequestLimits(
        max_tokens_cap=99,
        max_messages=7,
        max_stop_strings=3,
        max_stop_length=11,
        max_prompt_chars=12345,
    )
    schemas = _doc(limits=limits, context_length=4096)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 7
    assert "12345 characters" in chat["messages"]["description"]
    for field in ("max_tokens", "max_completion_tokens"):
        [integer] = [b for b in chat[field]["anyOf"] if b["type"] == "integer"]
        assert (integer["minimum"], integer["maximum"]) == (1, 99)
    [string, array] = [b for b in chat["stop"]["anyOf"] if b["type"] != "null"]
    assert (string["maxLength"], array["maxItems"], array["items"]["maxLength"]) == (11, 3, 11)
    assert "12345 characters" in schemas["CompletionRequest"]["properties"]["prompt"]["description"]
    sampling = schemas["SamplingParams"]["properties"]
    assert [b["maximum"] for b in sampling["max_tokens"]["anyOf"] if "maximum" in b] == [99]
    generate = schemas["GenerateRequest"]["properties"]
    assert generate["token_ids"]["maxItems"] == 4095
    # Off: the context length is the bound.
    chat = _doc(limits=RequestLimits(max_stop_strings=0))["components"]["schemas"][
        "ChatCompletionRequest"
    ]["properties"]
    assert [b["maximum"] for b in chat["max_tokens"]["anyOf"] if "maximum" in b] == [131072]
    assert next(b for b in chat["stop"]["anyOf"] if b["type"] == "array").get("maxItems") is None


class WithBudget(ChatCompletionRequest, kw_only=True):
    """A chat body with one more field, as a later change to the model would add."""

    reasoning_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None


async def test_a_field_added_to_a_model_is_published_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The document and the validation come from the same model: a field added to it
    appears in the served document, and the server checks it, with nothing else changed."""
    monkeypatch.setitem(models.REQUEST_MODELS, "chat", WithBudget)
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        doc = (await c.get("/openapi.json")).json()
        body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].endswith("/WithBudget")
        field = doc["components"]["schemas"]["WithBudget"]["properties"]["reasoning_budget"]
        assert {"type": "integer", "minimum": 0} in field["anyOf"]
        chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        assert_error(
            await c.post("/v1/chat/completions", json={**chat, "reasoning_budget": -1}),
            400,
            "reasoning_budget",
        )
        ok = await c.post("/v1/chat/completions", json={**chat, "reasoning_budget": 5})
        assert ok.status_code == 200, ok.text


async def test_the_served_document_is_the_generated_one_and_keyed_like_the_api() -> None:
    async with (
        serve_frontend(api_keys=("k1",), limits=RequestLimits(request_timeout=9)) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        assert_error(await c.get("/openapi.json"), 401)
        # A 405 names the methods the path takes (RFC 9110), as schemathesis checks.
        r = await c.request("TRACE", "/health")
        assert_error(r, 405)
        assert "GET" in r.headers["allow"]
        r = await c.get("/openapi.json", headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.json() == orjson.loads(
            orjson.dumps(
                _doc(
                    api_keys=True,
                    limits=fe.config.limits,
                    context_length=fe.config.context_length,
                    model_names=[MODEL],
                )
            )
        )


async def test_live_responses_match_the_response_schemas() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        doc = (await c.get("/openapi.json")).json()

        def check(r: httpx.Response, name: str) -> None:
            errors = [e.message for e in _validator(doc, name).iter_errors(r.json())]
            assert not errors, (name, r.json(), errors)

        chat = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
        check(await c.post("/v1/chat/completions", json=chat), "ChatCompletion")
        completion = {"model": MODEL, "prompt": "The river", "max_tokens": 5}
        check(await c.post("/v1/completions", json=completion), "Completion")
        tokens = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}}
        check(await c.post("/inference/v1/generate", json=tokens), "GenerateResponse")
        check(await c.get("/v1/models"), "ModelList")
        check(await c.get(f"/v1/models/{MODEL}"), "ModelCard")
        check(await c.get("/health"), "Health")
        check(await c.get("/live"), "Live")
        check(await c.get("/v1/models/other"), "ErrorResponse")
        check(await c.post("/v1/chat/completions", json={"model": MODEL}), "ErrorResponse")
        # The APIs translated onto the chat pipeline.
        check(await c.post("/tokenize", json={"messages": CHAT}), "TokenizeResponse")
        check(await c.post("/detokenize", json={"tokens": [1, 2]}), "DetokenizeResponse")
        message = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
        check(await c.post("/v1/messages", json=message), "MessageResponse")
        check(
            await c.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": CHAT}),
            "CountTokensResponse",
        )
        check(await c.post("/v1/messages", json={"model": MODEL}), "AnthropicErrorResponse")
        created = await c.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 5}
        )
        check(created, "Response")
        response_id = created.json()["id"]
        check(await c.get(f"/v1/responses/{response_id}"), "Response")
        check(await c.delete(f"/v1/responses/{response_id}"), "DeletedResponse")
        check(await c.get(f"/v1/responses/{response_id}"), "ErrorResponse")
        for path, body, event in (
            ("/v1/chat/completions", chat, "ChatCompletionChunk"),
            ("/v1/completions", completion, "Completion"),
            ("/inference/v1/generate", tokens, "GenerateResponse"),
        ):
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with c.stream("POST", path, json=streamed) as r:
                events = await sse_events(r)
            assert events[-1] == "DONE"
            validator = _validator(doc, event)
            for e in events[:-1]:
                assert not [x.message for x in validator.iter_errors(e)], (event, e)
        # The event stream's schema: one event, its data JSON of that schema or [DONE].
        stream = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"][
            "text/event-stream"
        ]["schema"]
        data = stream["properties"]["data"]["anyOf"]
        assert data[0] == {"const": "[DONE]"}
        assert {"$ref": "#/components/schemas/ChatCompletionChunk"} in data[1]["contentSchema"][
            "anyOf"
        ]
        # The served model is the one value of `model`.
        model = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
        assert model["enum"] == [MODEL]
