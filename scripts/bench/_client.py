"""The load generator's child process: aiohttp workers that replay pre-built bodies.

Run by path (``python _client.py JOB.json``) by :mod:`scripts.bench.loadgen`, never
imported by the project: it needs only the standard library, aiohttp and orjson, so it
starts fast and works wherever the venv does. It runs in its own process (with its own
core when one is free) so that the client is not what a measurement measures; it reports
its own CPU time so that the reader can check.

Protocol (stdout, one JSON object per line):

- ``{"event": "ready", "t0": <CLOCK_MONOTONIC seconds>}`` once bodies are loaded, just
  before the first request;
- ``{"event": "request", ...}`` per finished request (fields: see ``RequestRecord`` in
  :mod:`scripts.bench.loadgen`); times are seconds, ``start_s`` relative to ``t0``;
- ``{"event": "done", ...}`` with wall time, request counts and the child's CPU usage.

Workers pull the next body index from a shared counter (``index % len(bodies)``) until
``max_requests`` were issued or ``time_limit`` passed; at the time limit in-flight
requests are cancelled and reported with ``cut_off: true``. Errors become records, never
crashes; a non-zero exit status means a bug or a bad job file (message on stderr).
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import struct
import sys
import time
from typing import Any

import aiohttp
import orjson

_ERROR_SNIPPET = 200  # bytes of an error response kept in the record


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.buffer.flush()


def _load_bodies(path: str) -> list[bytes]:
    """Bodies file: each body as an 8-byte little-endian length, then the bytes."""
    bodies: list[bytes] = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        bodies.append(data[pos + 8 : pos + 8 + n])
        pos += 8 + n
    return bodies


def _peak_rss_kb() -> int:
    """VmHWM of this process. Not ``ru_maxrss``: that keeps the forked parent's peak across exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _content_of(choice: dict[str, Any]) -> str:
    """Generated text in a streamed choice: chat delta (content or reasoning) or completion."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


class _Request:
    """The measurements of one request while it runs."""

    def __init__(self, index: int, body: int, t0: float) -> None:
        self.index = index
        self.body = body
        self.t0 = t0
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.status: int | None = None

    def token_chunk(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.gaps.append(now - self.last)
        self.last = now
        self.chunks += 1

    def record(
        self, *, ok: bool, error: str | None = None, cut_off: bool = False
    ) -> dict[str, Any]:
        end = time.perf_counter()
        usage = self.usage or {}
        return {
            "event": "request",
            "index": self.index,
            "body": self.body,
            "start_s": self.start - self.t0,
            "e2e_s": end - self.start,
            "ttft_s": None if self.first is None else self.first - self.start,
            "itl_s": self.gaps,
            "chunks": self.chunks,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "status": self.status,
            "ok": ok,
            "cut_off": cut_off,
            "error": error,
        }


async def _unary(req: _Request, resp: aiohttp.ClientResponse) -> dict[str, Any]:
    data = await resp.read()
    req.first = time.perf_counter()  # TTFT of a unary request is the whole response
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return req.record(ok=False, error=f"bad JSON response: {data[:_ERROR_SNIPPET]!r}")
    if not isinstance(obj, dict) or "error" in obj or not obj.get("choices"):
        return req.record(ok=False, error=f"error response: {data[:_ERROR_SNIPPET]!r}")
    req.usage = obj.get("usage")
    req.chunks = 1
    return req.record(ok=True)


async def _stream(req: _Request, resp: aiohttp.ClientResponse) -> dict[str, Any]:
    # Whole reads split by hand: a little cheaper than aiohttp's per-line iteration.
    buffer = b""
    async for data in resp.content.iter_any():
        *lines, buffer = (buffer + data).split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, "event:" lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                record = req.record(ok=True)
                await _drain(resp)
                return record
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return req.record(ok=False, error=f"bad SSE payload: {payload[:_ERROR_SNIPPET]!r}")
            if not isinstance(obj, dict) or "error" in obj:
                return req.record(ok=False, error=f"error event: {payload[:_ERROR_SNIPPET]!r}")
            if obj.get("usage"):
                req.usage = obj["usage"]
            if any(_content_of(c) for c in obj.get("choices") or ()):
                req.token_chunk()
    return req.record(ok=False, error="stream ended without [DONE]")


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read a stream to its end after ``[DONE]``, as the OpenAI SDK does.

    Why: aiohttp closes a connection whose response was left unread, and the end of a
    chunked body (its last, empty chunk) often arrives just after ``[DONE]``. Returning
    at ``[DONE]`` made most streamed requests open a new connection, a cost no
    keep-alive client pays (docs/performance.md, "The client's connections").
    """
    while await resp.content.readany():
        pass


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, req: _Request
) -> dict[str, Any]:
    try:
        async with session.post(url, data=body) as resp:
            req.status = resp.status
            if resp.status != 200:
                snippet = (await resp.content.read(_ERROR_SNIPPET)).decode(errors="replace")
                return req.record(ok=False, error=f"HTTP {resp.status}: {snippet}")
            return await (_stream(req, resp) if stream else _unary(req, resp))
    except asyncio.CancelledError:
        _emit(req.record(ok=False, cut_off=True, error="cut off at the time limit"))
        raise
    except Exception as exc:  # a broken response fails its request, never the run
        return req.record(ok=False, error=f"{type(exc).__name__}: {exc}")


async def _run(job: dict[str, Any]) -> None:
    bodies = _load_bodies(job["bodies"])
    url: str = job["url"]
    stream: bool = job["stream"]
    concurrency: int = job["concurrency"]
    max_requests: int = job["max_requests"]
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=job["request_timeout"])
    headers = {"Content-Type": "application/json", "Accept": "*/*"}
    counter = itertools.count()
    issued = 0

    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers, auto_decompress=False
    ) as session:
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        deadline = t0 + job["time_limit"]
        _emit({"event": "ready", "t0": t0})

        async def worker() -> None:
            nonlocal issued
            while time.perf_counter() < deadline:
                i = next(counter)
                if i >= max_requests:
                    return
                issued += 1
                req = _Request(i, i % len(bodies), t0)
                _emit(await _one(session, url, bodies[req.body], stream, req))

        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, max_requests))]
        finished, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - t0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        for task in finished:
            task.result()  # a worker that crashed is a bug: surface it
        usage1 = resource.getrusage(resource.RUSAGE_SELF)

    _emit(
        {
            "event": "done",
            "wall_s": wall,
            "issued": issued,
            "hit_time_limit": bool(pending) or issued < max_requests,
            "cpu_user_s": usage1.ru_utime - usage0.ru_utime,
            "cpu_sys_s": usage1.ru_stime - usage0.ru_stime,
            "max_rss_kb": _peak_rss_kb(),
        }
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} JOB.json", file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        job = orjson.loads(f.read())
    asyncio.run(_run(job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
