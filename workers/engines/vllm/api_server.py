"""vLLM behind its own API server: the token-in API over HTTP (:mod:`.backend`).

The worker starts and supervises a ``vllm serve`` of its own (:class:`~.server.VllmServer`)
or attaches to one (``--vllm-url``), and speaks to it with httpx on the worker's trio
loop: one ``POST /inference/v1/generate`` per request (SSE when streamed; closing the
response aborts the request in vLLM), ``GET /v1/models`` once started, ``GET /metrics``
for the load. The wire format is :mod:`.protocol`'s.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
from prometheus_client.core import Metric

from headwater.wire import Role
from workers.engines.vllm import protocol
from workers.engines.vllm.backend import ServedModel, VllmUnreachable, trace_headers
from workers.engines.vllm.config import VllmConfig
from workers.engines.vllm.protocol import GENERATE_PATH, StreamEvent, VllmCall, VllmMetrics
from workers.engines.vllm.server import VllmServer, VllmStartError

_JSON = {"Content-Type": "application/json"}


class ApiServerBackend:
    """vLLM's API server, started or attached; see the module docstring. *transport*
    replaces httpx's (tests play vLLM with an ``httpx.MockTransport``)."""

    streams_prompt_logprobs = False  # vLLM's stream drops them

    def __init__(
        self,
        config: VllmConfig,
        role: Role,
        worker_id: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        otlp_endpoint: str = "",
    ) -> None:
        self.server = VllmServer(config, role, worker_id, otlp_endpoint=otlp_endpoint)
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    @property
    def where(self) -> str:
        return self.server.url

    @property
    def attached(self) -> bool:
        return self.server.attached

    @property
    def events_endpoint(self) -> str:
        return self.server.events_endpoint

    @events_endpoint.setter
    def events_endpoint(self, endpoint: str) -> None:
        self.server.events_endpoint = endpoint

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """An httpx client on the worker's loop, for the engine's life."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=5.0)
        async with httpx.AsyncClient(
            limits=limits, timeout=timeout, transport=self._transport
        ) as http:
            self._http = http
            yield

    async def start(self) -> ServedModel:
        http = self._client()
        await self.server.start(http)
        try:
            r = await http.get(self.server.url + "/v1/models", timeout=10.0)
            model = r.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise VllmStartError(f"cannot read {self.server.url}/v1/models: {exc!r}") from exc
        length = model.get("max_model_len")
        return ServedModel(str(model.get("id", "")), length if isinstance(length, int) else None)

    async def wait(self) -> str:
        return f"vLLM exited with status {await self.server.wait()}"

    async def stop(self) -> None:
        await self.server.stop()

    def kill(self) -> None:
        self.server.kill()

    async def answer(self, call: VllmCall) -> StreamEvent:
        http = self._client()
        top = call.request.sampling.prompt_logprobs if call.prompt_logprobs else None
        with _unreachable(self.server.url):
            r = await http.post(
                self.server.url + GENERATE_PATH, content=call.body(), headers=_headers()
            )
        if r.status_code != 200:
            raise protocol.error_from_body(r.status_code, r.content)
        return protocol.parse_answer(r.content, prompt_logprobs=top)

    async def stream(self, call: VllmCall) -> AsyncGenerator[StreamEvent, None]:
        http = self._client()
        request = http.build_request(
            "POST", self.server.url + GENERATE_PATH, content=call.body(), headers=_headers()
        )
        with _unreachable(self.server.url):
            response = await http.send(request, stream=True)
        try:
            if response.status_code != 200:
                raise protocol.error_from_body(response.status_code, await response.aread())
            top = call.request.sampling.logprobs
            with _unreachable(self.server.url):
                async for line in response.aiter_lines():
                    event = protocol.parse_sse_line(line, logprobs=top)
                    if event is None:
                        continue
                    yield event
                    if event.done:
                        return
        finally:
            await response.aclose()  # before the end: vLLM aborts the request

    async def metrics(self) -> VllmMetrics:
        try:
            r = await self._client().get(self.server.url + "/metrics", timeout=5.0)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise VllmUnreachable(f"/metrics: {exc!r}") from exc
        return protocol.parse_metrics(r.text)

    def metric_families(self) -> Iterable[Metric]:
        return ()  # its API server's /metrics has them

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("ApiServerBackend used outside its open() block")
        return self._http


@contextmanager
def _unreachable(url: str) -> Iterator[None]:
    """httpx's errors as VllmUnreachable, naming *url*."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise VllmUnreachable(f"vLLM at {url} unreachable: {exc!r}") from exc


def _headers() -> dict[str, str]:
    """A request's headers to vLLM: JSON, and the request's trace."""
    return {**_JSON, **trace_headers()}
