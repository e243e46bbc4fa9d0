"""The HTTP API, on quart-trio: OpenAI's, and a token-in one.

Each request runs in its own task inside quart-trio's per-request nursery, beside a
task watching for the client's disconnect; a disconnect cancels the handler (or the
SSE body), which unwinds the pipeline and cancels the work on the worker.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI's API, unary
and SSE), ``POST /inference/v1/generate`` (the token-in API, vLLM's shape: token ids
in and out, unary and SSE), ``GET /v1/models``, ``GET /v1/models/<id>``,
``GET /health``, ``GET /live``. Every POST route goes through one ``_serve``: the
pipeline, the metrics, errors before and after a stream started; the routes differ
only in their schema, their preprocess stage, what they take from the pipeline
(text or token deltas) and their response format (:mod:`frontend.http.responses`).
Observability routes (``/metrics``, ``/debug/*``, ``/dashboard``) come from
:mod:`frontend.http.observability`. The generation routes (:data:`GENERATION_PATHS`)
are admitted by :mod:`frontend.http.admission` before their handler runs; ``/health``
says 503 ``draining`` once a drain has begun, ``/live`` stays 200 until the process ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from frontend.errors import FrontendError, NoWorkers, UnknownModel
from frontend.http.admission import Admission
from frontend.http.errors import ApiError, api_error, bad_request
from frontend.http.responses import D, OpenAIFormat, ResponseFormat, TokenFormat
from frontend.http.schema import parse_generate_request, parse_request
from frontend.metrics import FrontendMetrics
from frontend.pipeline import Pipeline, Prepared, R

log = logging.getLogger(__name__)

JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/inference/v1/generate"  # the token-in API
#: The routes that generate, and so the ones admission control guards.
GENERATION_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH, GENERATE_PATH})


def json_response(body: bytes | dict[str, Any], status: int = 200) -> Response:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return Response(data, status=status, content_type=JSON)


def error_response(err: ApiError) -> Response:
    response = json_response(err.json(), err.status)
    response.headers.update(err.headers)
    return response


def create_app(
    pipeline: Pipeline, metrics: FrontendMetrics, *, max_body_bytes: int, admission: Admission
) -> QuartTrio:
    """Build the app. The caller owns *pipeline* and serves the app with hypercorn,
    behind :class:`~frontend.http.admission.AdmissionControl` with the same *admission*
    (which this app reads for ``/health``)."""
    app = QuartTrio("headwater")
    # Quart cuts responses at RESPONSE_TIMEOUT (60 s by default): that silently
    # truncates long SSE streams. Request lifetimes are ours to manage.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    created = int(time.time())
    model = pipeline.model_name

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError) -> Response:
        return error_response(err)

    @app.errorhandler(FrontendError)
    async def _frontend_error(err: FrontendError) -> Response:
        return error_response(api_error(err))

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        messages = {
            404: f"Unknown path {request.path}",
            405: f"Method {request.method} is not allowed on {request.path}",
            413: f"Request body is larger than the limit of {max_body_bytes} bytes",
        }
        return error_response(ApiError(status, messages.get(status, exc.description or "")))

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal server error"))

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

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(model, created)]})

    @app.get("/v1/models/<path:model_id>")
    async def model_card(model_id: str) -> Response:
        if model_id != model:
            raise UnknownModel(model_id)
        return json_response(_model_card(model, created))

    @app.post(CHAT_PATH)
    async def chat() -> Response:
        return await _serve_openai("chat")

    @app.post(COMPLETIONS_PATH)
    async def completions() -> Response:
        return await _serve_openai("completions")

    @app.post(GENERATE_PATH)
    async def generate() -> Response:
        """The token-in API: token ids in, token ids out (vLLM's shape)."""
        parsed = parse_generate_request(await _parse())
        if parsed.model is not None and parsed.model != model:
            raise UnknownModel(parsed.model)
        return await _serve(
            "generate", parsed.stream, partial(pipeline.preprocess_tokens, parsed),
            pipeline.tokens, TokenFormat,
        )  # fmt: skip

    async def _serve_openai(endpoint: str) -> Response:
        parsed = parse_request(await _parse(), endpoint)
        if parsed.model != model:
            raise UnknownModel(parsed.model)
        return await _serve(
            endpoint, parsed.stream, partial(pipeline.preprocess, parsed),
            pipeline.generate, OpenAIFormat,
        )  # fmt: skip

    async def _serve(
        endpoint: str,
        stream: bool,
        prepare: Callable[[], Awaitable[Prepared[R]]],
        produce: Callable[[Prepared[R]], AsyncGenerator[D, None]],
        response_format: Callable[[Prepared[R]], ResponseFormat[D]],
    ) -> Response:
        """Serve one validated request, whichever API: *prepare* it (the pipeline's
        preprocess stage), then *produce* its deltas (the rest of the pipeline) and
        answer them in *response_format*, as one body or as SSE. Books its metrics."""
        kind = "stream" if stream else "unary"
        status = "error"
        try:
            prep = await prepare()
            metrics.input_sequence_tokens.observe(len(prep.prompt_ids))
            if not pipeline.ready():
                raise NoWorkers("no routable worker for this model")
            if stream:
                status = "streaming"  # the body generator books the final status
                body = _stream(endpoint, prep, produce, response_format(prep))
                return Response(body, content_type="text/event-stream", headers=SSE_HEADERS)
            response = await _unary(prep, produce, response_format(prep))
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
                metrics.requests_total.labels(endpoint, kind, status).inc()

    def _client_gone() -> None:
        # Leaving the pipeline cancelled the request on its worker too.
        metrics.disconnected_clients.inc()
        metrics.model_cancellation_total.inc()

    async def _parse() -> Any:
        """The request's JSON body, decoded (415 if it is not JSON, 400 if malformed)."""
        mimetype = request.mimetype
        if mimetype != JSON:
            raise ApiError(
                415, f"Content-Type must be {JSON}, got {mimetype or 'none'}",
                code="unsupported_media_type",
            )
        data = await request.get_data(cache=False)
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"Malformed JSON body: {exc}") from exc

    async def _unary(
        prep: Prepared[R],
        produce: Callable[[Prepared[R]], AsyncGenerator[D, None]],
        fmt: ResponseFormat[D],
    ) -> Response:
        start = trio.current_time()
        async with aclosing(produce(prep)) as stream:
            deltas = [d async for d in stream]
        # The pipeline always ends with a finishing delta (or raises).
        last = deltas[-1]
        metrics.output_sequence_tokens.observe(last.completion_tokens)
        metrics.request_duration_seconds.observe(trio.current_time() - start)
        return json_response(fmt.unary(deltas))

    async def _stream(
        endpoint: str,
        prep: Prepared[R],
        produce: Callable[[Prepared[R]], AsyncGenerator[D, None]],
        fmt: ResponseFormat[D],
    ) -> AsyncIterator[bytes]:
        """The SSE body. Events that are ready together leave in one write: the opening
        (a chat stream's role chunk) with the first delta, the last delta with usage and
        ``[DONE]``. Each write is a pass through Quart, hypercorn, h11 and a send on the
        loop; a short stream takes a quarter fewer of them (docs/performance.md)."""
        status = "cancelled"
        last: D | None = None
        pending = fmt.opening()  # written with the next event
        try:
            async with aclosing(produce(prep)) as deltas:
                async for d in deltas:
                    last = d
                    pending += fmt.event(d)
                    if d.finish_reason is None:
                        yield pending
                        pending = b""
            if last is not None and prep.parsed.include_usage:
                pending += fmt.usage(last)
            status = "success"
        except FrontendError as err:
            # Headers are gone already: report in-stream, as OpenAI does.
            status = "error"
            pending += fmt.error(api_error(err).body())
        except Exception:
            status = "error"
            log.exception("stream %s failed", prep.request_id)
            pending += fmt.error(ApiError(500, "Internal server error").body())
        finally:
            if status == "cancelled":
                _client_gone()
            elif last is not None:
                metrics.output_sequence_tokens.observe(last.completion_tokens)
            metrics.request_duration_seconds.observe(trio.current_time() - prep.started)
            metrics.requests_total.labels(endpoint, "stream", status).inc()
        yield pending + fmt.DONE

    return app


def _model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "headwater"}
