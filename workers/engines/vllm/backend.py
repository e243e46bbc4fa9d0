"""How a vLLM worker reaches vLLM: the interface of its two ways.

:class:`~workers.engines.vllm.engine.VllmEngine` holds what a request means (the
checks, prefill and decode legs, chunks, errors, load); a backend only carries one
request to vLLM and its answer back, as :class:`~.protocol.StreamEvent`:

* :class:`~.in_process.InProcessBackend` (``--vllm-client in-process``, the default):
  vLLM's engine client (``AsyncLLM``) inside the worker's process, on an asyncio loop
  of its own, with vLLM's engine core in a child process. No HTTP hop, no API server.
* :class:`~.api_server.ApiServerBackend` (``--vllm-client api-server``, and always with
  ``--vllm-url``): vLLM's own API server, started by the worker or attached to, spoken
  to with its token-in API over HTTP.

Either raises the same three errors, which the engine translates:
:class:`~.protocol.VllmRequestError` (vLLM refused or failed the request: a status),
:class:`VllmUnreachable` (vLLM is down or cannot be reached), and
:class:`~.protocol.ProtocolError` (an answer that cannot be read).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import Metric

from headwater.tracing import current_trace
from workers.engines.vllm.protocol import StreamEvent, VllmCall, VllmMetrics


def trace_headers() -> dict[str, str]:
    """The request's trace for vLLM (W3C ``traceparent`` and ``tracestate``, from the
    worker's ``worker.request`` span), so that vLLM's own spans (with an OTLP endpoint)
    join it; empty when the request is not traced. Either backend hands it over."""
    span = current_trace().span
    parent = span.traceparent
    if not parent:
        return {}
    headers = {"traceparent": parent}
    if state := span.tracestate:
        headers["tracestate"] = state
    return headers


class VllmUnreachable(Exception):
    """vLLM cannot take the request: down, restarting, or not answering."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a started vLLM serves: its model's name and context length (None: the
    configured one stands)."""

    name: str
    max_model_len: int | None = None


class VllmBackend(Protocol):
    """One way to vLLM; see the module docstring.

    ``open()`` holds the backend's resources (an HTTP client, an asyncio thread) for the
    engine's life; :meth:`start` starts vLLM (or finds the attached one), :meth:`wait`
    returns when a started vLLM dies (never, for an attached one: the metrics poll
    watches it), :meth:`stop` stops it.
    """

    @property
    def where(self) -> str:
        """Where vLLM is, for logs: a URL, or in-process with its engine core's pid."""
        ...

    @property
    def attached(self) -> bool:
        """Attached to a vLLM that the worker did not start (and must not restart)."""
        ...

    #: Where vLLM publishes its KV cache events (``tcp://127.0.0.1:PORT``); set by the
    #: engine before :meth:`start`, "" for none.
    events_endpoint: str
    #: Prompt logprobs arrive with the request's first stream event; else the engine
    #: asks for them in a unary request of their own first.
    streams_prompt_logprobs: bool

    def open(self) -> AbstractAsyncContextManager[None]: ...

    async def start(self) -> ServedModel:
        """Start vLLM and wait until it serves. Raises VllmStartError."""
        ...

    async def wait(self) -> str:
        """Until a started vLLM dies; what happened."""
        ...

    async def stop(self) -> None:
        """Stop a started vLLM, bounded; nothing for an attached one."""
        ...

    def kill(self) -> None:
        """Kill a started vLLM's processes at once (tests: a crash)."""
        ...

    async def answer(self, call: VllmCall) -> StreamEvent:
        """*call* (unary) answered whole."""
        ...

    def stream(self, call: VllmCall) -> AsyncGenerator[StreamEvent, None]:
        """*call* (streamed) as events, sent on the first ``anext``; closing the
        generator before its end aborts the request in vLLM."""
        ...

    async def metrics(self) -> VllmMetrics:
        """vLLM's load and counters now. Raises VllmUnreachable."""
        ...

    def metric_families(self) -> Iterable[Metric]:
        """vLLM's series for the worker's metrics endpoint: in-process, since nothing
        else exports them; none for an API server, which serves its own."""
        ...
