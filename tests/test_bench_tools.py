"""Benchmark tooling: prompt synthesis, the loopback guard, statistics, scraping, the load client.

Test policy: loopback only (127.0.0.1, port 0); the end-to-end tests run a small fake
OpenAI-compatible server (plain ASGI on hypercorn-trio, in this process) against the real
load-generator child process; every run is bounded by a time limit of a few seconds.
Token counts are checked against HF ``tokenizers`` as the independent oracle.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import orjson
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from tokenizers import Tokenizer

from headwater.ports import free_port
from scripts.bench import prompts
from scripts.bench.loadgen import (
    LoadResult,
    NotLoopbackError,
    check_loopback,
    run_load,
    run_load_trio,
)
from scripts.bench.scrape import (
    DYNAMO_PREFIX,
    LoopScraper,
    loop_report,
    loop_series,
    parse_loop,
    proc_report,
    read_proc,
)
from scripts.bench.stats import markdown_header, markdown_row, percentile, summarise

MODEL = prompts.DEFAULT_MODEL


@pytest.fixture(scope="module")
def oracle() -> Callable[[str], int]:
    tok = Tokenizer.from_file(str(prompts.tokenizer_path()))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


# --- prompts ------------------------------------------------------------------------


@pytest.mark.parametrize(("scenario", "tokens", "count"), [("short", 100, 20), ("long", 4000, 3)])
@pytest.mark.slow
def test_prompts_hit_the_token_count(
    scenario: str, tokens: int, count: int, oracle: Callable[[str], int]
) -> None:
    ps = prompts.make_prompts(scenario, count, tokens=tokens)
    assert len(ps) == count
    for p in ps.prompts:
        assert p.system is None
        assert p.user_tokens == oracle(p.user)
        assert abs(p.user_tokens - tokens) <= 0.02 * tokens
        assert ps.nonce in p.user
    assert len({p.user for p in ps.prompts}) == count


def test_two_runs_give_different_texts() -> None:
    a = prompts.make_prompts("short", 5)
    b = prompts.make_prompts("short", 5)
    assert a.nonce != b.nonce
    assert not {p.user for p in a.prompts} & {p.user for p in b.prompts}
    # ...while a seed reproduces a run exactly.
    assert prompts.make_prompts("short", 3, seed=7) == prompts.make_prompts("short", 3, seed=7)


def test_shared_prefix_bodies_share_the_system_prompt(oracle: Callable[[str], int]) -> None:
    ps = prompts.make_prompts("shared-prefix", 6, tokens=2000, user_tokens=50)
    system = ps.prompts[0].system
    assert system is not None
    assert abs(oracle(system) - 2000) <= 40
    chat = [orjson.loads(b) for b in prompts.build_bodies(ps, stream=False, max_tokens=4)]
    assert {b["messages"][0]["content"] for b in chat} == {system}
    assert [b["messages"][0]["role"] for b in chat] == ["system"] * 6
    users = [b["messages"][1]["content"] for b in chat]
    assert len(set(users)) == 6
    assert all(abs(oracle(u) - 50) <= 1 for u in users)
    completions = prompts.build_bodies(ps, endpoint="completions", stream=True, max_tokens=4)
    for body, user in zip(completions, users, strict=True):
        text = orjson.loads(body)["prompt"]
        assert text.startswith(system)
        assert text.endswith(user)


def test_bodies_carry_the_request_options() -> None:
    ps = prompts.make_prompts("short", 2)
    unary, streamed = (
        [orjson.loads(b) for b in prompts.build_bodies(ps, stream=s, max_tokens=9)]
        for s in (False, True)
    )
    assert unary[0]["chat_template_kwargs"] == {"thinking": False}
    # Exact answer lengths on every server, whatever its engine's EOS.
    assert unary[0]["ignore_eos"] is streamed[1]["ignore_eos"] is True
    assert unary[0]["stream"] is False
    assert "stream_options" not in unary[0]
    assert streamed[1]["stream_options"] == {"include_usage": True}
    assert streamed[1]["max_tokens"] == 9
    assert streamed[1]["messages"] == [{"role": "user", "content": ps.prompts[1].user}]
    with pytest.raises(ValueError):
        prompts.build_bodies(ps, endpoint="embeddings", stream=False, max_tokens=1)  # type: ignore[arg-type]


# --- loopback guard -----------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1",
        "http://10.0.0.1:8000/v1/completions",
        "http://127.0.0.1.example.com/",
        "http://example.com",
        "ftp://127.0.0.1/",
        "127.0.0.1:8000",
    ],
)
def test_loopback_guard_refuses(url: str) -> None:
    with pytest.raises(NotLoopbackError):
        check_loopback(url)
    with pytest.raises(NotLoopbackError):
        run_load(url, [b"{}"], 1, 1, 1.0, False, progress=False)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/v1/chat/completions",
        "http://127.3.4.5/",
        "http://localhost:1",
        "http://[::1]:8000/metrics",
    ],
)
def test_loopback_guard_accepts(url: str) -> None:
    check_loopback(url)


# --- stats --------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    rng = random.Random(1)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    assert percentile(xs, 50) == pytest.approx(cuts[49])
    assert percentile(xs, 99) == pytest.approx(cuts[98])
    assert percentile(xs, 0) == min(xs)
    assert percentile(xs, 100) == max(xs)
    with pytest.raises(ValueError):
        percentile(xs, 101)


# --- scrape -------------------------------------------------------------------------


def _exposition(prefix: str, delays: list[float], stalls: int, max_delay: float | None) -> str:
    reg = CollectorRegistry()
    hist = Histogram(
        prefix + "event_loop_delay_seconds",
        "d",
        registry=reg,
        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 1.0),
    )
    for d in delays:
        hist.observe(d)
    Counter(prefix + "event_loop_stall_total", "s", registry=reg).inc(stalls)
    if max_delay is not None:
        Gauge(prefix + "event_loop_max_delay_seconds", "m", registry=reg).set(max_delay)
    return generate_latest(reg).decode()


def test_loop_report_takes_the_run_delta() -> None:
    before = parse_loop(_exposition("headwater_frontend_", [0.5] * 10, 3, 0.5))
    # During the run: 99 fast samples (≤ 1 ms) and one 40 ms stall.
    after = parse_loop(
        _exposition("headwater_frontend_", [0.5] * 10 + [0.0005] * 99 + [0.04], 5, 0.04)
    )
    report = loop_report(before, after)
    assert report.samples == 100
    assert report.stalls == 2
    assert report.max_delay_s == 0.04
    assert report.delay_mean_s == pytest.approx((99 * 0.0005 + 0.04) / 100)
    # rank 99 of 100 falls in the first bucket (99 samples ≤ 1 ms), not in the old 0.5 s ones.
    assert report.delay_p99_s is not None
    assert 0 < report.delay_p99_s <= 0.001


def test_loop_report_without_gauge_for_dynamo() -> None:
    before = parse_loop(_exposition(DYNAMO_PREFIX, [], 0, None), DYNAMO_PREFIX)
    after = parse_loop(_exposition(DYNAMO_PREFIX, [0.02] * 4, 1, None), DYNAMO_PREFIX)
    report = loop_report(before, after)
    assert report.max_delay_s is None
    assert (report.samples, report.stalls) == (4, 1)
    assert report.delay_p99_s is not None
    assert 0.01 < report.delay_p99_s <= 0.05


def test_read_proc_of_this_process() -> None:
    before = read_proc(os.getpid())
    sum(i * i for i in range(300_000))  # burn a little CPU
    after = read_proc(os.getpid())
    report = proc_report(before, after)
    assert report.cpu_s >= 0
    assert after.cpu_s > 0
    assert after.peak_rss_bytes >= after.rss_bytes > 0
    assert after.pss_bytes is None  # not asked: the 4 Hz timeline reads RSS only
    with pytest.raises(ProcessLookupError):
        read_proc(2**22 + 1)  # above the kernel's pid_max ceiling


def test_read_proc_with_memory_reads_pss_and_uss() -> None:
    sample = read_proc(os.getpid(), memory=True)
    assert sample.pss_bytes is not None
    assert sample.uss_bytes is not None
    assert 0 < sample.uss_bytes <= sample.pss_bytes <= sample.rss_bytes * 1.05


# --- end to end against a fake server -----------------------------------------------

Send = Callable[[dict[str, Any]], Awaitable[None]]


def _prompt_words(req: dict[str, Any]) -> int:
    if "messages" in req:
        return sum(len(m["content"].split()) for m in req["messages"])
    return len(req["prompt"].split())


async def _sse(send: Send, events: AsyncIterator[bytes]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    async for data in events:
        await send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )
    # The body's end (the last, empty chunk) comes in a later segment than [DONE], as it
    # can from any server: a client that stops reading at [DONE] then loses the connection.
    await trio.sleep(0.002)
    await send({"type": "http.response.body", "body": b""})


#: The query string of every /metrics request the fake server answered.
METRICS_QUERIES: list[bytes] = []

#: The client address (one per connection) of every API request the fake server answered.
API_CLIENTS: list[tuple[str, int]] = []


async def fake_openai(
    scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Send
) -> None:
    """Just enough of the OpenAI API: usage.prompt_tokens = words in the prompt; and a
    fixed ``/metrics`` page (four canary samples, a 2 ms max-delay gauge)."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    if scope["path"] == "/metrics":
        METRICS_QUERIES.append(scope["query_string"])
        page = _exposition("headwater_frontend_", [0.001] * 4, 1, 0.002).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": page})
        return
    API_CLIENTS.append(scope["client"])
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    req = orjson.loads(raw)
    if req["model"] != MODEL:
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"error": "no such model"}'})
        return
    if req.get("hang"):
        await trio.sleep_forever()
    chat = scope["path"] == "/v1/chat/completions"
    n = req["max_tokens"]
    usage = {
        "prompt_tokens": _prompt_words(req),
        "completion_tokens": n,
        "total_tokens": _prompt_words(req) + n,
    }
    if not req["stream"]:
        choice = (
            {"message": {"role": "assistant", "content": "x " * n}} if chat else {"text": "x " * n}
        )
        body = {"choices": [{"index": 0, **choice, "finish_reason": "length"}], "usage": usage}
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(body)})
        return

    async def events() -> AsyncIterator[bytes]:
        def chunk(text: str, finish: str | None = None) -> bytes:
            choice = {"delta": {"content": text}} if chat else {"text": text}
            return orjson.dumps({"choices": [{"index": 0, **choice, "finish_reason": finish}]})

        if chat:  # role-only first chunk: carries no text, must not count as the first token
            yield orjson.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(n):
            yield chunk(f"t{i} ")
        yield chunk("", "length")
        if req.get("stream_options", {}).get("include_usage"):
            yield orjson.dumps({"choices": [], "usage": usage})
        yield b"[DONE]"

    await _sse(send, events())


async def _start_fake(nursery: trio.Nursery) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    urls = await nursery.start(serve, fake_openai, config)
    return str(urls[0])


async def test_loop_scraper_asks_for_the_loop_series_over_one_connection() -> None:
    async with trio.open_nursery() as nursery:
        base = await _start_fake(nursery)
        scraper = LoopScraper(base + "/metrics")
        METRICS_QUERIES.clear()
        try:
            first = await trio.to_thread.run_sync(scraper.scrape)
            assert scraper._conn is not None
            sock = scraper._conn.sock
            second = await trio.to_thread.run_sync(scraper.scrape)
            assert scraper._conn is not None
            assert scraper._conn.sock is sock  # kept alive, not a connection per scrape
            # A connection that went stale is replaced, and the scrape still succeeds.
            sock.shutdown(socket.SHUT_RDWR)
            third = await trio.to_thread.run_sync(scraper.scrape)
            assert scraper._conn.sock is not sock
        finally:
            scraper.close()
        nursery.cancel_scope.cancel()
    for snap in (first, second, third):
        assert snap.delay is not None
        assert (snap.delay.count, snap.max_delay_s, snap.stalls) == (4, 0.002, 1)
    assert len(METRICS_QUERIES) == 3
    asked = [v for k, v in parse_qsl(METRICS_QUERIES[0].decode()) if k == "name[]"]
    assert asked == list(loop_series("headwater_frontend_"))


async def test_loop_scraper_reports_a_server_that_is_gone() -> None:
    port = free_port()  # nothing listens there once it is closed
    scraper = LoopScraper(f"http://127.0.0.1:{port}/metrics", timeout=2.0)
    with pytest.raises(OSError):
        await trio.to_thread.run_sync(scraper.scrape)
    with pytest.raises(NotLoopbackError):
        LoopScraper("http://10.0.0.1:8000/metrics")


def _check(result: LoadResult, bodies: list[bytes], stream: bool, max_tokens: int) -> None:
    assert result.issued == len(result.records) == 20
    assert not result.hit_time_limit
    assert [r.index for r in result.records] == list(range(20))
    for r in result.records:
        assert r.ok, r.error
        assert r.status == 200
        assert r.ttft_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.prompt_tokens == _prompt_words(orjson.loads(bodies[r.body]))
        assert r.completion_tokens == max_tokens
        assert len(r.itl_s) == (max_tokens - 1 if stream else 0)
        assert r.chunks == (max_tokens if stream else 1)
    assert result.wall_s >= max(r.start_s + r.e2e_s for r in result.records) * 0.999
    assert result.client.cpu_s > 0
    s = summarise(result, "e2e")
    assert (s.ok, s.failed, s.cut_off) == (20, 0, 0)
    assert s.req_per_s == pytest.approx(20 / result.wall_s, rel=0.01)
    assert (s.itl_p50_ms is not None) == stream
    assert s.ttft_p50_ms is not None
    assert s.e2e_p99_ms is not None
    assert s.ttft_p50_ms <= s.e2e_p99_ms
    row = markdown_row(s)
    assert row.count("|") == markdown_header().splitlines()[0].count("|")


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_run_load_end_to_end(endpoint: prompts.Endpoint) -> None:
    ps = prompts.make_prompts("short", 10, tokens=60)
    async with trio.open_nursery() as nursery:
        url = await _start_fake(nursery) + prompts.ENDPOINT_PATHS[endpoint]
        for stream in (True, False):
            bodies = prompts.build_bodies(ps, endpoint=endpoint, stream=stream, max_tokens=5)
            # Streaming through the trio shell, unary through the blocking one in a thread.
            if stream:
                result = await run_load_trio(url, bodies, 4, 20, 20.0, stream)
            else:
                result = await trio.to_thread.run_sync(
                    partial(run_load, url, bodies, 4, 20, 20.0, False, progress=False)
                )
            _check(result, bodies, stream, 5)
            assert {r.body for r in result.records} == set(range(10))  # cycled twice
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_streamed_requests_keep_their_connections() -> None:
    """The client reads each stream to its end after [DONE], as the OpenAI SDK does, so a
    connection serves request after request instead of one per streamed request."""
    ps = prompts.make_prompts("short", 10, tokens=40)
    bodies = prompts.build_bodies(ps, stream=True, max_tokens=3)
    async with trio.open_nursery() as nursery:
        url = await _start_fake(nursery) + "/v1/chat/completions"
        API_CLIENTS.clear()
        result = await run_load_trio(url, bodies, 2, 20, 20.0, True)
        nursery.cancel_scope.cancel()
    assert all(r.ok for r in result.records)
    assert len(API_CLIENTS) == 20
    assert len(set(API_CLIENTS)) <= 2


@pytest.mark.slow
async def test_run_load_counts_failures_and_cuts_off_at_the_time_limit() -> None:
    ps = prompts.make_prompts("short", 6, tokens=40)
    bodies = prompts.build_bodies(ps, stream=True, max_tokens=3)
    bodies[2] = prompts.build_bodies(ps.prompts[2:3], stream=True, max_tokens=3, model="nope")[0]
    bodies[4] = prompts.build_bodies(
        ps.prompts[4:5], stream=True, max_tokens=3, extra={"hang": True}
    )[0]
    async with trio.open_nursery() as nursery:
        url = await _start_fake(nursery) + "/v1/chat/completions"
        start = trio.current_time()
        result = await run_load_trio(url, bodies, 2, 6, 0.5, True)
        assert trio.current_time() - start < 10
        nursery.cancel_scope.cancel()
    by_body = {r.body: r for r in result.records}
    assert len(result.records) == 6
    assert result.hit_time_limit
    assert by_body[2].status == 404
    assert by_body[2].error is not None
    assert by_body[2].error.startswith("HTTP 404")
    assert by_body[4].cut_off
    assert not by_body[4].ok
    assert all(by_body[i].ok for i in (0, 1, 3, 5))
    s = summarise(result)
    assert (s.ok, s.failed, s.cut_off) == (4, 1, 1)
    assert s.first_error == by_body[2].error
    assert result.wall_s >= 0.5


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
async def test_cli_prints_a_json_record_and_a_markdown_row() -> None:
    async with trio.open_nursery() as nursery:
        base = await _start_fake(nursery)
        argv = [
            sys.executable,
            "-m",
            "scripts.bench.loadgen",
            "--url",
            base,
            "--stream",
            "--scenario",
            "short",
            "--prompt-tokens",
            "50",
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--max-tokens",
            "3",
            "--pid",
            str(os.getpid()),
            "--label",
            "cli",
            "--header",
            "--no-progress",
            # one page per frontend process: here the same one twice, merged
            "--metrics-url",
            base + "/metrics",
            "--metrics-url",
            base + "/metrics",
        ]
        with trio.fail_after(30):
            done = await trio.run_process(
                argv, cwd=REPO, capture_stdout=True, check=False, capture_stderr=True
            )
        nursery.cancel_scope.cancel()
    assert done.returncode == 0, done.stderr.decode()
    record_line, header, separator, row = done.stdout.decode().splitlines()
    record = orjson.loads(record_line)
    assert (record["ok"], record["requests"], record["failed"]) == (6, 6, 0)
    assert record["content_tokens_mean"] == pytest.approx(50, rel=0.02)
    assert record["completion_tokens_mean"] == 3
    assert record["url"] == base + "/v1/chat/completions"
    assert [p["pid"] for p in record["procs"]] == [os.getpid()]
    # This process served the requests; /proc counts CPU in 10 ms ticks, which six
    # requests to the fake server may not fill, so only its memory is sure to show.
    assert record["procs"][0]["cpu_s"] >= 0
    assert record["procs"][0]["peak_rss_bytes"] > 0
    # The pages did not change during the run; the merged gauge is the larger of the two.
    assert (record["loop"]["samples"], record["loop"]["stalls"]) == (0, 0)
    assert record["loop"]["max_delay_s"] == 0.002
    assert [header, separator] == markdown_header().splitlines()
    assert row.startswith("| cli | stream | 2 | 6/6 |")


async def test_agentic_bodies_run_through_the_parse_stage(headwater: Any) -> None:
    """``--agentic`` bodies (the parse stage's benchmark load) are accepted as they are and
    answered in thinking mode: the answer lands in ``reasoning_content``, not ``content``."""
    server = await headwater.start()

    def make() -> list[bytes]:  # synthesising prompts tokenizes: off the loop
        ps = prompts.make_prompts("short", 2, seed=3)
        return prompts.build_bodies(ps, stream=False, max_tokens=6, extra=prompts.AGENTIC_EXTRA)

    bodies = await trio.to_thread.run_sync(make)
    async with server.client() as client:
        for body in bodies:
            sent = orjson.loads(body)
            assert [t["function"]["name"] for t in sent["tools"]] == [
                "read_file",
                "run_shell",
                "search_code",
            ]
            reply = await client.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            assert message["reasoning_content"]
            assert not message["content"]
