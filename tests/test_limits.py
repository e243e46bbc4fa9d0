"""Request limits and the per-request deadline over a real socket: each refusal's status,
body and metric, and that a request cut off by its deadline is cancelled on its worker.

Policy: every test runs its own frontend on 127.0.0.1:0 (see frontend_fixture) with
in-process simulated workers. The deadline tests run the mocker at real speed
(``speedup_ratio=1``, a token every few ms, 5000 tokens asked) with a deadline of
0.5 s: the request is mid-generation when it passes. Their time bounds are generous
(a loaded machine), yet a deadline that did not fire would take the 5000 tokens' ~30 s.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from frontend.limits import LIMITS, RequestLimits
from frontend.server import Frontend
from headwater.cli import build_parser, env_name
from headwater.cli.serve import frontend_config_from_args

from frontend_fixture import assert_error, engines, eventually, idle, serve_frontend, sse_events

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]
POST = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"


def _rejected(fe: Frontend, reason: str) -> float:
    value: float = fe.metrics.rejected_requests_total.labels(reason)._value.get()
    return value


def _requests(fe: Frontend, endpoint: str, kind: str, status: str) -> float:
    value: float = fe.metrics.requests_total.labels(endpoint, kind, status, MODEL)._value.get()
    return value


# -- the limits ----------------------------------------------------------------------------

LIMITED = RequestLimits(
    max_tokens_cap=32, max_messages=4, max_prompt_chars=400, max_stop_strings=2, max_stop_length=8
)

# (path, body over one limit, the limit, param, code)
OVER: list[tuple[str, dict[str, Any], str, str, str]] = [
    (
        POST,
        {"model": MODEL, "messages": CHAT, "max_tokens": 33},
        "max_tokens_cap",
        "max_tokens",
        "integer_above_max_value",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_completion_tokens": 99},
        "max_tokens_cap",
        "max_completion_tokens",
        "integer_above_max_value",
    ),
    (
        GENERATE,
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 33}},
        "max_tokens_cap",
        "sampling_params.max_tokens",
        "integer_above_max_value",
    ),
    (
        POST,
        {"model": MODEL, "messages": CHAT * 5},
        "max_messages",
        "messages",
        "array_above_max_length",
    ),
    (
        POST,
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 401}]},
        "max_prompt_chars",
        "messages",
        "string_above_max_length",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "y" * 401},
        "max_prompt_chars",
        "prompt",
        "string_above_max_length",
    ),
    (
        POST,
        {"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c"]},
        "max_stop_strings",
        "stop",
        "array_above_max_length",
    ),
    (
        POST,
        {"model": MODEL, "messages": CHAT, "stop": "123456789"},
        "max_stop_length",
        "stop",
        "string_above_max_length",
    ),
]


async def test_each_limit_is_a_400_naming_it_and_counted_by_name() -> None:
    async with serve_frontend(limits=LIMITED) as (fe, url), httpx.AsyncClient(base_url=url) as c:
        for reason in LIMITS:  # every series exists from the start, at 0
            assert _rejected(fe, reason) == 0
        assert all(f'reason="{r}"' in fe.metrics.render().decode() for r in LIMITS)
        counts: dict[str, int] = {}
        for path, body, limit, param, code in OVER:
            err = assert_error(await c.post(path, json=body), 400, param)
            assert (err["type"], err["code"]) == ("invalid_request_error", code), err
            counts[limit] = counts.get(limit, 0) + 1
            assert _rejected(fe, limit) == counts[limit]
        # Within the limits: served, and a request that asks no max_tokens gets the cap.
        within = {
            "model": MODEL,
            "messages": CHAT * 4,
            "stop": ["\x00\x01", "\x02"],
            "ignore_eos": True,
        }
        ok = await c.post(POST, json=within)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 32
        assert sum(_rejected(fe, r) for r in LIMITS) == len(OVER)
        await eventually(idle(fe))


async def test_the_body_size_and_the_context_length_count_as_limits_too(http_parser: str) -> None:
    async with (
        serve_frontend(http_parser=http_parser, max_body_bytes=4096, context_length=64) as (
            fe,
            url,
        ),
        httpx.AsyncClient(base_url=url) as c,
    ):
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}
        assert_error(await c.post(POST, json=big), 413)
        assert _rejected(fe, "max_body_bytes") == 1
        err = assert_error(await c.post(GENERATE, json={"token_ids": [5] * 64}), 400, "token_ids")
        assert err["code"] == "context_length_exceeded"
        assert _rejected(fe, "context_length") == 1


def test_every_limit_is_an_option_with_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser("serve")
    text = "".join(parser.format_help().split())
    options = [
        "--max-tokens-cap",
        "--max-messages",
        "--max-prompt-chars",
        "--max-stop-strings",
        "--max-stop-length",
        "--request-timeout",
    ]
    for option in options:
        assert option in text, option
        assert env_name(option) in text, option
    assert frontend_config_from_args(parser.parse_args([])).limits == RequestLimits()
    monkeypatch.setenv("HEADWATER_MAX_MESSAGES", "7")
    args = build_parser("serve").parse_args(["--request-timeout", "2.5", "--max-stop-length", "0"])
    assert frontend_config_from_args(args).limits == RequestLimits(
        max_messages=7, request_timeout=2.5, max_stop_length=0
    )
    with pytest.raises(ValueError, match="request_timeout"):
        frontend_config_from_args(build_parser("serve").parse_args(["--request-timeout", "-1"]))


# -- the deadline --------------------------------------------------------------------------

LONG = {"model": MODEL, "messages": CHAT, "max_tokens": 5000, "ignore_eos": True}


async def _cancelled_on_the_worker(fe: Frontend) -> None:
    """The generation stopped on the decode worker and freed its KV."""
    decode = next(e for e in engines(fe) if e.role.value == "decode")
    with trio.fail_after(10):
        while decode.statistics().kv_blocks_used or decode.statistics().active_requests:
            await trio.sleep(0.01)
    assert decode.counters.requests_cancelled == 1
    assert decode.counters.requests_finished == 0


@pytest.mark.slow
async def test_a_unary_request_past_its_deadline_is_a_504_and_cancelled_on_its_worker(
    http_parser: str,
) -> None:
    async with (
        serve_frontend(
            http_parser=http_parser, speedup_ratio=1.0, limits=RequestLimits(request_timeout=0.5)
        ) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=60) as c,
    ):
        start = trio.current_time()
        err = assert_error(await c.post(POST, json=LONG), 504)
        assert 0.5 <= trio.current_time() - start < 10
        assert err["code"] == "request_timeout"
        assert "0.5 seconds" in err["message"]
        await _cancelled_on_the_worker(fe)
        assert _rejected(fe, "request_timeout") == 1
        assert _requests(fe, "chat", "unary", "error") == 1
        assert fe.metrics.disconnected_clients._value.get() == 0  # not the client's doing
        # A request that fits in the deadline is served.
        ok = await c.post(POST, json={**LONG, "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        await eventually(idle(fe))


@pytest.mark.slow
async def test_a_stream_past_its_deadline_ends_with_an_error_event_and_done(
    http_parser: str,
) -> None:
    async with (
        serve_frontend(
            http_parser=http_parser, speedup_ratio=1.0, limits=RequestLimits(request_timeout=0.5)
        ) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=60) as c,
    ):
        start = trio.current_time()
        async with c.stream("POST", POST, json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = await sse_events(r)
        assert 0.5 <= trio.current_time() - start < 10
        *deltas, error, done = events
        assert done == "DONE"
        assert len(deltas) > 2  # it was generating
        assert error["error"]["code"] == "request_timeout"
        assert set(error["error"]) == {"message", "type", "param", "code"}
        await _cancelled_on_the_worker(fe)
        assert _rejected(fe, "request_timeout") == 1
        assert _requests(fe, "chat", "stream", "error") == 1
        await eventually(idle(fe))


@pytest.mark.slow
async def test_the_deadline_covers_preprocess_on_every_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request stuck before its first token (here: a preprocess stage that never ends)
    gets a 504 status, streamed or not, on the token-in API too."""
    async with (
        serve_frontend(limits=RequestLimits(request_timeout=0.3)) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=60) as c,
    ):

        async def stuck(parsed: Any) -> Any:
            await trio.sleep_forever()

        monkeypatch.setattr(fe.pipeline, "preprocess", stuck)
        monkeypatch.setattr(fe.pipeline, "preprocess_tokens", stuck)
        for path, body in ((POST, LONG), (GENERATE, {"token_ids": [1, 2, 3]})):
            for stream in (False, True):
                r = await c.post(path, json={**body, "stream": stream})
                assert assert_error(r, 504)["code"] == "request_timeout"
        assert _rejected(fe, "request_timeout") == 4
        await eventually(idle(fe))


async def test_min_tokens_above_what_the_request_may_generate_is_a_400_before_any_stream() -> None:
    """With no max_tokens asked, the request gets the cap (or what the context leaves);
    a min_tokens above that is the client's 400 up front, not a worker's refusal in the
    stream (the API fuzz found that one)."""
    async with (
        serve_frontend(limits=RequestLimits(max_tokens_cap=32)) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        for stream in (False, True):
            body = {"model": MODEL, "messages": CHAT, "min_tokens": 33, "stream": stream}
            err = assert_error(await c.post(POST, json=body), 400, "min_tokens")
            assert "32" in err["message"]
        assert all(e.counters.requests_started == 0 for e in engines(fe))
