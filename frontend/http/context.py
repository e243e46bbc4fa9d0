"""What a family of routes gets from the app: the pipeline, the limits, and the one way
every generation request is served.

The app (:mod:`frontend.http.app`) owns the request path's common parts: reading a JSON
body (bounded as it arrives), the deadline, the metrics, errors before and after a
stream started (``_serve``).
The route families that translate another API onto the pipeline (``/tokenize``,
Anthropic's Messages, OpenAI's Responses) take them from an :class:`ApiContext`, so that
each family is only its own schema, translation and response format.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
import trio
from quart import Response

from frontend.catalog import ModelCatalog
from frontend.deadline import Deadline
from frontend.errors import FrontendError
from frontend.http.errors import ApiError, api_error
from frontend.http.responses import D, ResponseFormat
from frontend.limits import RequestLimits
from frontend.metrics import FrontendMetrics
from frontend.pipeline import Pipeline, Prepared, R


class Serve(Protocol):
    """The app's ``_serve``: *prepare* a request (the preprocess stage of *pipeline*,
    its model's), *produce* its deltas and answer them in *response_format*, unary or
    streamed, before the request's deadline; books the metrics under *endpoint* and the
    model."""

    async def __call__(
        self,
        endpoint: str,
        stream: bool,
        prepare: Callable[[], Awaitable[Prepared[R]]],
        produce: Callable[[Prepared[R]], AsyncGenerator[D, None]],
        response_format: Callable[[Prepared[R]], ResponseFormat[D]],
        *,
        pipeline: Pipeline,
    ) -> Response: ...


@dataclass(frozen=True, slots=True)
class ApiContext:
    """The app's parts a route family uses (see the module docstring)."""

    #: The served models' pipelines: a request's is its ``model``'s (:meth:`check_model`).
    catalog: ModelCatalog
    limits: RequestLimits
    #: The request models by endpoint (the app's copy of REQUEST_MODELS).
    models: Mapping[str, type[msgspec.Struct]]
    metrics: FrontendMetrics
    serve: Serve
    #: The request's JSON body as it arrived (415 if it is not JSON), its values counted
    #: (``--max-json-values``): decode it with :func:`frontend.http.schema.decode`.
    read_body: Callable[[], Awaitable[bytes]]

    async def answer(self, endpoint: str, work: Callable[[], Awaitable[Response]]) -> Response:
        """Run *work*, a request that does not generate (tokenize, count tokens), before
        the request's deadline; book it in ``requests_total`` under *endpoint*."""
        status = "error"
        try:
            response = await Deadline(self.limits.request_timeout).run(work)
            status = "success"
            return response
        except (ApiError, FrontendError) as err:
            http = err if isinstance(err, ApiError) else api_error(err)
            status = "error" if http.status >= 500 else "rejected"
            raise
        except trio.Cancelled:
            status = "cancelled"
            raise
        finally:
            self.metrics.requests_total.labels(endpoint, "unary", status, "").inc()

    def check_model(self, model: str | None) -> Pipeline:
        """The pipeline of the served model *model* (None: unnamed, the primary model's).
        Raises UnknownModel (a 404) for a model not served."""
        return self.catalog.get(model)
