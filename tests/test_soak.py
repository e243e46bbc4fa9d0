"""The soak's own logic (scripts/soak): its verdicts must be able to fail.

Policy: no headwater server. The judgement runs on synthetic samples; the client runs
against small fake servers on 127.0.0.1 port 0 in the test's nursery, each doing one
thing wrong (or right) on purpose, so that every kind of lost request the soak claims
to catch is shown caught. Real time, every wait bounded by the client's deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import h11
import orjson
import pytest
import trio

from scripts.bench.prompts import Prompt
from scripts.soak.client import (
    ConnectionPool,
    Outcome,
    RequestPlan,
    ResponseReader,
    perform,
    verdict,
)
from scripts.soak.judge import (
    Limits,
    Sample,
    growth,
    judge_end_state,
    judge_process,
    judge_requests,
    leaked,
    loaded_trend,
)
from scripts.soak.mix import DEFAULT_WEIGHTS, Mix, MixSettings, PromptPool, kind_family
from scripts.soak.procs import parse_smaps_rollup, parse_status
from scripts.soak.report import floor_table, rss_floors
from scripts.soak.targets import parse_listing

MIB = 2**20

# --- the judgement ------------------------------------------------------------------------


def idle(
    phase: str,
    rss_mib: float,
    fds: int,
    tasks: int,
    threads: int = 3,
    names: dict[str, int] | None = None,
    t: float = 0.0,
) -> Sample:
    return Sample(
        t,
        phase,
        "frontend",
        rss_bytes=int(rss_mib * MIB),
        fds=fds,
        threads=threads,
        tasks=tasks,
        tasks_by_name=names or {"x": tasks},
    )


def checks_of(samples: list[Sample]) -> dict[str, bool]:
    return {
        c.name: c.passed
        for c in judge_process("frontend", samples, has_tasks=True, limits=Limits())
    }


def test_idle_reads_equal_within_jitter_pass() -> None:
    samples = [
        idle("idle_start", 300, 11, 25),
        idle("idle_start", 301, 12, 26),
        idle("load", 420, 40, 120),  # the load itself is never compared
        idle("idle_end", 310, 11, 25),
        idle("idle_end", 312, 12, 27),
    ]
    assert checks_of(samples) == {"rss": True, "fds": True, "tasks": True, "threads": True}


def test_rss_above_the_limit_fails_on_the_median_of_idle_reads() -> None:
    assert growth([100, 100, 200], [111, 111, 111]) == pytest.approx(0.11)
    # The limit is 5% (Limits.rss_growth).
    over = [idle("idle_start", 300, 11, 25), idle("idle_end", 316, 11, 25)]
    assert checks_of(over)["rss"] is False
    assert checks_of([idle("idle_start", 300, 11, 25), idle("idle_end", 314, 11, 25)])["rss"]


def test_what_the_tokenizer_cache_holds_is_left_out_of_the_rss_rule() -> None:
    def at(phase: str, rss_mib: float, cache_mib: float) -> Sample:
        return replace(idle(phase, rss_mib, 11, 25), cache_bytes=int(cache_mib * MIB))

    # +40 MiB of RSS, 36 of them the bounded cache filling: 304 → 308 without it.
    assert checks_of([at("idle_start", 320, 16), at("idle_end", 360, 52)])["rss"]
    # The same RSS with the cache unchanged is growth of the frontend's own.
    assert not checks_of([at("idle_start", 320, 16), at("idle_end", 360, 16)])["rss"]
    # A cache that could not be read on one end: judged on RSS alone.
    unread = replace(at("idle_end", 360, 52), cache_bytes=None)
    assert not checks_of([at("idle_start", 320, 16), unread])["rss"]


def test_a_task_or_descriptor_in_every_end_read_is_a_leak_and_named() -> None:
    assert leaked([25, 26], [26, 27]) == 0  # 26 was seen at the start: jitter
    assert leaked([25, 26], [27, 28]) == 1
    samples = [
        idle("idle_start", 300, 11, 25, names={"a": 20, "b": 5}),
        idle("idle_end", 300, 13, 27, names={"a": 20, "b": 7}),
    ]
    checks = {
        c.name: c for c in judge_process("frontend", samples, has_tasks=True, limits=Limits())
    }
    assert not checks["tasks"].passed
    assert "{'b': 2}" in checks["tasks"].detail
    assert not checks["fds"].passed
    assert checks["threads"].passed


def test_a_figure_that_could_not_be_read_fails() -> None:
    gone = Sample(9.0, "idle_end", "frontend", error="the process is gone")
    checks = checks_of([idle("idle_start", 300, 11, 25), gone])
    assert not any(checks.values())


def test_loaded_trend_is_the_fitted_rise_over_the_load() -> None:
    rising = [Sample(t, "load", "p", rss_bytes=int((100 + t) * MIB)) for t in range(0, 101, 10)]
    assert loaded_trend(rising) == pytest.approx(1.0)
    assert loaded_trend([Sample(0, "load", "p", rss_bytes=MIB)]) is None


def test_rss_floor_is_the_lowest_read_of_each_window_of_the_load() -> None:
    # Reads every 10 s from t=100: a saw (in flight at the read) on a floor that rises
    # 1 MiB per window; reads outside the load and unread figures are left out.
    reads: list[dict[str, int | None]] = [
        {"t_s": 100 + 10 * i, "rss_bytes": (200 + i // 6 + 50 * (i % 2)) * MIB} for i in range(18)
    ]
    reads += [
        {"t_s": 50, "rss_bytes": MIB},
        {"t_s": 290, "rss_bytes": MIB},
        {"t_s": 150, "rss_bytes": None},
    ]
    assert rss_floors(reads, 100, 280, 60) == [200 * MIB, 201 * MIB, 202 * MIB]
    assert rss_floors(reads, 100, 285, 60) == [200 * MIB, 201 * MIB, 202 * MIB]  # folded
    assert rss_floors(reads, 100, 400, 60)[-2:] == [MIB, None]
    results = {
        "targets": [
            {
                "target": "serve",
                "phases": [{"name": "load", "start_s": 100, "end_s": 280}],
                "processes": [
                    {
                        "name": "frontend",
                        "judged": True,
                        "idle_start": {"rss_bytes": 190 * MIB},
                        "idle_end": {"rss_bytes": 203 * MIB},
                    }
                ],
                "samples": [{**r, "process": "frontend"} for r in reads],
            }
        ]
    }
    row = "| serve | frontend | 190 | 200 | 201 | 202 | 203 |"
    assert floor_table(results).splitlines()[-1] == row


def test_requests_and_end_state() -> None:
    ok = {"ok": 10, "cancelled": 3, "disconnected": 2, "rejected": 1, "error": 1}
    assert all(c.passed for c in judge_requests(ok))
    assert not judge_requests({**ok, "lost": 1}, ["x"])[0].passed
    assert not judge_requests({**ok, "wrong": 1})[0].passed
    good = {
        "inflight": {"frontend": 0.0, "decode-0": 0},
        "kv": {"decode-0": {"used": 0}},
        "restarted": [],
        "health": 200,
        "exit_status": 0,
    }
    assert all(c.passed for c in judge_end_state(good))
    for bad in (
        {"inflight": {"frontend": 1.0}},
        {"kv": {"prefill-0": {"held": 2}}},
        {"restarted": ["decode-0"]},
        {"health": 503},
        {"exit_status": 1},
    ):
        failed = [c.name for c in judge_end_state({**good, **bad}) if not c.passed]
        assert len(failed) == 1, bad


# --- verdicts on responses ----------------------------------------------------------------

VALID = RequestPlan("short_stream", "POST", "/v1/chat/completions", b"{}", stream=True)
UNARY = RequestPlan("short_unary", "POST", "/v1/chat/completions", b"{}", stream=False)
INVALID = RequestPlan(
    "invalid:x", "POST", "/v1/chat/completions", b"[", stream=False, expect="client_error"
)


def read(plan: RequestPlan, status: int, content_type: str, *chunks: bytes) -> ResponseReader:
    reader = ResponseReader(plan.stream)
    reader.feed(h11.Response(status_code=status, headers=[("content-type", content_type)]))
    for c in chunks:
        reader.feed(h11.Data(data=c))
    reader.feed(h11.EndOfMessage())
    return reader


def sse(*objs: object) -> bytes:
    return b"".join(
        b"data: " + (o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n\n" for o in objs
    )


CHUNK = {"choices": [{"delta": {"content": "hi"}}]}
USAGE = {"choices": [], "usage": {"completion_tokens": 1}}
ERROR = {"error": {"message": "m", "type": "invalid_request_error", "code": None}}


def test_verdicts() -> None:
    ev = "text/event-stream"
    assert verdict(VALID, read(VALID, 200, ev, sse(CHUNK, USAGE, b"[DONE]")))[0] is Outcome.OK
    # Split anywhere, the events are the same.
    whole = sse(CHUNK, USAGE, b"[DONE]")
    assert verdict(VALID, read(VALID, 200, ev, whole[:7], whole[7:31], whole[31:]))[0] is Outcome.OK
    assert verdict(VALID, read(VALID, 200, ev, sse(CHUNK, USAGE)))[0] is Outcome.LOST
    assert verdict(VALID, read(VALID, 200, ev, sse(CHUNK, b"[DONE]")))[0] is Outcome.LOST
    assert verdict(VALID, read(VALID, 200, ev, sse(b"{nope", b"[DONE]")))[0] is Outcome.LOST
    busy = {"error": {"message": "busy", "type": "service_unavailable_error", "code": "all_busy"}}
    assert verdict(VALID, read(VALID, 200, ev, sse(busy, b"[DONE]")))[0] is Outcome.ERROR
    internal = {"error": {"message": "x", "type": "internal_server_error", "code": None}}
    assert verdict(VALID, read(VALID, 200, ev, sse(internal, b"[DONE]")))[0] is Outcome.WRONG
    js = "application/json"
    body = orjson.dumps({"choices": [{"message": {}}], "usage": {}})
    assert verdict(UNARY, read(UNARY, 200, js, body))[0] is Outcome.OK
    assert verdict(UNARY, read(UNARY, 200, js, b'{"choices": []}'))[0] is Outcome.LOST
    assert verdict(UNARY, read(UNARY, 500, "text/html", b"oops"))[0] is Outcome.LOST
    assert verdict(UNARY, read(UNARY, 503, js, orjson.dumps(ERROR)))[0] is Outcome.ERROR
    assert verdict(UNARY, read(UNARY, 500, js, orjson.dumps(ERROR)))[0] is Outcome.WRONG
    assert verdict(UNARY, read(UNARY, 400, js, orjson.dumps(ERROR)))[0] is Outcome.WRONG
    assert verdict(INVALID, read(INVALID, 400, js, orjson.dumps(ERROR)))[0] is Outcome.REJECTED
    assert verdict(INVALID, read(INVALID, 200, js, body))[0] is Outcome.WRONG
    assert verdict(INVALID, read(INVALID, 400, js, b'{"detail": "x"}'))[0] is Outcome.LOST


# --- the client against fake servers --------------------------------------------------------

Handler = Callable[[trio.SocketStream], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(stream: trio.SocketStream, conn: h11.Connection | None = None) -> bool:
    """Read one request; False if the client closed the connection instead."""
    conn = conn or h11.Connection(h11.SERVER)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive_some(65536))
            except trio.BrokenResourceError:
                return False
        elif isinstance(event, h11.EndOfMessage):
            return True
        elif isinstance(event, h11.ConnectionClosed):
            return False


async def good_stream(stream: trio.SocketStream, events: int = 3) -> None:
    """A whole stream per request, for as long as the client keeps the connection."""
    conn = h11.Connection(h11.SERVER)
    with contextlib.suppress(trio.BrokenResourceError):
        while await read_request(stream, conn):
            await stream.send_all(HEAD)
            for _ in range(events):
                await stream.send_all(chunk(sse(CHUNK)))
            await stream.send_all(chunk(sse(USAGE, b"[DONE]")) + b"0\r\n\r\n")
            conn = h11.Connection(h11.SERVER)  # the response was written by hand


async def cut_stream(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(HEAD + chunk(sse(CHUNK)))
    await stream.aclose()  # the server closes mid-stream


async def reset_at_once(stream: trio.SocketStream) -> None:
    await read_request(stream)
    stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
    await stream.aclose()


async def silent(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await trio.sleep_forever()


async def serve(nursery: trio.Nursery, handler: Handler) -> ConnectionPool:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return ConnectionPool("127.0.0.1", listeners[0].socket.getsockname()[1])


@pytest.mark.parametrize(
    ("handler", "plan", "outcome", "detail"),
    [
        (good_stream, VALID, Outcome.OK, "HTTP 200 stream"),
        (cut_stream, VALID, Outcome.LOST, "a broken response"),
        (reset_at_once, VALID, Outcome.LOST, "before any response"),
        (silent, VALID, Outcome.LOST, "no whole answer within 0.3 s"),
        (
            good_stream,
            RequestPlan("c", "POST", "/", b"{}", stream=True, how="cancel", after_events=2),
            Outcome.CANCELLED,
            "closed after 2 events",
        ),
        (
            good_stream,
            RequestPlan("r", "POST", "/", b"{}", stream=True, how="reset_events", after_events=1),
            Outcome.DISCONNECTED,
            "reset after 1 events",
        ),
        (
            silent,
            RequestPlan("w", "POST", "/", b"{}", stream=True, how="reset_wait", after_s=0.05),
            Outcome.DISCONNECTED,
            "reset after waiting",
        ),
        (
            silent,
            RequestPlan(
                "u", "POST", "/", b"x" * 1000, stream=False, how="reset_upload", upload_fraction=0.5
            ),
            Outcome.DISCONNECTED,
            "reset after 500 of",
        ),
    ],
)
async def test_client_tells_who_ended_the_exchange(
    nursery: trio.Nursery, handler: Handler, plan: RequestPlan, outcome: Outcome, detail: str
) -> None:
    pool = await serve(nursery, handler)
    result = await perform(plan, pool, deadline_s=0.3)
    assert result.outcome is outcome, result.detail
    assert detail in result.detail
    await pool.aclose()


async def test_client_reuses_a_kept_alive_connection_and_a_storm_resets(
    nursery: trio.Nursery,
) -> None:
    pool = await serve(nursery, good_stream)
    first = await perform(VALID, pool, deadline_s=5)
    second = await perform(VALID, pool, deadline_s=5)
    assert (first.outcome, first.reused, second.outcome, second.reused) == (
        Outcome.OK,
        False,
        Outcome.OK,
        True,
    )
    stormy = await serve(nursery, silent)
    in_flight: set[Any] = set()
    results: list[Any] = []

    async def one() -> None:
        results.append(await perform(VALID, stormy, deadline_s=5, in_flight=in_flight))

    async with trio.open_nursery() as requests:
        requests.start_soon(one)
        while not in_flight:
            await trio.sleep(0.01)
        for request in list(in_flight):
            request.storm()
    assert results[0].outcome is Outcome.DISCONNECTED
    assert not in_flight
    await pool.aclose()
    await stormy.aclose()


# --- the mix, the listing, /proc ------------------------------------------------------------


def test_mix_is_seeded_and_draws_every_kind_with_distinct_bodies() -> None:
    pool = PromptPool(
        short=(Prompt("short words", 2),),
        long={4000: (Prompt("long words " * 10, 20),), 40000: (Prompt("longer " * 20, 40),)},
    )
    a = [Mix(pool, MixSettings(seed=7)).next() for _ in range(1)]
    mix_a, mix_b = Mix(pool, MixSettings(seed=7)), Mix(pool, MixSettings(seed=7))
    plans = [mix_a.next() for _ in range(600)]
    assert [p.body for p in plans[:50]] == [mix_b.next().body for _ in range(50)]
    assert a[0].body == plans[0].body
    assert {kind_family(p.kind) for p in plans} == set(DEFAULT_WEIGHTS)
    valid = [p for p in plans if p.expect == "ok"]
    assert len({p.body for p in valid}) == len(valid)  # every prompt opens differently
    assert all(orjson.loads(p.body)["model"] == "deepseek-v4" for p in valid)
    only = Mix(pool, MixSettings(weights={"cancel": 1}))
    assert {only.next().how for _ in range(20)} == {"cancel"}
    with pytest.raises(ValueError, match="unknown kinds"):
        Mix(pool, MixSettings(weights={"nope": 1}))


def test_launch_listing_parses() -> None:
    lines = [
        "headwater launch: deepseek-v4 on http://127.0.0.1:4000 (1 prefill, 1 decode; ...)",
        "etcd         pid 11       http://127.0.0.1:2379",
        "prefill-0    pid 12       tcp://127.0.0.1:5001",
        "frontend     pid 13       http://127.0.0.1:4000",
        "prefill-0    metrics http://127.0.0.1:9001/metrics",
        "HEADWATER_CLUSTER_READY http://127.0.0.1:4000",
    ]
    watched, url = parse_listing(lines)
    assert url == "http://127.0.0.1:4000"
    by_name = {w.name: w for w in watched}
    assert (by_name["etcd"].pid, by_name["etcd"].judged) == (11, False)
    assert (by_name["prefill-0"].runtime_port, by_name["prefill-0"].role) == (9001, "worker")
    assert by_name["frontend"].runtime_port == 4000


def test_proc_parsers() -> None:
    assert parse_status("Name:\tpython\nVmRSS:\t  2048 kB\nThreads:\t7\n") == (2 * MIB, 7)
    rollup = (
        "5555-6666 ---p 00000000 00:00 0  [rollup]\nRss:  300 kB\nPss:  200 kB\n"
        "Private_Clean:  10 kB\nPrivate_Dirty:  90 kB\n"
    )
    assert parse_smaps_rollup(rollup) == (200 * 1024, 100 * 1024)
    with pytest.raises(ValueError, match="Pss"):
        parse_smaps_rollup("nothing")
