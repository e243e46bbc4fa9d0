"""A real frontend on a loopback socket, for the HTTP tests, and what they read of it.

Policy: hypercorn binds 127.0.0.1:0 inside the test's own nursery; the in-process
mocker workers run with a large speedup ratio so tests take milliseconds of engine
time. The tokenizer is loaded once per session and shared (it is immutable).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import orjson
import pytest
import trio

from frontend.config import FrontendConfig
from frontend.preprocess.tokenizer import Tokenizer
from frontend.server import Frontend
from headwater.plane import memory
from headwater.plane.memory import MemoryWorkerClient
from headwater.wire import Chunk
from workers.engines.mocker import MockerConfig, MockerEngine


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until *predicate* holds (fails after *within* s). For what the server books
    after the client already has its answer: a response's last byte reaches the client
    before the server's ASGI call returns and its gauges are settled."""
    with trio.fail_after(within):
        while not predicate():
            await trio.sleep(0.01)


def idle(frontend: Frontend) -> Callable[[], bool]:
    """No generation request in flight (the ``inflight_requests`` gauge is back at 0)."""
    return lambda: frontend.metrics.inflight_requests._value.get() == 0


@functools.cache
def shared_tokenizer(backend: str = "fastokens") -> Tokenizer:
    return Tokenizer.load(None, backend)


async def start_frontend(
    nursery: trio.Nursery, **overrides: Any
) -> tuple[Frontend, str, trio.Event]:
    """Start a frontend in *nursery*; returns it, its base URL, and an event set when its
    ``run`` returns on its own (after :meth:`Frontend.stop`: the drain, then the shutdown).

    *overrides* are FrontendConfig fields, plus ``speedup_ratio`` for the in-process
    mocker workers (1000 unless given). Their answers run to ``max_tokens``
    (``mean_output_tokens=0``): the tests count tokens. Pass an ``engine_config`` for
    answers that end with EOS (tests/test_answer_length.py).
    """
    speedup = overrides.pop("speedup_ratio", 1000.0)
    engine = MockerConfig(speedup_ratio=speedup, mean_output_tokens=0)
    settings: dict[str, Any] = {
        "port": 0,
        "tokenizer_threads": 2,
        "engine_config": engine,
        **overrides,
    }
    config = FrontendConfig(**settings)
    frontend = Frontend(config, tokenizer=shared_tokenizer(config.tokenizer_backend))
    stopped = trio.Event()

    async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await frontend.run(task_status=task_status)
        stopped.set()

    urls = await nursery.start(run)
    return frontend, urls[0], stopped


@asynccontextmanager
async def serve_frontend(**overrides: Any) -> AsyncIterator[tuple[Frontend, str]]:
    """Run a frontend until the block ends; yields it and its base URL.

    *overrides* as for :func:`start_frontend`.
    """
    async with trio.open_nursery() as nursery:
        frontend, url, _ = await start_frontend(nursery, **overrides)
        yield frontend, url
        nursery.cancel_scope.cancel()


async def sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE body into JSON events; the [DONE] marker becomes the string 'DONE'."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: ") :]
        events.append("DONE" if data == "[DONE]" else orjson.loads(data))
    return events


def engines(frontend: Frontend) -> list[MockerEngine]:
    """The frontend's in-process mocker engines."""
    clients = frontend.router.clients()
    assert clients
    assert all(isinstance(c, MemoryWorkerClient) for c in clients)
    return [c.runtime.engine for c in clients]  # type: ignore[attr-defined]


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """*r* is an OpenAI-style error with *status* (and *param*, if given); its body."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


async def raw_chunks(
    url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> list[bytes]:
    """POST *body* over a bare socket and return the chunked response's chunks, as written."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    raw = b""
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head.encode() + payload)
            while data := await stream.receive_some():
                raw += data
    headers, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in headers.lower()
    chunks: list[Any] = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return chunks
        chunks.append(rest[:n])
        rest = rest[n + 2 :]


def deliver_chunks_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, the in-process plane holds each stream's unfinished chunks until its
    last one, then delivers them all: a consumer finds them waiting together, as one
    that fell behind its engine does, and the plane merges them."""
    held: dict[int, list[Any]] = {}
    send = memory._ReplyChannel.send

    async def send_late(self: memory._ReplyChannel, value: Any) -> None:
        if isinstance(value, Chunk) and value.finish_reason is None:
            held.setdefault(id(self), []).append(value)
            return
        for chunk in held.pop(id(self), []):
            await send(self, chunk)
        await send(self, value)

    monkeypatch.setattr(memory._ReplyChannel, "send", send_late)


@contextmanager
def frontend_in_thread(**overrides: Any) -> Iterator[str]:
    """Run a frontend (as :func:`serve_frontend`) in a thread of its own, with its own
    trio loop, for synchronous tests (Hypothesis' ``@given``, which runs each example
    as a plain call); yields its base URL and stops it when the block ends."""
    ready: queue.Queue[str | BaseException] = queue.Queue()
    stop = threading.Event()

    async def main() -> None:
        try:
            async with serve_frontend(**overrides) as (_, url):
                ready.put(url)
                await trio.to_thread.run_sync(stop.wait)
        except BaseException as exc:
            ready.put(exc)
            raise

    thread = threading.Thread(target=trio.run, args=(main,), name="frontend", daemon=True)
    thread.start()
    got = ready.get(timeout=120)
    if isinstance(got, BaseException):
        raise RuntimeError("the frontend did not start") from got
    try:
        yield got
    finally:
        stop.set()
        thread.join(timeout=60)


@pytest.fixture(params=["h11", "httptools"])
def http_parser(request: pytest.FixtureRequest) -> str:
    """Each HTTP/1.1 parser the frontend may run (``--http-parser``), for a test that
    speaks HTTP to it: what it checks holds whichever reads the requests. Pass it to
    :func:`serve_frontend` as ``http_parser``."""
    value: str = request.param
    return value
