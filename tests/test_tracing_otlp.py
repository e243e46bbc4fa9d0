"""Traces over real OTLP/HTTP, across processes: a frontend in this process, a worker
process over the TCP plane, both exporting to a small OTLP receiver run by the test
(an HTTP server decoding ``ExportTraceServiceRequest`` protobufs); and a collector that
is down, which costs spans and nothing else (docs/observability.md, "Traces").

Each process exports once a second: waits are bounded at 20 s.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from headwater.cluster.recipes import start_worker
from scripts.otlp_sink import request_bodies

from frontend_fixture import eventually, serve_frontend

pytestmark = pytest.mark.slow

MODEL = "deepseek-v4"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)


async def _serve_otlp(receiver: Receiver, stream: trio.SocketStream) -> None:
    """One HTTP/1.1 connection: each POST's body decoded as OTLP traces, answered 200."""
    async with stream:
        async for body in request_bodies(stream):
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        receiver.spans.append(
                            ReceivedSpan(
                                attrs.get("service.name", ""),
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in s.attributes},
                            )
                        )
            answer = ExportTraceServiceResponse().SerializeToString()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                b"Content-Length: %d\r\n\r\n" % len(answer) + answer
            )


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[Receiver]:
    """An OTLP/HTTP receiver on a free loopback port, for the block."""
    receiver = Receiver("")
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, partial(_serve_otlp, receiver), 0, host="127.0.0.1")
        )
        receiver.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield receiver
        nursery.cancel_scope.cancel()


async def test_one_trace_across_the_frontend_and_a_worker_process(tmp_path: Path) -> None:
    async with otlp_receiver() as receiver, trio.open_nursery() as nursery:
        worker = await start_worker(
            nursery,
            "agg",
            log_dir=tmp_path,
            model=MODEL,
            ready_within=20,
            extra_args=("--otlp-endpoint", receiver.url, "--speedup-ratio", "50"),
        )
        spec = f"tcp://{worker.address.removeprefix('tcp://')}?role=agg&id={worker.worker_id}"
        async with serve_frontend(workers=spec, otlp_endpoint=receiver.url) as (_, url):
            async with httpx.AsyncClient(base_url=url) as c:
                r = await c.post(
                    "/v1/chat/completions",
                    headers={"X-Request-Id": "otlp-1"},
                    json={
                        "model": MODEL,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
                assert r.status_code == 200, r.text

            def arrived() -> bool:
                names = {s.name for s in receiver.spans}
                return {"POST /v1/chat/completions", "engine.decode"} <= names

            await eventually(arrived, within=20)
        nursery.cancel_scope.cancel()
    spans = receiver.spans
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert root.service == "headwater-frontend"
    assert root.parent_id == ""
    assert root.attributes["headwater.request_id"] == "otlp-1"
    same = [s for s in spans if s.trace_id == root.trace_id]
    by_name = {s.name: s for s in same}
    by_id = {s.span_id: s for s in same}
    parent_of = {name: by_id[s.parent_id].name for name, s in by_name.items() if s.parent_id}
    assert parent_of["dispatch"] == "POST /v1/chat/completions"
    assert parent_of["leg agg"] == "dispatch"
    assert parent_of["worker.request"] == "leg agg"  # across the process boundary
    assert parent_of["engine.prefill"] == parent_of["engine.decode"] == "worker.request"
    assert by_name["worker.request"].service == "headwater-worker"
    assert by_name["leg agg"].attributes["headwater.worker.id"] == worker.worker_id
    assert str(by_name["worker.request"].attributes["headwater.plane.request_id"]).startswith(
        "otlp-1-"
    )


async def test_a_collector_that_is_down_costs_only_spans() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with serve_frontend(otlp_endpoint=down) as (_, url), httpx.AsyncClient(base_url=url) as c:
        for _ in range(3):
            r = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
            )
            assert r.status_code == 200
        dropped = 'headwater_frontend_trace_spans_dropped_total{reason="export_failed"}'

        async def lost() -> float:
            text = (await c.get("/metrics")).text
            line = next(x for x in text.splitlines() if x.startswith(dropped))
            return float(line.split()[-1])

        with trio.fail_after(20):
            while await lost() == 0:
                await trio.sleep(0.2)
        assert (
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        ).status_code == 200
