"""Observability routes: ``/metrics``, ``/debug/stalls``, ``/debug/workers``.

Read-only views of the frontend's live state. (The dashboard page is added here too.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import orjson
from quart import Response
from quart_trio import QuartTrio

if TYPE_CHECKING:
    from frontend.server import Frontend

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def add_observability_routes(app: QuartTrio, frontend: Frontend) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), content_type=PROMETHEUS_TEXT)

    @app.get("/debug/stalls")
    async def stalls() -> Response:
        records = [r.to_dict() for r in frontend.monitor.records()]
        return Response(orjson.dumps(records), content_type="application/json")

    @app.get("/debug/workers")
    async def workers() -> Response:
        return Response(orjson.dumps(workers_snapshot(frontend)), content_type="application/json")


def workers_snapshot(frontend: Frontend) -> list[dict[str, Any]]:
    return [dataclasses.asdict(v) for v in frontend.router.views()]
