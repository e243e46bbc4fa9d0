"""The OpenAI-compatible API over a real socket: shapes, usage, stops, errors, cancellation.

Policy: every test runs its own frontend on 127.0.0.1:0 (see frontend_fixture) with
in-process simulated workers, and talks to it with httpx.AsyncClient.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import trio

from frontend_fixture import (
    assert_error,
    deliver_chunks_together,
    engines,
    eventually,
    idle,
    raw_chunks,
    serve_frontend,
    shared_tokenizer,
    sse_events,
)

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]


# -- happy paths ---------------------------------------------------------------------


async def test_chat_unary_shape_and_real_usage() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "seed": 7}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["object"] == "chat.completion"
        assert data["model"] == MODEL
        assert data["id"].startswith("chatcmpl-")
        choice = data["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length"
        assert isinstance(choice["message"]["content"], str)
        assert choice["message"]["content"]
        # Usage counts are real token counts: the rendered prompt through the tokenizer.
        prompt = fe.template.render(CHAT)
        expected_prompt = len(shared_tokenizer().hf.encode(prompt, add_special_tokens=False).ids)
        usage = data["usage"]
        assert usage["prompt_tokens"] == expected_prompt
        assert usage["completion_tokens"] == 12
        assert usage["total_tokens"] == expected_prompt + 12
        # Same seed, same output: the simulated engine is deterministic.
        again = (await c.post("/v1/chat/completions", json=body)).json()
        assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_chat_stream_matches_unary_and_reports_usage() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "seed": 3}
        unary = (await c.post("/v1/chat/completions", json=body)).json()
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=stream_body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
        assert events[-1] == "DONE"
        chunks = events[:-1]
        assert all(e["object"] == "chat.completion.chunk" for e in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        usage_event = chunks[-1]
        assert usage_event["choices"] == []
        assert usage_event["usage"] == unary["usage"]
        content = [e for e in chunks[1:-1]]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in content)
        assert text == unary["choices"][0]["message"]["content"]
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in content[:-1])


async def test_stream_without_include_usage_has_no_usage_chunk() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = await sse_events(r)
        assert events[-1] == "DONE"
        assert all("usage" not in e for e in events[:-1])


async def test_completions_unary_and_stream() -> None:
    async with serve_frontend(mode="agg") as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "prompt": "The river flows", "max_tokens": 9, "seed": 11}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["object"] == "text_completion"
        assert data["id"].startswith("cmpl-")
        expected = len(
            shared_tokenizer().hf.encode("The river flows", add_special_tokens=False).ids
        )
        assert data["usage"]["prompt_tokens"] == expected
        assert data["usage"]["completion_tokens"] == 9
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = await sse_events(s)
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == data["choices"][0]["text"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_completions_accepts_token_ids() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "prompt": [100, 200, 300, 400], "max_tokens": 3}
        data = (await c.post("/v1/completions", json=body)).json()
        assert data["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("prompt", [[5, -1], [5, 10**6], [2**32]])
async def test_completions_refuse_token_ids_outside_the_vocabulary(prompt: list[int]) -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        err = assert_error(await c.post("/v1/completions", json=body), 400, "prompt")
        assert "token ids" in err["message"]
        ok = await c.post("/v1/completions", json={**body, "prompt": [5, 6]})
        assert ok.status_code == 200


async def test_stop_string_across_tokens_ends_the_stream() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 40, "seed": 5}
        full = (await c.post("/v1/chat/completions", json=body)).json()
        text = full["choices"][0]["message"]["content"]
        # A stop string from the middle of the output, long enough to span tokens.
        start = len(text) // 2
        stop = text[start : start + 8]
        assert len(stop) == 8
        cut = text.index(stop)
        r = (await c.post("/v1/chat/completions", json={**body, "stop": [stop]})).json()
        assert r["choices"][0]["message"]["content"] == text[:cut]
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] < 40
        stream_body = {**body, "stop": stop, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=stream_body) as s:
            events = await sse_events(s)
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
        assert streamed == text[:cut]
        assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_streamed_text_is_utf8_safe_and_equals_unary() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        for seed in range(6):
            body = {"model": MODEL, "prompt": "多字节 ✓", "max_tokens": 30, "seed": seed}
            whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                events = await sse_events(s)
            pieces = [e["choices"][0]["text"] for e in events[:-1]]
            assert "".join(pieces) == whole
            if "\ufffd" not in whole:
                assert not any("\ufffd" in p for p in pieces)


async def test_models_health_live() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert_error(await c.get("/v1/models/other"), 404, "model")
        health = await c.get("/health")
        assert health.status_code == 200
        roles = sorted(w["role"] for w in health.json()["workers"])
        assert roles == ["decode", "prefill"]
        assert (await c.get("/live")).status_code == 200


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": True}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "temperature": 5}, "temperature"),
        ({"model": MODEL, "messages": CHAT, "top_p": -1}, "top_p"),
        ({"model": MODEL, "messages": CHAT, "stop": 3}, "stop"),
        ({"model": MODEL, "messages": CHAT, "n": 0}, "n"),
        ({"model": MODEL, "messages": CHAT, "n": 2, "best_of": 1}, "best_of"),
        ({"model": MODEL, "messages": CHAT, "logprobs": 1}, "logprobs"),
        ({"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
        ({"model": MODEL, "messages": CHAT, "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"model": MODEL, "messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
async def test_bad_chat_requests_are_400(body: dict[str, Any], param: str) -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=body), 400, param)
        assert err["type"] == "invalid_request_error"


async def test_error_statuses_and_the_server_keeps_serving() -> None:
    async with (
        serve_frontend(max_body_bytes=4096, context_length=64) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        post = "/v1/chat/completions"
        assert_error(
            await c.post(post, content=b"{not json", headers={"content-type": "application/json"}),
            400,
        )
        assert_error(
            await c.post(post, content=b"[1, 2]", headers={"content-type": "application/json"}), 400
        )
        assert_error(
            await c.post(post, content=b"hello", headers={"content-type": "text/plain"}), 415
        )
        assert_error(await c.post(post, json={"model": "nope", "messages": CHAT}), 404, "model")
        assert_error(await c.get("/v1/nowhere"), 404)
        assert_error(await c.get(post), 405)
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}
        assert_error(await c.post(post, json=big), 413)
        long_prompt = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]}
        err = assert_error(await c.post(post, json=long_prompt), 400, "messages")
        assert err["code"] == "context_length_exceeded"
        too_many = {"model": MODEL, "messages": CHAT, "max_tokens": 60}
        assert_error(await c.post(post, json=too_many), 400)
        # Nothing above broke the server.
        ok = await c.post(post, json={"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert ok.status_code == 200
        await eventually(idle(fe))


async def test_no_routable_worker_is_503_and_health_says_so() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        for client in fe.router.clients():
            fe.router.set_draining(client.instance.worker_id)
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        err = assert_error(await c.post("/v1/chat/completions", json=body), 503)
        assert err["type"] == "service_unavailable_error"
        assert (await c.get("/health")).status_code == 503
        stream = await c.post("/v1/chat/completions", json={**body, "stream": True})
        assert_error(stream, 503)


async def test_internal_errors_are_sanitized(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:

        async def explode(parsed: Any) -> Any:
            raise RuntimeError("secret internals /etc/passwd")

        monkeypatch.setattr(fe.pipeline, "preprocess", explode)
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        err = assert_error(r, 500)
        assert "secret" not in r.text
        assert err["message"] == "Internal server error"
        # Booked as a server error, not as a client that went away.
        assert fe.metrics.disconnected_clients._value.get() == 0
        errors = fe.metrics.requests_total.labels("chat", "unary", "error", MODEL)._value.get()
        assert errors == 1


# -- structured concurrency -----------------------------------------------------------------


async def test_client_disconnect_mid_stream_cancels_and_frees_kv() -> None:
    # Slow engine (speedup 1): the stream is still generating when the client leaves.
    async with (
        serve_frontend(speedup_ratio=1.0) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        decode = next(e for e in engines(fe) if e.role.value == "decode")
        body = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 5000,
            "stream": True,
            "ignore_eos": True,
        }
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    got += 1
                    if got == 3:
                        break
            assert decode.statistics().kv_blocks_used > 0
        # The response is closed: the request's scope is cancelled all the way down.
        with trio.fail_after(5):
            while decode.statistics().kv_blocks_used or decode.statistics().active_requests:
                await trio.sleep(0.01)
        assert decode.counters.requests_cancelled == 1
        assert decode.counters.requests_finished == 0
        with trio.fail_after(5):
            while fe.metrics.disconnected_clients._value.get() < 1:
                await trio.sleep(0.01)
        assert fe.metrics.model_cancellation_total._value.get() == 1
        await eventually(idle(fe))


async def test_stream_writes_events_that_are_ready_together_at_once() -> None:
    async with serve_frontend() as (_, url):
        body = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 6,
            "seed": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = await raw_chunks(url, body)
    events = [[e for e in c.split(b"\n\n") if e] for c in chunks]
    # The role chunk leaves with the first token, not on its own.
    assert len(events[0]) == 2
    assert orjson.loads(events[0][0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert orjson.loads(events[0][1][6:])["choices"][0]["delta"]["content"]
    # The last token, the usage and [DONE] leave together.
    assert len(events[-1]) == 3
    assert orjson.loads(events[-1][0][6:])["choices"][0]["finish_reason"] == "length"
    assert orjson.loads(events[-1][1][6:])["usage"]["completion_tokens"] == 6
    assert events[-1][2] == b"data: [DONE]"
    # Tokens in between go out one write each, as they are generated.
    assert all(len(e) == 1 for e in events[1:-1])
    assert len(events) == sum(map(len, events)) - 3  # three writes saved


async def test_tokens_that_arrive_together_leave_in_one_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer that fell behind its engine finds several chunks waiting: the plane
    merges them, so they cost one pass through postprocessing and one write."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "seed": 5}
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        unary = (await c.post("/v1/chat/completions", json=body)).json()
        itl = fe.metrics.inter_token_latency_seconds.window
        before = itl.statistics().count
        deliver_chunks_together(monkeypatch)
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = await raw_chunks(url, stream_body)
    assert len(chunks) == 1  # role, all eight tokens, usage and [DONE] in one write
    events = [orjson.loads(e[6:]) for e in chunks[0].split(b"\n\n") if e[6:] != b"[DONE]" and e]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == unary["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert itl.statistics().count - before == 7  # still one sample per token after the first


async def test_the_gc_collects_young_objects_less_often_once_serving() -> None:
    import gc

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        async with serve_frontend(gc_gen0_threshold=12_345) as (_, url):
            assert gc.get_threshold() == (12_345, 20, 10)
            async with httpx.AsyncClient(base_url=url) as c:
                body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
                assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        gc.set_threshold(700, 10, 10)
        async with serve_frontend(gc_gen0_threshold=0):
            assert gc.get_threshold() == (700, 10, 10)  # 0 leaves Python's setting alone
    finally:
        gc.set_threshold(*saved)
