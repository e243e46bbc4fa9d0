"""The token-in API (POST /inference/v1/generate, vLLM's shape) over a real socket.

Policy: every test runs its own frontend on 127.0.0.1:0 (see frontend_fixture) with
in-process simulated workers, and talks to it with httpx.AsyncClient. What the API
returns is compared with what the mocker generates: through /v1/completions given the
same token ids, and from a mocker engine of the same config run on its own.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import httpx
import orjson
import pytest
import trio

from frontend.config import FrontendConfig
from frontend.errors import WorkerFailed
from frontend.http.schema import parse_generate_request
from frontend.request import SamplingOptions, TokenRequest
from frontend.server import Frontend
from headwater.wire import Chunk, GenerateRequest, Role, SamplingParams
from workers.engines.mocker import MockerEngine

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
GENERATE = "/inference/v1/generate"
PROMPT = [100, 200, 300, 400, 500]


def _requests(fe: Frontend, kind: str, status: str) -> float:
    value: float = fe.metrics.requests_total.labels("generate", kind, status, MODEL)._value.get()
    return value


async def _engine_output(fe: Frontend, token_ids: list[int], **sampling: Any) -> list[int]:
    """What a mocker engine of the frontend's config generates for *token_ids*, run on its
    own (aggregated: the output does not depend on the layout)."""
    engine = MockerEngine(fe.config.engine_config, Role.AGG, "reference")
    request = GenerateRequest(
        request_id="reference",
        model=MODEL,
        token_ids=token_ids,
        sampling=SamplingParams(**sampling),
        eos_token_ids=fe.pipeline.eos_token_ids,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with aclosing(engine.generate(request)) as chunks:
            out = [t async for chunk in chunks for t in chunk.token_ids]
        nursery.cancel_scope.cancel()
    return out


# -- parsing and preprocessing, without a server ------------------------------------------


async def test_every_sampling_param_headwater_supports_reaches_the_engine_request() -> None:
    body = {
        "request_id": "r",
        "model": MODEL,
        "token_ids": PROMPT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sampling_params": {
            "max_tokens": 9,
            "min_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop_token_ids": [7, 8],
            "ignore_eos": True,
            "top_k": 40,
        },
    }
    parsed = parse_generate_request(body)
    sampling = SamplingOptions(
        max_tokens=9,
        min_tokens=2,
        stop_token_ids=(7, 8),
        ignore_eos=True,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        top_k=40,
    )
    needs = (("seed", "sampling_params.seed"), ("top_k", "sampling_params.top_k"))
    assert parsed == TokenRequest(
        PROMPT, "r", MODEL, stream=True, include_usage=True, sampling=sampling, needs=needs
    )
    fe = Frontend(FrontendConfig(tokenizer_threads=1), tokenizer=shared_tokenizer())
    prep = await fe.pipeline.preprocess_tokens(parsed)
    assert prep.parsed is parsed
    assert prep.prompt_ids.typecode == "I"
    assert list(prep.prompt_ids) == PROMPT
    assert prep.request_id != "r"  # the plane's id is the frontend's own
    assert prep.sampling == SamplingParams(
        max_tokens=9,
        min_tokens=2,
        ignore_eos=True,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop_token_ids=(7, 8),
        top_k=40,
    )
    defaults = await fe.pipeline.preprocess_tokens(parse_generate_request({"token_ids": [1]}))
    assert defaults.sampling == SamplingParams(max_tokens=fe.config.context_length - 1)


# -- results -------------------------------------------------------------------------------


async def test_unary_returns_what_the_mocker_generates_with_exact_usage() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        body = {
            "request_id": "rollout-7",
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 12, "seed": 7},
        }
        r = await c.post(GENERATE, json=body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        data = r.json()
        assert set(data) == {"request_id", "choices", "usage"}
        assert data["request_id"] == "generate-tokens-rollout-7"  # as vLLM names it
        [choice] = data["choices"]
        assert choice["index"] == 0
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"] is None
        ids = choice["token_ids"]
        assert len(ids) == 12
        assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}

        # The same ids as a mocker engine given the same prompt and seed...
        assert ids == await _engine_output(fe, PROMPT, max_tokens=12, seed=7)
        # ...and as /v1/completions given the same token ids, which detokenizes them.
        completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": 7}
        text = (await c.post("/v1/completions", json=completion)).json()
        assert text["choices"][0]["text"] == shared_tokenizer().decode(ids)
        assert text["usage"]["completion_tokens"] == 12

        # Without a request_id the frontend names the request; the model may be given.
        r = await c.post(
            GENERATE,
            json={
                "model": MODEL,
                "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 12, "seed": 7},
            },
        )
        named = r.json()["request_id"]
        assert named.startswith("generate-tokens-")
        # The plane's name: the request's id (its X-Request-Id), a dash, 8 hex digits.
        plane = named.removeprefix("generate-tokens-")
        assert plane.startswith(r.headers["x-request-id"] + "-")
        assert len(plane) == len(r.headers["x-request-id"]) + 9
        assert r.json()["choices"][0]["token_ids"] == ids  # the seed decides, not the id


async def test_stream_carries_the_unary_ids_then_usage_then_done() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {
            "request_id": "s1",
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 20, "seed": 3},
        }
        unary = (await c.post(GENERATE, json=body)).json()
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", GENERATE, json=stream_body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
        assert events[-1] == "DONE"
        *deltas, usage = events[:-1]
        assert usage == {"request_id": "generate-tokens-s1", "choices": [], "usage": unary["usage"]}
        assert all(e["request_id"] == "generate-tokens-s1" for e in deltas)
        assert all(len(e["choices"]) == 1 and e["choices"][0]["token_ids"] for e in deltas)
        streamed = [t for e in deltas for t in e["choices"][0]["token_ids"]]
        assert streamed == unary["choices"][0]["token_ids"]
        assert deltas[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in deltas[:-1])

        # Without stream_options.include_usage there is no usage event (as vLLM).
        async with c.stream("POST", GENERATE, json={**body, "stream": True}) as r:
            plain = await sse_events(r)
        assert plain[-1] == "DONE"
        assert all("usage" not in e and len(e["choices"]) == 1 for e in plain[:-1])
        assert [t for e in plain[:-1] for t in e["choices"][0]["token_ids"]] == streamed


async def test_sampling_params_reach_the_engine() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        params = {"max_tokens": 16, "seed": 11}
        full = await c.post(GENERATE, json={"token_ids": PROMPT, "sampling_params": params})
        ids = full.json()["choices"][0]["token_ids"]
        # A stop token id ends the output at that token, which is returned (as vLLM does).
        stop = ids[5]
        cut = ids.index(stop) + 1
        r = await c.post(
            GENERATE,
            json={"token_ids": PROMPT, "sampling_params": {**params, "stop_token_ids": [stop]}},
        )
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == ids[:cut]
        assert choice["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == cut
        # min_tokens holds a stop token back until it is reached.
        held = {**params, "stop_token_ids": [stop], "min_tokens": cut + 1}
        r = await c.post(GENERATE, json={"token_ids": PROMPT, "sampling_params": held})
        expected = await _engine_output(
            fe, PROMPT, max_tokens=16, seed=11, stop_token_ids=(stop,), min_tokens=cut + 1
        )
        assert r.json()["choices"][0]["token_ids"] == expected
        assert len(expected) > cut


async def test_tokens_that_arrive_together_leave_in_one_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer behind its engine finds several chunks waiting: the plane merges them
    and the stream carries them in one event, all its ids in ``token_ids``."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "seed": 5}}
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        unary = (await c.post(GENERATE, json=body)).json()
        itl = fe.metrics.inter_token_latency_seconds.window
        before = itl.statistics().count
        deliver_chunks_together(monkeypatch)
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = await raw_chunks(url, stream_body, GENERATE)
    assert len(chunks) == 1  # all eight ids, usage and [DONE] in one write
    events = [e for e in chunks[0].split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    first, usage = (orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1])
    assert first["choices"][0]["token_ids"] == unary["choices"][0]["token_ids"]
    assert first["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 8
    assert itl.statistics().count - before == 7  # still one sample per token after the first


# -- validation ----------------------------------------------------------------------------

# Each body is wrong in one way; the 400 names where.
BAD: list[tuple[Any, str | None]] = [
    ([1, 2], None),
    ({}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": "1 2 3"}, "token_ids"),
    ({"token_ids": [1, -1]}, "token_ids"),
    ({"token_ids": [1, True]}, "token_ids"),
    ({"token_ids": [1, 2.0]}, "token_ids"),
    ({"token_ids": [[1, 2]]}, "token_ids"),
    ({"token_ids": [1, 2**32]}, "token_ids"),  # past the vocabulary (and a uint32)
    ({"token_ids": PROMPT, "request_id": 7}, "request_id"),
    ({"token_ids": PROMPT, "request_id": ""}, "request_id"),
    ({"token_ids": PROMPT, "model": 3}, "model"),
    ({"token_ids": PROMPT, "stream": "yes"}, "stream"),
    ({"token_ids": PROMPT, "stream_options": []}, "stream_options"),
    ({"token_ids": PROMPT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"token_ids": PROMPT, "stop": "\n"}, "stop"),  # OpenAI's place for stop strings
    ({"token_ids": PROMPT, "sampling_params": []}, "sampling_params"),
    *[
        ({"token_ids": PROMPT, "sampling_params": {name: value}}, f"sampling_params.{name}")
        for name, value in [
            ("max_tokens", "5"),
            ("max_tokens", True),
            ("max_tokens", 0),
            ("max_tokens", 1.5),
            ("min_tokens", -1),
            ("temperature", 5),
            ("temperature", "hot"),
            ("top_p", -1),
            ("seed", "7"),
            ("ignore_eos", "yes"),
            ("stop_token_ids", [-1]),
            ("stop_token_ids", 2),
            ("presence_penalty", 3),
            ("n", 0),
            ("n", 129),
            ("best_of", 2),
            ("logprobs", -1),
            ("logprobs", 21),
            ("prompt_logprobs", -1),
            ("prompt_logprobs", 21),
            ("stop", ["</s>"]),
            ("stop", "\n"),
        ]
    ],
    # vLLM's stream has no place for the prompt's logprobs.
    (
        {"token_ids": PROMPT, "stream": True, "sampling_params": {"prompt_logprobs": 0}},
        "sampling_params.prompt_logprobs",
    ),
    ({"token_ids": PROMPT, "sampling_params": {"n": 2, "best_of": 3}}, "sampling_params.best_of"),
    (
        {"token_ids": PROMPT, "sampling_params": {"min_tokens": 9, "max_tokens": 2}},
        "sampling_params.min_tokens",
    ),
]


async def test_every_bad_request_is_a_400_naming_its_param() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        for body, param in BAD:
            r = await c.post(GENERATE, json=body)
            err = assert_error(r, 400, param)
            assert err["type"] == "invalid_request_error", body
            if param is None:
                assert err["param"] is None
        # What a client serializing a whole vLLM SamplingParams sends, and fields
        # headwater does not know (top_k, priority, ...), pass: they ask for nothing.
        lenient = {
            "token_ids": PROMPT,
            "priority": 0,
            "cache_salt": "x",
            "stream": False,
            "sampling_params": {
                "max_tokens": 3,
                "n": 1,
                "best_of": None,
                "stop": [],
                "logprobs": None,
                "prompt_logprobs": None,
                "top_k": -1,
                "skip_special_tokens": True,
                "detokenize": False,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
            },
        }
        r = await c.post(GENERATE, json=lenient)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        await eventually(idle(fe))


async def test_an_id_at_the_vocabulary_size_never_reaches_a_worker() -> None:
    vocab = shared_tokenizer().vocab_size
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        for body in (
            {"token_ids": [5, vocab]},
            {"token_ids": [vocab + 1, 5], "stream": True},
            {"token_ids": [5, 6, vocab], "sampling_params": {"max_tokens": 2}},
        ):
            err = assert_error(await c.post(GENERATE, json=body), 400, "token_ids")
            assert str(vocab) in err["message"]
        assert all(e.counters.requests_started == 0 for e in engines(fe))
        assert _requests(fe, "unary", "rejected") == 2
        assert _requests(fe, "stream", "rejected") == 1
        # The last id of the vocabulary is one.
        ok = await c.post(
            GENERATE, json={"token_ids": [5, vocab - 1], "sampling_params": {"max_tokens": 2}}
        )
        assert ok.status_code == 200, ok.text
        assert sum(e.counters.requests_started for e in engines(fe)) > 0


async def test_http_errors_and_the_context_length() -> None:
    async with (
        serve_frontend(max_body_bytes=4096, context_length=64) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        json_type = {"content-type": "application/json"}
        assert_error(await c.post(GENERATE, content=b"{not json", headers=json_type), 400)
        assert_error(
            await c.post(
                GENERATE,
                content=orjson.dumps({"token_ids": PROMPT}),
                headers={"content-type": "text/plain"},
            ),
            415,
        )
        assert_error(await c.post(GENERATE, json={"token_ids": [5] * 3000}), 413)
        assert_error(await c.get(GENERATE), 405)
        assert_error(
            await c.post(GENERATE, json={"model": "other", "token_ids": PROMPT}), 404, "model"
        )
        # Prompt plus max_tokens over the context length: OpenAI's error, naming token_ids.
        for body in (
            {"token_ids": [5] * 60, "sampling_params": {"max_tokens": 5}},
            {"token_ids": [5] * 64},  # no room for one token
        ):
            err = assert_error(await c.post(GENERATE, json=body), 400, "token_ids")
            assert err["code"] == "context_length_exceeded"
        ok = await c.post(
            GENERATE, json={"token_ids": [5] * 60, "sampling_params": {"max_tokens": 4}}
        )
        assert ok.json()["usage"] == {
            "prompt_tokens": 60,
            "completion_tokens": 4,
            "total_tokens": 64,
        }
        # No sampling_params: every default, and max_tokens what the context leaves.
        ok = await c.post(GENERATE, json={"token_ids": PROMPT})
        assert ok.json()["usage"]["completion_tokens"] == 64 - len(PROMPT)
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        # No routable worker: 503, before or instead of a stream.
        for client in fe.router.clients():
            fe.router.set_draining(client.instance.worker_id)
        for stream in (False, True):
            unroutable = {"token_ids": PROMPT, "stream": stream}
            err = assert_error(await c.post(GENERATE, json=unroutable), 503)
            assert err["type"] == "service_unavailable_error"
        await eventually(idle(fe))


# -- metrics, errors in a stream, cancellation -----------------------------------------------


async def test_metrics_count_generate_requests() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        ttft = fe.metrics.time_to_first_token_seconds.window
        itl = fe.metrics.inter_token_latency_seconds.window
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6}}
        assert (await c.post(GENERATE, json=body)).status_code == 200
        async with c.stream("POST", GENERATE, json={**body, "stream": True}) as r:
            await sse_events(r)
        assert _requests(fe, "unary", "success") == 1
        assert _requests(fe, "stream", "success") == 1
        assert ttft.statistics().count == 2
        assert itl.statistics().count == 2 * 5
        assert fe.metrics.output_sequence_tokens.labels(MODEL)._sum.get() == 12
        assert fe.metrics.input_sequence_tokens.labels(MODEL)._sum.get() == 10
        text = fe.metrics.render().decode()
        assert (
            'endpoint="generate",model="deepseek-v4",request_type="stream",status="success"' in text
        )


async def test_an_error_after_the_stream_started_is_an_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:

        async def broken(request: GenerateRequest, *_: Any, **__: Any) -> Any:
            yield Chunk(request.request_id, [42, 43])
            raise WorkerFailed("the worker broke the stream")

        monkeypatch.setattr(fe.pipeline.dispatcher, "stream", broken)
        body = {"token_ids": PROMPT, "stream": True}
        async with c.stream("POST", GENERATE, json=body) as r:
            assert r.status_code == 200
            events = await sse_events(r)
        first, error, done = events
        assert first["choices"][0]["token_ids"] == [42, 43]
        assert error == {
            "error": {
                "message": "the worker broke the stream",
                "type": "internal_server_error",
                "param": None,
                "code": None,
            }
        }
        assert done == "DONE"
        assert _requests(fe, "stream", "error") == 1
        # Before any output, the same error is the response's status.
        assert_error(await c.post(GENERATE, json={"token_ids": PROMPT}), 502)


async def test_client_disconnect_mid_stream_cancels_and_frees_kv() -> None:
    # Slow engine (speedup 1): the stream is still generating when the client leaves.
    async with (
        serve_frontend(speedup_ratio=1.0) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        decode = next(e for e in engines(fe) if e.role.value == "decode")
        body = {
            "token_ids": list(range(1000, 1300)),
            "stream": True,
            "sampling_params": {"max_tokens": 5000, "ignore_eos": True},
        }
        async with c.stream("POST", GENERATE, json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"token_ids"' in line:
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
            while _requests(fe, "stream", "cancelled") < 1:
                await trio.sleep(0.01)
        assert fe.metrics.disconnected_clients._value.get() == 1
        assert fe.metrics.model_cancellation_total._value.get() == 1
        await eventually(idle(fe))
