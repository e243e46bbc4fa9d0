"""Request ids, JSON logs and traces, in one process (docs/observability.md).

Traces are checked with the OpenTelemetry SDK's in-memory exporter behind
:func:`headwater.tracing.open_tracing`: one request's spans, from the HTTP root through
the dispatcher's legs to the in-process workers' engine stages, form one tree.
"""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from headwater.logs import JsonFormatter, TextFormatter, install_context, request_context
from headwater.tracing import NULL_SPAN, TraceParent, open_tracing, tracer, valid_tracestate
from headwater.wire import GenerateRequest, SamplingParams
from headwater.wire.codec import decode_body, encode
from headwater.wire.frames import Unreadable
from headwater.wire.tokens import token_array

from frontend_fixture import serve_frontend

MODEL = "deepseek-v4"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Rivers?"}], "max_tokens": 5}
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# -- W3C and the wire --------------------------------------------------------------


def test_traceparent_parse_and_format() -> None:
    tp = TraceParent.parse(PARENT)
    assert tp == TraceParent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", 1)
    assert str(tp) == PARENT
    for bad in (
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        PARENT + "-extra",
        PARENT.upper(),
    ):
        assert TraceParent.parse(bad) is None, bad
    # A later version may append fields: read what version 00 defines.
    assert TraceParent.parse("01-" + PARENT[3:] + "-what") is not None


def test_tracestate_is_checked_and_bounded() -> None:
    assert valid_tracestate("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert valid_tracestate("vendor@tenant=x")
    assert not valid_tracestate("no spaces=in keys")
    assert not valid_tracestate("k=" + "v" * 600)
    assert not valid_tracestate(",".join(f"k{i}=v" for i in range(33)))


def _request(traceparent: str = "", tracestate: str = "") -> GenerateRequest:
    ids = token_array([1, 2, 3])
    return GenerateRequest(
        "r1",
        MODEL,
        ids,
        SamplingParams(max_tokens=4),
        traceparent=traceparent,
        tracestate=tracestate,
    )


def test_the_request_frame_carries_trace_context_only_when_set() -> None:
    plain = encode(_request())
    assert b"traceparent" not in plain
    traced = _request(traceparent=PARENT, tracestate="congo=t61rcWkgMzE")
    frame = encode(traced)
    back = decode_body(frame[4:], len(frame))
    assert back == traced
    assert decode_body(plain[4:], len(plain)) == _request()


@pytest.mark.parametrize(
    "trace",
    [
        {"traceparent": "00-zz-bad-01"},
        {"traceparent": PARENT, "tracestate": "bad key=1"},
        {"traceparent": PARENT, "tracestate": "k=" + "v" * 600},
    ],
)
def test_a_malformed_trace_context_fails_its_request(trace: dict[str, str]) -> None:
    frame = encode(_request(**trace))  # the sender does not check: the receiver must
    got = decode_body(frame[4:], len(frame))
    # That request alone is refused: the frame was whole, the connection goes on.
    assert isinstance(got, Unreadable)
    assert got.request_id == "r1"
    assert "trace" in got.reason


# -- logs ----------------------------------------------------------------------------


def _log_line(formatter: logging.Formatter, **context: str) -> str:
    install_context()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger("headwater.test_tracing")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        if context:
            with request_context(context["request_id"], context.get("trace_id", "")):
                logger.warning("hello %s", "there")
        else:
            logger.warning("hello %s", "there")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


def test_json_logs_are_one_object_a_line_with_the_request() -> None:
    lines = _log_line(JsonFormatter(), request_id="abc", trace_id="t" * 32).splitlines()
    assert len(lines) == 2  # the traceback stays inside its line
    first, second = map(orjson.loads, lines)
    assert first["message"] == "hello there"
    assert first["level"] == "warning"
    assert first["request_id"] == "abc"
    assert first["trace_id"] == "t" * 32
    assert first["logger"] == "headwater.test_tracing"
    assert first["time"].endswith("+00:00")
    assert "request_id" not in second  # made outside the request's context
    assert "ValueError: boom" in second["exception"]


def test_text_logs_append_the_request_id() -> None:
    first = _log_line(TextFormatter(), request_id="abc").splitlines()[0]
    assert first.endswith("hello there request_id=abc")


# -- request ids over HTTP -----------------------------------------------------------


async def test_request_ids_are_echoed_generated_and_validated() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "my-id.1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "my-id.1"
        assert r.json()["id"].startswith("chatcmpl-my-id.1-")  # in the body's id too
        r = await c.get("/v1/models")
        generated = r.headers["x-request-id"]
        assert len(generated) == 32
        assert int(generated, 16) >= 0
        assert (await c.get("/v1/models")).headers["x-request-id"] != generated
        r = await c.get("/nowhere", headers={"X-Request-Id": "on-a-404"})
        assert r.status_code == 404
        assert r.headers["x-request-id"] == "on-a-404"
        for bad in ("x" * 129, "has space", 'quote"d'):
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad})
            assert r.status_code == 400, bad
            assert r.json()["error"]["code"] == "invalid_request_id"
        r = await c.post("/v1/chat/completions", json=CHAT)  # the server goes on
        assert r.status_code == 200


async def test_the_request_id_reaches_the_worker_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    install_context()
    caplog.set_level(logging.DEBUG, logger="workers.runtime.runtime")
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "find-me"})
        assert r.status_code == 200
    served = [
        rec
        for rec in caplog.records
        if rec.name == "workers.runtime.runtime" and rec.getMessage().endswith("served")
    ]
    assert len(served) == 2  # prefill and decode
    assert all(rec.request_id.startswith("find-me-") for rec in served)  # type: ignore[attr-defined]


# -- traces --------------------------------------------------------------------------


@asynccontextmanager
async def traced(sample_ratio: float = 1.0) -> AsyncIterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    async with open_tracing("", "test", exporter=exporter, sample_ratio=sample_ratio):
        yield exporter


def tree(spans: list[ReadableSpan]) -> dict[str, Any]:
    """Spans by name (the last of each name), and the parent names of each."""
    by_id = {s.context.span_id: s for s in spans}
    return {
        s.name: (by_id[s.parent.span_id].name if s.parent and s.parent.span_id in by_id else None)
        for s in spans
    }


async def test_one_request_is_one_trace_from_the_root_to_the_engine() -> None:
    async with (
        traced() as exporter,
        serve_frontend() as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        r = await c.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Request-Id": "trace-me"},
        )
        assert r.status_code == 200
        assert (await c.get("/v1/models")).status_code == 200  # not traced
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    parents = tree(list(spans))
    assert parents == {
        "POST /v1/chat/completions": None,
        "preprocess.template": "POST /v1/chat/completions",
        "preprocess.tokenize": "POST /v1/chat/completions",
        "postprocess": "POST /v1/chat/completions",
        "dispatch": "POST /v1/chat/completions",
        "leg prefill": "dispatch",
        "leg decode": "dispatch",
        "worker.request": "leg decode",  # the last one of that name: the decode's
        "engine.prefill": "worker.request",
        "engine.kv_pull": "worker.request",
        "engine.decode": "worker.request",
    }
    root = next(s for s in spans if s.parent is None)
    assert root.attributes is not None
    assert root.attributes["headwater.request_id"] == "trace-me"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["gen_ai.response.finish_reasons"] == "length"
    (tokenize,) = [s for s in spans if s.name == "preprocess.tokenize"]
    assert tokenize.attributes is not None
    assert tokenize.attributes["headwater.tokenize.queue_wait_s"] == 0.0  # short: inline
    legs = [s for s in spans if s.name.startswith("leg ")]
    assert all(s.attributes and s.attributes["headwater.worker.id"] for s in legs)
    assert all(any(e.name == "ack" for e in s.events) for s in legs)
    workers = [s for s in spans if s.name == "worker.request"]
    assert {tree_parent(spans, s) for s in workers} == {"leg prefill", "leg decode"}


def tree_parent(spans: tuple[ReadableSpan, ...], span: ReadableSpan) -> str:
    assert span.parent is not None
    return next(s.name for s in spans if s.context.span_id == span.parent.span_id)


async def test_a_client_traceparent_is_continued() -> None:
    async with (
        traced() as exporter,
        serve_frontend() as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        headers = {"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE"}
        r = await c.post(
            "/v1/completions",
            headers=headers,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
        )
        assert r.status_code == 200
        bad = {"traceparent": "00-nope-01"}  # a malformed one starts a new trace
        r = await c.post(
            "/v1/completions", headers=bad, json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
        )
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "POST /v1/completions"]
    assert len(roots) == 2
    continued, fresh = roots
    assert f"{continued.context.trace_id:032x}" == PARENT.split("-")[1]
    assert continued.parent is not None
    assert f"{continued.parent.span_id:016x}" == PARENT[36:52]
    assert continued.context.trace_state.get("congo") == "t61rcWkgMzE"
    assert fresh.parent is None
    assert fresh.context.trace_id != continued.context.trace_id
    same = [s for s in spans if s.context.trace_id == continued.context.trace_id]
    assert {"dispatch", "worker.request", "engine.decode"} <= {s.name for s in same}


async def test_tracing_off_makes_no_span() -> None:
    assert not tracer().enabled
    with tracer().span("x", parent=None) as span:
        assert span is NULL_SPAN
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert "traceparent" not in r.headers


async def test_a_retry_and_a_migration_are_spans_of_the_requests_tree(headwater: Any) -> None:
    """One request refused by its first decode worker (retried on the other), then broken
    mid-stream (migrated): every leg is a span under the one dispatch span, each with its
    attempt and migration number, the refusal and the migration recorded on them."""
    async with traced() as exporter:
        server = await headwater.start(workers=["prefill", "prefill", "decode", "decode"])
        server.faults.refuse(worker="local-prefill-0")  # round-robin asks it first
        server.faults.break_stream(after_tokens=2)
        async with server.client() as client:
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6})
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 6
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    (dispatch,) = [s for s in spans if s.name == "dispatch"]
    legs = sorted((s for s in spans if s.name.startswith("leg ")), key=lambda s: s.start_time or 0)
    assert all(s.parent is not None and s.parent.span_id == dispatch.context.span_id for s in legs)

    def attrs(span: ReadableSpan) -> dict[str, Any]:
        return dict(span.attributes or {})

    # Round-robin starts anywhere: the refusal hits the first attempt or the migrated one.
    assert sorted(s.name for s in legs) == ["leg decode"] * 2 + ["leg prefill"] * 3
    (refused,) = [s for s in legs if "refused" in (s.status.description or "")]
    assert attrs(refused)["headwater.worker.id"] == "local-prefill-0"
    (retried,) = [s for s in legs if attrs(s)["headwater.attempt"] == 2]
    assert retried.name == "leg prefill"
    assert retried.status.is_ok
    assert attrs(retried)["headwater.plane.request_id"].endswith(".r1")  # its own id
    assert attrs(retried)["headwater.migration"] == attrs(refused)["headwater.migration"]
    broken, migrated = [s for s in legs if s.name == "leg decode"]
    assert "without End" in (broken.status.description or "")
    assert attrs(broken)["headwater.migration"] == 0
    assert migrated.status.is_ok
    assert attrs(migrated)["headwater.migration"] == 1
    assert ".m1" in attrs(migrated)["headwater.plane.request_id"]
    assert attrs(migrated)["headwater.worker.id"] != attrs(broken)["headwater.worker.id"]
    (event,) = [e for e in dispatch.events if e.name == "migration"]
    assert event.attributes is not None
    assert event.attributes["headwater.tokens_delivered"] == 2
    assert event.attributes["headwater.migration.kind"] == "ongoing_request"


async def test_sampling_keeps_a_share_and_follows_the_clients_flag() -> None:
    """At ratio 0 no request this frontend starts is traced, in any process, yet a
    client's sampled traceparent is (the parent decides); at ratio 1 a client's
    not-sampled one is not. Requests are served the same either way. (Spans reach the
    exporter when tracing closes: each block is looked at after its end.)"""

    async def send(sample_ratio: float, headers: dict[str, str]) -> tuple[ReadableSpan, ...]:
        async with (
            traced(sample_ratio) as exporter,
            serve_frontend() as (_, url),
            httpx.AsyncClient(base_url=url) as c,
        ):
            for _ in range(3):
                r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 200
        return exporter.get_finished_spans()

    assert await send(0.0, {}) == ()
    spans = await send(0.0, {"traceparent": PARENT})
    assert {f"{s.context.trace_id:032x}" for s in spans} == {PARENT.split("-")[1]}
    assert {"dispatch", "worker.request", "engine.decode"} <= {s.name for s in spans}
    assert await send(1.0, {"traceparent": PARENT[:-2] + "00"}) == ()
    assert len({s.context.trace_id for s in await send(1.0, {})}) == 3
