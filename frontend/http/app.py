"""The HTTP API, on quart-trio: OpenAI's, a token-in one, and the route families that
translate other APIs onto the same pipeline.

Each request runs in its own task inside quart-trio's per-request nursery, beside a
task watching for the client's disconnect; a disconnect cancels the handler (or the
SSE body), which unwinds the pipeline and cancels the work on the worker.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI's API, unary
and SSE), ``POST /inference/v1/generate`` (the token-in API, vLLM's shape: token ids
in and out, unary and SSE), ``GET /v1/models``, ``GET /v1/models/<id>``,
``GET /health``, ``GET /live``, and ``GET /openapi.json``, the document of them all
(:mod:`frontend.http.openapi`, from the same models the routes validate with).
Route families in modules of their own, given the app's parts as an
:class:`~frontend.http.context.ApiContext`: ``/tokenize`` and ``/detokenize``
(:mod:`frontend.http.tokenize`, vLLM's shapes), Anthropic's Messages API
(:mod:`frontend.http.anthropic`) and OpenAI's Responses API
(:mod:`frontend.http.responses_api`). Every POST route that generates goes through one
``_serve``: the pipeline, the metrics, the request's
deadline (``--request-timeout``), errors before and after a stream started; the routes
differ only in their schema, their preprocess stage, what they take from the pipeline
(text or token deltas) and their response format (:mod:`frontend.http.responses`).
A refusal by a configured limit (:mod:`frontend.limits`; the body size; the deadline)
is counted in ``rejected_requests_total`` under the limit's name.
Observability routes (``/metrics``, ``/debug/*``, ``/dashboard``) come from
:mod:`frontend.http.observability`. The generation and tokenizer routes
(:data:`ADMITTED_PATHS`) are admitted by :mod:`frontend.http.admission` before their
handler runs; ``/health`` says 503 ``draining`` once a drain has begun, ``/live`` stays
200 until the process ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from frontend.catalog import ModelCatalog
from frontend.deadline import Deadline
from frontend.errors import FrontendError, NoWorkers, UnknownModel
from frontend.http.admission import Admission
from frontend.http.anthropic.routes import MESSAGES_PATH, MESSAGES_PATHS, add_messages_routes
from frontend.http.connection import LastPiece, use_ending_connection
from frontend.http.context import ApiContext
from frontend.http.errors import ApiError, api_error, loggable, rendered
from frontend.http.models import REQUEST_MODELS
from frontend.http.openapi import OPENAPI_PATH, openapi_json
from frontend.http.responses import (
    JSON,
    D,
    OpenAIFormat,
    ResponseFormat,
    TokenFormat,
    json_response,
)
from frontend.http.responses_api.routes import RESPONSES_PATH, add_responses_routes
from frontend.http.responses_api.store import ResponseStore
from frontend.http.routing import use_memo_matcher
from frontend.http.schema import count_json_values, parse_generate_request, parse_request
from frontend.http.tokenize import TOKENIZE_PATHS, add_tokenize_routes
from frontend.limits import LIMITS, RequestLimits
from frontend.metrics import FrontendMetrics
from frontend.pipeline import Pipeline, Prepared, R

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/inference/v1/generate"  # the token-in API
#: The routes that generate: each gets a root span when tracing is on.
GENERATION_PATHS = frozenset(
    {CHAT_PATH, COMPLETIONS_PATH, GENERATE_PATH, MESSAGES_PATH, RESPONSES_PATH}
)
#: The routes admission control guards: those that generate, and those that take the
#: tokenizer pool's time without generating (``/tokenize``, ``count_tokens``).
ADMITTED_PATHS = GENERATION_PATHS | TOKENIZE_PATHS | MESSAGES_PATHS


def error_response(err: ApiError, path: str) -> Response:
    """*err* as the API at *path* answers it (:func:`~frontend.http.errors.rendered`)."""
    status, body = rendered(err, path)
    response = json_response(body, status)
    response.headers.update(err.headers)
    return response


def create_app(
    catalog: ModelCatalog,
    metrics: FrontendMetrics,
    *,
    max_body_bytes: int,
    admission: Admission,
    limits: RequestLimits | None = None,
    api_keys: bool = False,
    responses_store: ResponseStore | None = None,
) -> QuartTrio:
    """Build the app, serving the models of *catalog* (each request its ``model``'s
    pipeline; docs/api.md, "Several models"). The caller owns *catalog* and serves the
    app with hypercorn, behind :class:`~frontend.http.admission.AdmissionControl` with
    the same *admission* (which this app reads for ``/health``), and behind
    :class:`~frontend.http.auth.RequireApiKey` if *api_keys* (which ``/openapi.json``
    then declares). *limits* default to :class:`~frontend.limits.RequestLimits`'s;
    *responses_store* keeps the Responses API's stored responses (default: a store of
    the default bounds)."""
    lim = limits or RequestLimits()
    # The models the routes validate with, read once: the document describes these.
    bodies = dict(REQUEST_MODELS)
    pipeline = catalog.primary
    document = openapi_json(
        bodies,
        limits=lim,
        context_length=max(p.context_length for p in catalog),
        api_keys=api_keys,
        model_names=catalog.names() if not catalog.discovers else None,
    )
    for name in LIMITS:  # every series from the start, at 0: rate() sees the first
        metrics.rejected_requests_total.labels(name)
    app = QuartTrio("headwater")
    use_memo_matcher(app)  # no reference cycle per request (frontend/http/routing.py)
    use_ending_connection(app)  # a response ends with its last piece (connection.py)
    # Quart cuts responses at RESPONSE_TIMEOUT (60 s by default): that silently
    # truncates long SSE streams. Request lifetimes are ours to manage.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    created = int(time.time())

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError) -> Response:
        return error_response(err, request.path)

    @app.errorhandler(FrontendError)
    async def _frontend_error(err: FrontendError) -> Response:
        _count_limit(err)
        return error_response(api_error(err), request.path)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 413:
            metrics.rejected_requests_total.labels("max_body_bytes").inc()
        messages = {
            404: f"Unknown path {request.path}",
            405: f"Method {request.method} is not allowed on {request.path}",
            413: f"Request body is larger than the limit of {max_body_bytes} bytes",
        }
        # A 405 says which methods the path takes (RFC 9110 requires Allow).
        allowed = getattr(exc, "valid_methods", None) if status == 405 else None
        headers = {"Allow": ", ".join(allowed)} if allowed else None
        return error_response(
            ApiError(status, messages.get(status, exc.description or ""), headers=headers),
            request.path,
        )

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", loggable(request.method), loggable(request.path))
        return error_response(ApiError(500, "Internal server error"), request.path)

    @app.get("/live")
    async def live() -> Response:
        return json_response({"status": "live"})

    @app.get("/health")
    async def health() -> Response:
        # Draining: a load balancer should send new requests elsewhere, at once.
        draining = admission.draining
        ok = pipeline.ready() and not draining
        views = [
            {"worker_id": v.worker_id, "role": v.role.value, "state": v.state.value}
            for v in pipeline.router.views()
        ]
        status = "draining" if draining else "healthy" if ok else "unhealthy"
        return json_response({"status": status, "workers": views}, 200 if ok else 503)

    @app.get(OPENAPI_PATH)
    async def openapi() -> Response:
        return json_response(document)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [_model_card(name, created) for name in catalog.names()]
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/<path:model_id>")
    async def model_card(model_id: str) -> Response:
        if model_id not in catalog.names():
            raise UnknownModel(model_id)
        return json_response(_model_card(model_id, created))

    @app.post(CHAT_PATH)
    async def chat() -> Response:
        return await _serve_openai("chat")

    @app.post(COMPLETIONS_PATH)
    async def completions() -> Response:
        return await _serve_openai("completions")

    @app.post(GENERATE_PATH)
    async def generate() -> Response:
        """The token-in API: token ids in, token ids out (vLLM's shape)."""
        parsed = parse_generate_request(await _parse(), lim, model=bodies["generate"])
        served = catalog.get(parsed.model)
        return await _serve(
            "generate",
            parsed.stream,
            partial(served.preprocess_tokens, parsed),
            served.tokens,
            TokenFormat,
            pipeline=served,
        )

    async def _serve_openai(endpoint: str) -> Response:
        parsed = parse_request(await _parse(), endpoint, lim, model=bodies[endpoint])
        served = catalog.get(parsed.model)
        return await _serve(
            endpoint,
            parsed.stream,
            partial(served.preprocess, parsed),
            served.generate,
            partial(OpenAIFormat, reasoning_field=served.parsers.reasoning_field),
            pipeline=served,
        )

    async def _serve(
        endpoint: str,
        stream: bool,
        prepare: Callable[[], Awaitable[Prepared[R]]],
        produce: Callable[[Prepared[R]], AsyncGenerator[D, None]],
        response_format: Callable[[Prepared[R]], ResponseFormat[D]],
        *,
        pipeline: Pipeline,
    ) -> Response:
        """Serve one validated request, whichever API: *prepare* it (the preprocess
        stage of *pipeline*, its model's), then *produce* its deltas (the rest of the
        pipeline) and answer them in *response_format*, as one body or as SSE, all before
        the request's deadline. Books its metrics, labelled with the model."""
        kind = "stream" if stream else "unary"
        model = pipeline.model_name
        status = "error"
        deadline = Deadline(lim.request_timeout)
        try:
            prep = await deadline.run(prepare)
            metrics.input_sequence_tokens.labels(model).observe(len(prep.prompt_ids))
            if not pipeline.ready():
                raise NoWorkers("no routable worker for this model")
            fmt = response_format(prep)
            if stream:
                status = "streaming"  # the body generator books the final status
                body = _stream(endpoint, model, prep, deadline.iterate(produce(prep)), fmt)
                return Response(body, content_type="text/event-stream", headers=SSE_HEADERS)
            response = await _unary(model, prep, deadline.iterate(produce(prep)), fmt)
            status = "success"
            return response
        except (ApiError, FrontendError) as err:
            as_http = err if isinstance(err, ApiError) else api_error(err)
            status = "error" if as_http.status >= 500 else "rejected"
            raise
        except trio.Cancelled:
            status = "cancelled"  # the client went away: quart-trio cancelled us
            _client_gone()
            raise
        except Exception:
            status = "error"  # becomes a sanitized 500
            raise
        finally:
            if status != "streaming":
                metrics.requests_total.labels(endpoint, kind, status, model).inc()

    def _count_limit(err: FrontendError) -> None:
        if err.limit is not None:
            metrics.rejected_requests_total.labels(err.limit).inc()

    def _client_gone() -> None:
        # Leaving the pipeline cancelled the request on its worker too.
        metrics.disconnected_clients.inc()
        metrics.model_cancellation_total.inc()

    async def _parse() -> bytes:
        """The request's JSON body, as it arrives (415 if it is not JSON), its values
        counted once it is large enough to hold more than ``max_json_values`` (a value
        takes two bytes at least): the parse that follows is bounded by that count."""
        mimetype = request.mimetype
        if mimetype != JSON:
            raise ApiError(
                415,
                f"Content-Type must be {JSON}, got {mimetype or 'none'}",
                code="unsupported_media_type",
            )
        budget = lim.max_json_values
        pieces: list[bytes] = []
        size = values = counted = 0
        async for piece in request.body:
            pieces.append(piece)
            size += len(piece)
            if budget and size > 2 * budget:  # each piece counted once, as it arrives
                values += sum(map(count_json_values, pieces[counted:]))
                counted = len(pieces)
                lim.check_json_values(values)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def _unary(
        model: str, prep: Prepared[R], produced: AsyncGenerator[D, None], fmt: ResponseFormat[D]
    ) -> Response:
        start = trio.current_time()
        async with aclosing(produced) as stream:
            deltas = [d async for d in stream]
        # The pipeline always ends with a finishing delta (or raises).
        last = deltas[-1]
        metrics.output_sequence_tokens.labels(model).observe(last.completion_tokens)
        metrics.request_duration_seconds.labels(model).observe(trio.current_time() - start)
        return json_response(fmt.unary(deltas))

    async def _stream(
        endpoint: str,
        model: str,
        prep: Prepared[R],
        produced: AsyncGenerator[D, None],
        fmt: ResponseFormat[D],
    ) -> AsyncIterator[bytes]:
        """The SSE body. Events that are ready together leave in one write: the opening
        (a chat stream's role chunk) with the first delta, the last delta with usage,
        ``[DONE]`` and the body's end (a :class:`LastPiece`). Each write is a pass
        through Quart, hypercorn, the protocol and a ``write(2)`` on the loop, and a
        wake-up of the client: a short stream (8 tokens, c64) makes 5.2 writes, 6.5
        while the body's end went alone (docs/performance.md, "The HTTP path")."""
        status = "cancelled"
        last: D | None = None
        pending = fmt.opening()  # written with the next event
        try:
            async with aclosing(produced) as deltas:
                async for d in deltas:
                    last = d
                    pending += fmt.event(d)
                    if not d.final:
                        yield pending
                        pending = b""
            if last is not None and prep.parsed.include_usage:
                pending += fmt.usage(last)
            status = "success"
        except FrontendError as err:
            # Headers are gone already: report in-stream, as OpenAI does.
            status = "error"
            _count_limit(err)
            pending += fmt.error(api_error(err))
        except Exception:
            status = "error"
            log.exception("stream %s failed", prep.request_id)
            pending += fmt.error(ApiError(500, "Internal server error"))
        finally:
            if status == "cancelled":
                _client_gone()
            elif last is not None:
                metrics.output_sequence_tokens.labels(model).observe(last.completion_tokens)
            metrics.request_duration_seconds.labels(model).observe(
                trio.current_time() - prep.started
            )
            metrics.requests_total.labels(endpoint, "stream", status, model).inc()
        yield LastPiece(pending + fmt.DONE)

    api = ApiContext(catalog, lim, bodies, metrics, _serve, _parse)
    add_tokenize_routes(app, api)
    add_messages_routes(app, api)
    add_responses_routes(app, api, responses_store or ResponseStore())
    return app


def _model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "headwater"}
