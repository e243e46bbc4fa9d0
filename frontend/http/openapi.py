"""``GET /openapi.json``: an OpenAPI 3.1 document of the public API, generated at start-up.

The request bodies are the JSON Schemas of the very models the routes validate with
(:data:`frontend.http.models.REQUEST_MODELS`, passed in by the app), and the configured
limits are written into them from the same :class:`~frontend.limits.RequestLimits` the
parser checks (``maxItems`` of ``messages``, ``maximum`` of ``max_tokens``, ...), so the
document cannot drift from what the server accepts. Response bodies come from the
response models (the success bodies and OpenAI's error body); each operation lists the
statuses it can answer, and, when API keys are configured, the bearer scheme and 401
(``/health`` and ``/live`` stay open, as :mod:`frontend.http.auth` keeps them).

Every list, string and mapping of a request body is bounded in the document: a fixed bound
from the model, a configured limit written in here, or, for a string that is neither (the
text of a message, a tool's description, a prompt), ``--max-prompt-chars``, which all of a
request's text counts against together (:func:`_bound_text`).

The document itself is keyed like ``/v1/models``: it describes the API, and who may not
use the API has no need of it (docs/security.md). It is built once, as bytes; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, get_args

import msgspec
import orjson

from frontend.http import models as m
from frontend.http.anthropic import models as am
from frontend.http.responses_api import models as rm
from frontend.limits import RequestLimits

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{name}"

#: What each error status means, whichever route answers it.
ERROR_STATUSES: Mapping[int, str] = {
    400: "Invalid request: malformed JSON, a wrong type or value, a missing field, or over "
    "a request limit (its `code` says which kind, its `param` which field)",
    401: "Missing or wrong API key",
    404: "Unknown model (or, for a stored response, an unknown or evicted id)",
    413: "Request body over the server's --max-body-bytes",
    415: "Content-Type is not application/json",
    429: "The frontend serves its --max-inflight requests already; retry after Retry-After",
    500: "Unexpected server error (details in the server's log only)",
    502: "A worker failed the request and retries were spent",
    503: "No worker can take the request now, or the frontend is draining",
    504: "The request did not complete within the server's --request-timeout",
    529: "Overloaded: no worker can take the request now, or the frontend is draining "
    "(Anthropic's status for it)",
}
_GENERATION_ERRORS = (400, 404, 413, 415, 429, 500, 502, 503)
_TOKENIZER_ERRORS = (400, 404, 413, 415, 429, 500, 503)  # 503: draining
# Anthropic's statuses: 415 is its 400, 502 its 500, 503 its 529 (overloaded).
_ANTHROPIC_ERRORS = (400, 404, 413, 429, 500, 529)


@dataclass(frozen=True, slots=True)
class Operation:
    """One route of the public API, as the document describes it."""

    method: str
    path: str
    operation_id: str
    summary: str
    response: type[msgspec.Struct]  # the success body
    errors: tuple[int, ...] = (500,)
    endpoint: str | None = None  # the request model's key in REQUEST_MODELS
    # One SSE event's data, if it streams: a Struct, or a union of them.
    stream_event: Any = None
    keyed: bool = True  # needs an API key when keys are configured
    path_params: tuple[str, ...] = ()
    error_body: type[msgspec.Struct] = m.ErrorResponse  # Anthropic's on its routes
    # OpenAI's streams end with `data: [DONE]`; others (Anthropic's, the Responses API's)
    # name each event's type in an `event:` line and end with their last event.
    sse_done: bool = True


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "post",
        "/v1/chat/completions",
        "createChatCompletion",
        "A chat completion, unary or streamed (OpenAI's API)",
        m.ChatCompletion,
        _GENERATION_ERRORS,
        "chat",
        m.ChatCompletionChunk,
    ),
    Operation(
        "post",
        "/v1/completions",
        "createCompletion",
        "A text completion, unary or streamed (OpenAI's API)",
        m.Completion,
        _GENERATION_ERRORS,
        "completions",
        m.Completion,
    ),
    Operation(
        "post",
        "/inference/v1/generate",
        "generateTokens",
        "Token ids in, token ids out, unary or streamed (vLLM's shape)",
        m.GenerateResponse,
        _GENERATION_ERRORS,
        "generate",
        m.GenerateResponse,
    ),
    Operation(
        "post",
        "/tokenize",
        "tokenize",
        "A prompt or chat messages to token ids, the chat template applied (vLLM's shape)",
        m.TokenizeResponse,
        _TOKENIZER_ERRORS,
        "tokenize",
    ),
    Operation(
        "post",
        "/detokenize",
        "detokenize",
        "Token ids to text (vLLM's shape)",
        m.DetokenizeResponse,
        _TOKENIZER_ERRORS,
        "detokenize",
    ),
    Operation(
        "post",
        "/v1/messages",
        "createMessage",
        "A message, unary or streamed (Anthropic's Messages API)",
        am.MessageResponse,
        _ANTHROPIC_ERRORS,
        "messages",
        am.StreamEvent,
        error_body=am.AnthropicErrorResponse,
        sse_done=False,
    ),
    Operation(
        "post",
        "/v1/messages/count_tokens",
        "countMessageTokens",
        "The prompt tokens of a Messages request (Anthropic's API)",
        am.CountTokensResponse,
        _ANTHROPIC_ERRORS,
        "count_tokens",
        error_body=am.AnthropicErrorResponse,
    ),
    Operation(
        "post",
        "/v1/responses",
        "createResponse",
        "A response, unary or streamed (OpenAI's Responses API)",
        rm.Response,
        _GENERATION_ERRORS,
        "responses",
        rm.ResponsesStreamEvent,
        sse_done=False,
    ),
    Operation(
        "get",
        "/v1/responses/{response_id}",
        "getResponse",
        "A stored response (this process's store)",
        rm.Response,
        (404, 500),
        path_params=("response_id",),
    ),
    Operation(
        "delete",
        "/v1/responses/{response_id}",
        "deleteResponse",
        "Forget a stored response",
        rm.DeletedResponse,
        (404, 500),
        path_params=("response_id",),
    ),
    Operation("get", "/v1/models", "listModels", "The served model", m.ModelList),
    Operation(
        "get",
        "/v1/models/{model_id}",
        "retrieveModel",
        "One model by name",
        m.ModelCard,
        (404, 500),
        path_params=("model_id",),
    ),
    Operation(
        "get",
        "/health",
        "health",
        "Readiness (503 while unhealthy or draining)",
        m.Health,
        keyed=False,
    ),
    Operation("get", "/live", "live", "Liveness: 200 while the process runs", m.Live, keyed=False),
)


def openapi_document(
    request_models: Mapping[str, type[msgspec.Struct]],
    *,
    limits: RequestLimits,
    context_length: int,
    api_keys: bool,
    model_names: list[str] | None = None,
    operations: tuple[Operation, ...] = OPERATIONS,
) -> dict[str, Any]:
    """The document, for a server whose routes validate with *request_models* (by
    endpoint), enforce *limits* and *context_length*, need a key if *api_keys*, and
    serve *model_names* (if given, the values ``model`` may take: another is a 404)."""
    bodies = {op.endpoint: request_models[op.endpoint] for op in operations if op.endpoint}
    types: list[Any] = [*bodies.values(), *{op.error_body for op in operations}]
    types += [op.response for op in operations]
    types += [op.stream_event for op in operations if op.stream_event]
    _, schemas = msgspec.json.schema_components(types, ref_template=_REF)
    for cls in rm.TAG_OPTIONAL:  # (a message item's `type`: the route fills it in)
        if (component := schemas.get(cls.__name__)) is not None:
            component["required"].remove(cls.__struct_config__.tag_field)
    for model in bodies.values():
        schema = schemas[model.__name__]
        _write_limits(schemas, schema, limits, context_length)
        if one_of := getattr(model, "one_of", ()):  # exactly one of these fields
            schema["oneOf"] = [{"required": [name]} for name in one_of]
        if model_names is not None and "model" in schema.get("properties", {}):
            _bound(schema["properties"]["model"], string={"enum": model_names})
    if limits.max_prompt_chars:
        _bound_text(
            schemas, [schemas[model.__name__] for model in bodies.values()], limits.max_prompt_chars
        )

    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = _operation(
            op, bodies.get(op.endpoint) if op.endpoint else None, limits, api_keys
        )
    components: dict[str, Any] = {"schemas": dict(sorted(schemas.items()))}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "headwater",
            "version": _version(),
            "description": "An OpenAI-compatible frontend for LLM inference serving. Errors "
            'are OpenAI\'s {"error": {message, type, param, code}}; after a '
            "stream started, an `error` event, then `data: [DONE]`.",
        },
        "paths": paths,
        "components": components,
    }
    if api_keys:
        components["securitySchemes"] = {
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "description": "Authorization: Bearer <one of --api-key>",
            },
        }
        doc["security"] = [{"bearerAuth": []}]
    return doc


def openapi_json(request_models: Mapping[str, type[msgspec.Struct]], **kwargs: Any) -> bytes:
    """:func:`openapi_document` as the bytes the route serves."""
    return orjson.dumps(openapi_document(request_models, **kwargs))


def _operation(
    op: Operation, body: type[msgspec.Struct] | None, limits: RequestLimits, api_keys: bool
) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": _ref(op.response)}}
    if op.stream_event is not None:
        ok["text/event-stream"] = {"schema": _event_stream(op)}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    errors = set(op.errors)
    if op.endpoint and limits.request_timeout:
        errors.add(504)
    if op.keyed and api_keys:
        errors.add(401)
    for status in sorted(errors):
        responses[str(status)] = _error_response(status, op.error_body)
    if op.response is m.Health:  # /health answers 503 with its own body
        responses["503"] = {"description": "Unhealthy or draining", "content": ok}
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "responses": responses,
    }
    if op.path_params:
        out["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in op.path_params
        ]
    if body is not None:
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    if api_keys and not op.keyed:
        out["security"] = []
    return out


def _event_stream(op: Operation) -> dict[str, Any]:
    """The schema of one server-sent event of *op*'s stream. OpenAPI 3.1 has a stream's
    schema describe one event (3.2's itemSchema), its fields strings; ``data`` holds
    JSON, or OpenAI's last event's [DONE]."""
    events = _refs_of(op.stream_event)
    names = " | ".join(r["$ref"].rsplit("/", 1)[1] for r in events)
    error = op.error_body.__name__
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [*events, _ref(op.error_body)]},
    }
    if op.sse_done:
        return {
            "type": "object",
            "description": f'With "stream": true: server-sent events, each '
            f"`data: <{names}>`, then `data: [DONE]`; an error after the "
            f"stream started is an event whose data is an {error}, then "
            "`data: [DONE]`.",
            "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        }
    return {
        "type": "object",
        "description": f'With "stream": true: server-sent events, each `event: <type>` '
        f"and `data: <{names}>` of that type; an error after the stream "
        f"started is an `error` event whose data is an {error}.",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": json_data},
    }


def _refs_of(types: Any) -> list[dict[str, str]]:
    """A ``$ref`` per Struct of *types* (one Struct, or a union of them)."""
    return [_ref(t) for t in (get_args(types) or (types,))]


def _error_response(status: int, body: type[msgspec.Struct] = m.ErrorResponse) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": ERROR_STATUSES[status],
        "content": {"application/json": {"schema": _ref(body)}},
    }
    if status == 429:
        response["headers"] = {
            "Retry-After": {
                "description": "seconds",
                "required": True,
                "schema": {"type": "string"},
            }
        }
    elif status == 401:
        response["headers"] = {
            "WWW-Authenticate": {
                "description": "Bearer",
                "required": True,
                "schema": {"type": "string"},
            }
        }
    return response


def _ref(model: type[msgspec.Struct]) -> dict[str, str]:
    return {"$ref": _REF.format(name=model.__name__)}


def _write_limits(
    schemas: dict[str, Any], schema: dict[str, Any], limits: RequestLimits, context_length: int
) -> None:
    """Write *limits* into a request model's schema, where its fields are (the token-in
    API's ``max_tokens`` is in the ``sampling_params`` model it refers to)."""
    props: dict[str, Any] = schema.get("properties", {})
    cap = limits.max_tokens_cap or context_length
    nested = [
        schemas[ref.rsplit("/", 1)[1]]
        for b in _branches(props.get("sampling_params", {}))
        if (ref := b.get("$ref"))
    ]
    for where in (props, *(n.get("properties", {}) for n in nested)):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in where:
                _bound(where[name], integer={"maximum": cap})
    if "messages" in props and limits.max_messages:
        _bound(props["messages"], array={"maxItems": limits.max_messages})
    for name in ("messages", "prompt"):
        if name in props and limits.max_prompt_chars:
            _note(
                props[name],
                f"At most {limits.max_prompt_chars} characters of text in all "
                "(--max-prompt-chars).",
            )
    each = {"maxLength": limits.max_stop_length} if limits.max_stop_length else {}
    many = {"maxItems": limits.max_stop_strings} if limits.max_stop_strings else {}
    for where in (props, *(n.get("properties", {}) for n in nested)):
        for name in ("stop", "stop_sequences"):  # OpenAI's (the token-in API takes none,
            if name in where:  # but bounds what it refuses too), Anthropic's
                _bound(where[name], string=each, array={**many, "items": each} if each else many)
        if "stop_token_ids" in where and limits.max_stop_token_ids:
            _bound(where["stop_token_ids"], array={"maxItems": limits.max_stop_token_ids})
    if "tools" in props and limits.max_tools:
        _bound(props["tools"], array={"maxItems": limits.max_tools})
    if "input" in props and limits.max_messages:  # the Responses API's items
        _bound(props["input"], array={"maxItems": limits.max_messages})
    ids = {"maxItems": context_length - 1}  # a prompt of ids leaves room for one token
    if "tokens" in props:  # /detokenize's
        _bound(props["tokens"], array={"maxItems": context_length})
    if "token_ids" in props:
        _bound(props["token_ids"], array=ids)
    if "prompt" in props:  # a list of one prompt: a string, or ids, or a list of ids
        _bound(props["prompt"], array=ids)
        for branch in _branches(props["prompt"]):
            for item in _branches(branch.get("items", {})):
                if item.get("type") == "array":
                    item.update(ids)


def _bound_text(schemas: dict[str, Any], roots: list[dict[str, Any]], chars: int) -> None:
    """Give every string below *roots* (request bodies) that has no bound yet a
    ``maxLength`` of *chars* (``--max-prompt-chars``): the text of a request, which counts
    against that limit in all. Follows references to the models the bodies use."""
    seen: set[int] = set()
    stack: list[Any] = list(roots)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if (ref := node.get("$ref")) is not None:
            stack.append(schemas[ref.rsplit("/", 1)[1]])
        if node.get("type") == "string" and "maxLength" not in node and "enum" not in node:
            node["maxLength"] = chars
        stack.extend(v for k, v in node.items() if k not in ("default", "examples", "const"))


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of *schema*, nested ``anyOf`` flattened."""
    if "anyOf" not in schema:
        return [schema]
    return [leaf for branch in schema["anyOf"] for leaf in _branches(branch)]


def _bound(schema: dict[str, Any], **by_type: dict[str, Any]) -> None:
    """Add keywords to the branches of *schema* of each JSON type named (``integer=``,
    ``array=``, ``string=``); an array's ``items`` are merged, not replaced."""
    for branch in _branches(schema):
        extra = by_type.get(branch.get("type", ""))
        if not extra:
            continue
        for key, value in extra.items():
            if key == "items" and isinstance(branch.get("items"), dict):
                _bound(branch["items"], string=value)
            else:
                branch[key] = value


def _note(schema: dict[str, Any], text: str) -> None:
    schema["description"] = f"{schema['description']} {text}" if "description" in schema else text


def _version() -> str:
    try:
        return metadata.version("headwater")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        return "0"
