"""Observability routes: metrics, debug views and the live dashboard.

Read-only views of the frontend's live state:

* ``GET /metrics``: Prometheus text format (``headwater_frontend_*``).
* ``GET /debug/stalls``: the stall records, oldest first (JSON list).
* ``GET /debug/workers``: every known worker, its state, load and last error.
* ``GET /debug/runtime``: what the process holds now: trio tasks (by name), open file
  descriptors, threads, RSS (:mod:`headwater.instrumentation.runtime`), for leak hunts.
* ``GET /debug/heap``: Python allocations by the line that made them, and what grew since
  ``?mark``, when the process was started with ``PYTHONTRACEMALLOC``
  (:mod:`headwater.instrumentation.heap`).
* ``GET /dashboard``: a self-contained page (:mod:`frontend.http.dashboard`) that polls
  ``GET /dashboard/data``, a JSON snapshot of all of the above and of this process's
  memory (RSS, PSS, USS).

In a group of processes (``headwater serve --processes N``, *group* given), ``/metrics``
and ``/dashboard/data`` asked on the shared port answer for the whole group: they are
relayed to the supervisor (:mod:`frontend.http.group`). On the process's private port
they answer for it alone.

And one route that is not read-only, served only with ``debug_endpoints`` on (a 404
otherwise): ``POST /debug/stall?ms=N`` blocks the event loop for N ms on purpose, so
tests and demos can show the stall detector and the dashboard catching it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Final

import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio

from frontend.http.dashboard import ASSETS, LoadHistory, load_asset, snapshot
from frontend.http.errors import ApiError, bad_request
from frontend.http.group import GroupRelay, GroupViewUnavailable
from frontend.http.observed import Observed
from headwater.instrumentation.heap import heap_report
from headwater.instrumentation.runtime import runtime_snapshot
from headwater.procmem import read_memory

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"

#: Longest stall ``POST /debug/stall`` injects, in ms (twice the default ACK timeout).
MAX_INJECTED_STALL_MS: Final = 10_000

#: The page loads only its own files and data: no other host, no inline code.
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_own_view(path: str) -> bool:
    """The server's own views of itself (metrics, health, dashboard, debug), which
    ``http_responses_total`` leaves out: scrapes, probes and a dashboard's polls would
    outnumber the API's answers."""
    return path in ("/metrics", "/health", "/live") or path.startswith(("/dashboard", "/debug/"))


def add_observability_routes(
    app: QuartTrio,
    frontend: Observed,
    *,
    debug_endpoints: bool = False,
    group: GroupRelay | None = None,
) -> None:
    """Register the routes above on *app*, reading *frontend*'s parts; the debug route
    only with *debug_endpoints*; the group's views relayed through *group*."""
    history = LoadHistory()

    async def relayed() -> Response | None:
        """The group's answer, when this request came in on the shared port."""
        if group is None or not group.is_shared(request.scope.get("server")):
            return None
        target = request.full_path.rstrip("?")
        try:
            answer = await group.get(target, request.headers.get("Authorization"))
        except GroupViewUnavailable as exc:
            log.warning("%s", exc)
            raise ApiError(
                503,
                "the group's view is unavailable; each process's own is on its private port",
                type="service_unavailable",
            ) from exc
        return Response(
            answer.body,
            status=answer.status,
            content_type=answer.content_type,
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        if (answer := await relayed()) is not None:
            return answer
        names = request.args.getlist("name[]")  # some series only, as prometheus-client
        return Response(frontend.metrics.render(names or None), content_type=PROMETHEUS_TEXT)

    @app.get("/debug/stalls")
    async def stalls() -> Response:
        records = [r.to_dict() for r in frontend.monitor.records()]
        return Response(orjson.dumps(records), content_type=JSON)

    @app.get("/debug/workers")
    async def workers() -> Response:
        return Response(orjson.dumps(workers_snapshot(frontend)), content_type=JSON)

    @app.get("/debug/runtime")
    async def runtime() -> Response:
        body = orjson.dumps(runtime_snapshot().to_dict())
        return Response(body, content_type=JSON, headers={"Cache-Control": "no-store"})

    @app.get("/debug/heap")
    async def heap() -> Response:
        # Opt-in (PYTHONTRACEMALLOC): headwater/instrumentation/heap.py says why.
        report = heap_report(mark="mark" in request.args, trim="trim" in request.args)
        return Response(
            orjson.dumps(report), content_type=JSON, headers={"Cache-Control": "no-store"}
        )

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return _asset("index.html")

    @app.get("/dashboard/<name>")
    async def dashboard_asset(name: str) -> Response:
        if name not in ASSETS or name == "index.html":
            raise ApiError(404, f"Unknown path {request.path}")
        return _asset(name)

    @app.get("/dashboard/data")
    async def dashboard_data() -> Response:
        after = _float_arg("stalls_after")
        if (answer := await relayed()) is not None:
            return answer
        try:  # the kernel walks our page tables: a few ms, off the loop
            memory = [{"role": "frontend", **(await trio.to_thread.run_sync(read_memory)).to_mb()}]
        except (OSError, ValueError):
            memory = []
        body = orjson.dumps(snapshot(frontend, history, stalls_after=after, memory=memory))
        return Response(body, content_type=JSON, headers={"Cache-Control": "no-store"})

    if debug_endpoints:

        @app.post("/debug/stall")
        async def debug_stall() -> Response:
            ms = _stall_ms()
            log.warning("debug endpoint: blocking the event loop for %d ms on purpose", ms)
            took = inject_loop_stall(ms / 1000)
            return Response(
                orjson.dumps({"requested_ms": ms, "blocked_ms": round(took * 1000, 3)}),
                content_type=JSON,
            )


def workers_snapshot(frontend: Observed) -> list[dict[str, Any]]:
    """What ``/debug/workers`` answers: one dict per :class:`~frontend.router.WorkerView`."""
    return [dataclasses.asdict(v) for v in frontend.router.views()]


def inject_loop_stall(seconds: float) -> float:
    """Block the calling thread for *seconds* and return how long it was blocked.

    Called on the event loop by ``POST /debug/stall`` only (``debug_endpoints``), this
    IS a stall: every task waits, and the stall detector records this function's frame.
    """
    started = time.perf_counter()
    time.sleep(seconds)  # the deliberate injection: blocks the event loop on purpose
    return time.perf_counter() - started


def _asset(name: str) -> Response:
    return Response(load_asset(name), content_type=ASSETS[name], headers=_PAGE_HEADERS)


def _float_arg(name: str) -> float | None:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {raw!r}", name)
    return value


def _stall_ms() -> int:
    raw = request.args.get("ms", "200")
    try:
        ms = int(raw)
    except ValueError:
        ms = 0
    if not 1 <= ms <= MAX_INJECTED_STALL_MS:
        raise bad_request(f"ms must be an integer from 1 to {MAX_INJECTED_STALL_MS}", "ms")
    return ms
