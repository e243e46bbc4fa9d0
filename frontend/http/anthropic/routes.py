"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is validated (:mod:`frontend.http.anthropic.models`), translated
into the chat pipeline's request (:mod:`frontend.http.anthropic.translate`) and served
by the app's one request path (the deadline, the metrics, errors before and after a
stream started), its deltas answered as Anthropic's Message or events
(:mod:`frontend.http.anthropic.format`). ``count_tokens`` renders and tokenizes the same
prompt, as a ``/tokenize`` of it, without generating.

The ``anthropic-version`` and ``anthropic-beta`` headers are accepted and not needed:
there is one version of this API here. Errors on these paths are Anthropic's
(:mod:`frontend.http.anthropic.errors`).
"""

from __future__ import annotations

from functools import partial
from typing import cast

from quart import Response
from quart_trio import QuartTrio

from frontend.http.anthropic.format import MessagesFormat
from frontend.http.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.http.anthropic.translate import translate
from frontend.http.context import ApiContext
from frontend.http.responses import json_response
from frontend.http.schema import decode

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MESSAGES_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})


def add_messages_routes(app: QuartTrio, api: ApiContext) -> None:
    """The Messages API's routes on *app*."""

    @app.post(MESSAGES_PATH)
    async def messages() -> Response:
        req = cast(MessagesRequest, decode(await api.read_body(), api.models["messages"]))
        pipeline = api.check_model(req.model)
        out = translate(req, api.limits)
        return await api.serve(
            "messages",
            out.parsed.stream,
            partial(pipeline.preprocess, out.parsed),
            pipeline.generate,
            partial(
                MessagesFormat, max_tool_calls=out.max_tool_calls, show_thinking=out.show_thinking
            ),
            pipeline=pipeline,
        )

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens() -> Response:
        async def work() -> Response:
            body = await api.read_body()
            req = cast(CountTokensRequest, decode(body, api.models["count_tokens"]))
            pipeline = api.check_model(req.model)
            ids = await pipeline.encode_prompt(translate(req, api.limits).parsed)
            return json_response({"input_tokens": len(ids)})

        return await api.answer("count_tokens", work)
