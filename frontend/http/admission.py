"""Admission control: which generation requests this frontend takes, decided before any work.

:class:`Admission` holds the policy and the count: a generation request is refused
while ``max_inflight`` of them are in flight (429, reason ``max_inflight``), and every
one is refused once a drain has begun (503, reason ``shutting_down``). It does no I/O
and reports :meth:`Admission.statistics`. :class:`AdmissionControl` is the ASGI
middleware that asks it, for ``POST`` on the generation paths only: ``/health``,
``/live``, ``/metrics``, ``/v1/models`` and every other route are never refused.

Why ASGI middleware rather than a check in the handler: a refusal then costs no Quart
request object, no routing, no JSON decode and no tokenizer work, which is the point of
refusing under overload (a 40k-token body is ~240 kB of JSON). And the slot is held
for exactly the app's call, from the request head to the response's last byte (an SSE
stream included), so it is given back however the request ends: success, error,
cancellation, a client that left before the body started.

A refused request's body is read and dropped before the answer goes out
(:func:`frontend.http.middleware.discard_body`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from prometheus_client import Gauge

from frontend.http.errors import ApiError, shutting_down, too_many_requests
from frontend.http.middleware import discard_body, send_error
from frontend.metrics import FrontendMetrics

if TYPE_CHECKING:
    from hypercorn.typing import (
        ASGIFramework,
        ASGIReceiveCallable,
        ASGISendCallable,
        Scope,
    )


class Reason(enum.StrEnum):
    """Why a request was turned away: the ``reason`` label of
    ``headwater_frontend_rejected_requests_total``. Another limit adds its own."""

    MAX_INFLIGHT = "max_inflight"  # --max-inflight requests are in flight already (429)
    SHUTTING_DOWN = "shutting_down"  # the frontend drains for shutdown (503)


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    inflight: int  # admitted requests not yet answered
    max_inflight: int  # the limit; 0: none
    draining: bool
    admitted_total: int
    rejected_total: int  # every reason


class Admission:
    """The admission policy of one frontend's generation requests, and their count.

    On the event loop only (not thread-safe). *max_inflight* 0 admits any number;
    a negative one is a ValueError. *gauge* (``inflight_requests``) follows the count:
    it is kept here, where every admitted request is released exactly once, however it
    ends (a stream whose client left before its body started included).
    """

    def __init__(self, max_inflight: int = 0, *, gauge: Gauge | None = None) -> None:
        if max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {max_inflight}")
        self.max_inflight = max_inflight
        self._gauge = gauge
        self._inflight = 0
        self._admitted = 0
        self._rejected = 0
        self._draining = False
        self._idle: trio.Event | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    def admit(self) -> Reason | None:
        """Take a slot for a new request: None if it is admitted (the caller then calls
        :meth:`release` exactly once, when the request ends), else why it is refused."""
        if self._draining:
            reason = Reason.SHUTTING_DOWN
        elif self.max_inflight and self._inflight >= self.max_inflight:
            reason = Reason.MAX_INFLIGHT
        else:
            self._inflight += 1
            self._admitted += 1
            if self._gauge is not None:
                self._gauge.inc()
            return None
        self._rejected += 1
        return reason

    def release(self) -> None:
        """Give back the slot of an admitted request that ended, however it ended."""
        if self._inflight <= 0:
            raise RuntimeError("release() without a matching admit()")
        self._inflight -= 1
        if self._gauge is not None:
            self._gauge.dec()
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    def drain(self) -> None:
        """Refuse every request from now on; those in flight go on. Idempotent."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once no admitted request is in flight (at once if none is)."""
        if self._inflight == 0:
            return
        if self._idle is None or self._idle.is_set():
            self._idle = trio.Event()
        await self._idle.wait()

    def statistics(self) -> AdmissionStats:
        return AdmissionStats(
            self._inflight, self.max_inflight, self._draining, self._admitted, self._rejected
        )

    def refusal(self, reason: Reason) -> ApiError:
        """The client's answer to a request refused for *reason*."""
        if reason is Reason.MAX_INFLIGHT:
            return too_many_requests(self.max_inflight)
        return shutting_down()


class AdmissionControl:
    """Wraps an ASGI app so that each ``POST`` to one of *paths* is admitted by
    *admission* first: an admitted request runs the app holding its slot; a refused
    one is answered here (its body read and dropped, up to *max_body_bytes*) and
    counted in ``metrics.rejected_requests_total`` by reason. Other requests pass."""

    def __init__(
        self,
        app: ASGIFramework,
        admission: Admission,
        *,
        paths: Collection[str],
        metrics: FrontendMetrics,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.admission = admission
        self.paths = frozenset(paths)
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        for reason in Reason:  # every series from the start, at 0: rate() sees the first
            metrics.rejected_requests_total.labels(reason.value)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        reason = self.admission.admit()
        if reason is None:
            try:
                await self.app(scope, receive, send)
            finally:
                self.admission.release()
            return
        self.metrics.rejected_requests_total.labels(reason.value).inc()
        if await discard_body(receive, self.max_body_bytes):
            await send_error(send, self.admission.refusal(reason), scope["path"])
