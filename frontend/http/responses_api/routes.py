"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``.

A request is validated (:mod:`.models`, its input items one by one),
translated into the chat pipeline's request with the conversation of its
``previous_response_id`` (:mod:`.translate`, :mod:`.store`), and served by the app's one
request path; its deltas are answered as a response object or its events
(:mod:`.format`), which, with ``store``, is kept in the process's store once complete.
A response that failed, or whose client left, is not stored.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import orjson
from quart import Response
from quart_trio import QuartTrio

from frontend.http.context import ApiContext
from frontend.http.errors import ApiError
from frontend.http.responses import json_response
from frontend.http.responses_api.format import ResponsesFormat
from frontend.http.responses_api.models import ResponsesWire
from frontend.http.responses_api.store import ResponseStore
from frontend.http.responses_api.translate import Translated, translate
from frontend.http.schema import decode

RESPONSES_PATH = "/v1/responses"


def add_responses_routes(app: QuartTrio, api: ApiContext, store: ResponseStore) -> None:
    """The Responses API's routes on *app*, keeping responses in *store*."""

    @app.post(RESPONSES_PATH)
    async def create() -> Response:
        # The published model, but with the input items kept as text: each is decoded on
        # its own (translate.decode_items), an "easy" message having no type to go by.
        req = cast(ResponsesWire, decode(await api.read_body(), ResponsesWire))
        pipeline = api.check_model(req.model)
        out = translate(req, api.limits, store)
        on_done = partial(_keep, store, out) if out.echo["store"] else None
        return await api.serve(
            "responses",
            out.parsed.stream,
            partial(pipeline.preprocess, out.parsed),
            pipeline.generate,
            partial(
                ResponsesFormat,
                echo=out.echo,
                max_tool_calls=out.max_tool_calls,
                encrypted_reasoning=out.encrypted_reasoning,
                on_done=on_done,
            ),
            pipeline=pipeline,
        )

    @app.get(RESPONSES_PATH + "/<response_id>")
    async def retrieve(response_id: str) -> Response:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return json_response(entry.body)

    @app.delete(RESPONSES_PATH + "/<response_id>")
    async def delete(response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _keep(
    store: ResponseStore, out: Translated, response_id: str, body: bytes, answer: dict[str, Any]
) -> None:
    """Store a finished response: its body, and its turn (its input and its answer)."""
    turn = [*out.turn, answer]
    store.put(response_id, body, out.echo["previous_response_id"], turn, len(orjson.dumps(turn)))


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param="response_id",
        code="response_not_found",
    )
