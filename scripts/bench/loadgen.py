"""Drive an OpenAI-compatible server with pre-built bodies from a separate process.

Why a child process: an in-process client shares the GIL and the core with whatever runs
the benchmark, and an httpx+trio client saturates its own core at ~150-240 req/s
(docs/performance.md, "Method", "Client"), below what a frontend can serve. The child
(:mod:`scripts.bench._client`, aiohttp) runs a fixed number of workers that replay the
bodies and writes one JSON line per finished request; this module parses those lines
(:class:`_Collector`, no I/O) behind one trio shell, :func:`run_load_trio` (cancelling it
kills the child), and :func:`run_load`, the same run in a new trio loop for blocking callers.

Only loopback URLs are accepted (:func:`check_loopback`): a benchmark must never load a
machine it does not own.

    python -m scripts.bench.loadgen --url http://127.0.0.1:8000 --scenario short \\
        --concurrency 16 --requests 200 --stream
"""

from __future__ import annotations

import ipaddress
import math
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import trio

CLIENT_SCRIPT = Path(__file__).with_name("_client.py")
DEFAULT_REQUEST_TIMEOUT = 300.0  # s, per request, enforced by the child
STARTUP_GRACE = 60.0  # s on top of the time limit before the parent kills a silent child
_STDERR_TAIL = 2000  # characters of the child's stderr quoted in a LoadGenError


class NotLoopbackError(ValueError):
    """The URL points somewhere other than this machine's loopback interface."""


class LoadGenError(RuntimeError):
    """The load generator's child process failed (not a failed *request*: those are records)."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds.

    ``ttft_s``: first SSE chunk carrying generated text (streaming) or the complete
    response (unary); ``None`` if none arrived. ``itl_s``: gaps between successive text
    chunks (one chunk may carry several tokens). Token counts come from ``usage`` and are
    ``None`` if the server sent none. ``cut_off``: cancelled at the time limit.
    """

    index: int  # issue order
    body: int  # index into the bodies
    start_s: float  # since the run started (LoadResult.t0)
    e2e_s: float
    ttft_s: float | None
    itl_s: tuple[float, ...]
    chunks: int
    prompt_tokens: int | None
    completion_tokens: int | None
    status: int | None  # HTTP status; None if no response
    ok: bool
    cut_off: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class ClientUsage:
    """The load generator's own resource use during the run (``getrusage`` in the child)."""

    cpu_user_s: float
    cpu_sys_s: float
    max_rss_kb: int

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_sys_s


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Everything one run measured. ``t0`` is CLOCK_MONOTONIC (``time.perf_counter`` on
    Linux) at the start of the run, so it lines up with the parent's clock and scrapes."""

    url: str
    concurrency: int
    max_requests: int
    time_limit_s: float
    stream: bool
    t0: float
    wall_s: float
    issued: int
    hit_time_limit: bool
    records: tuple[RequestRecord, ...]
    client: ClientUsage

    @property
    def ok(self) -> tuple[RequestRecord, ...]:
        return tuple(r for r in self.records if r.ok)

    def to_json(self, *, records: bool = True) -> dict[str, Any]:
        """A JSON-ready dict; ``records=False`` leaves the per-request list out."""
        d = asdict(self)
        d["client"]["cpu_s"] = self.client.cpu_s
        if not records:
            del d["records"]
        return d


def check_loopback(url: str) -> None:
    """Raise :class:`NotLoopbackError` unless *url* is http(s) to 127.0.0.0/8, ::1 or localhost."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NotLoopbackError(f"not an http(s) URL with a host: {url!r}")
    host = parts.hostname
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise NotLoopbackError(f"refusing non-loopback host {host!r} in {url!r}")


def _validate(
    url: str, bodies: Sequence[bytes], concurrency: int, max_requests: int, time_limit: float
) -> None:
    check_loopback(url)
    if not bodies:
        raise ValueError("no bodies to send")
    if concurrency < 1 or max_requests < 1:
        raise ValueError(
            f"concurrency and max_requests must be >= 1, got {concurrency} and {max_requests}"
        )
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit}")


def _write_job(
    directory: str,
    url: str,
    bodies: Sequence[bytes],
    concurrency: int,
    max_requests: int,
    time_limit: float,
    stream: bool,
    request_timeout: float,
) -> list[str]:
    """Write the bodies and the job file; return the child's command line."""
    bodies_path = os.path.join(directory, "bodies.bin")
    with open(bodies_path, "wb") as f:
        for body in bodies:
            f.write(struct.pack("<Q", len(body)))
            f.write(body)
    job = {
        "url": url,
        "bodies": bodies_path,
        "concurrency": concurrency,
        "max_requests": max_requests,
        "time_limit": time_limit,
        "stream": stream,
        "request_timeout": request_timeout,
    }
    job_path = os.path.join(directory, "job.json")
    with open(job_path, "wb") as f:
        f.write(orjson.dumps(job))
    return [sys.executable, str(CLIENT_SCRIPT), job_path]


class _Collector:
    """Turns the child's stdout lines into a :class:`LoadResult` (sans-IO)."""

    def __init__(
        self, url: str, concurrency: int, max_requests: int, time_limit: float, stream: bool
    ) -> None:
        self._params = (url, concurrency, max_requests, time_limit, stream)
        self._t0: float | None = None
        self._done: dict[str, Any] | None = None
        self._records: list[RequestRecord] = []

    def feed(self, line: bytes) -> RequestRecord | None:
        """Consume one line; return the record if it was a request. Raises LoadGenError."""
        try:
            obj = orjson.loads(line)
            event = obj.pop("event")
        except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise LoadGenError(f"unexpected line from the load client: {line[:200]!r}") from exc
        if event == "request":
            record = RequestRecord(**{**obj, "itl_s": tuple(obj["itl_s"])})
            self._records.append(record)
            return record
        if event == "ready":
            self._t0 = obj["t0"]
        elif event == "done":
            self._done = obj
        return None

    def result(self) -> LoadResult:
        """The finished run. Raises LoadGenError if the child never reported completion."""
        if self._done is None or self._t0 is None:
            raise LoadGenError("the load client exited without reporting completion")
        d = self._done
        url, concurrency, max_requests, time_limit, stream = self._params
        return LoadResult(
            url=url,
            concurrency=concurrency,
            max_requests=max_requests,
            time_limit_s=time_limit,
            stream=stream,
            t0=self._t0,
            wall_s=d["wall_s"],
            issued=d["issued"],
            hit_time_limit=d["hit_time_limit"],
            records=tuple(sorted(self._records, key=lambda r: r.index)),
            client=ClientUsage(d["cpu_user_s"], d["cpu_sys_s"], d["max_rss_kb"]),
        )


def _failure(returncode: int | None, stderr_path: str) -> LoadGenError:
    with open(stderr_path, errors="replace") as f:
        tail = f.read()[-_STDERR_TAIL:]
    return LoadGenError(f"load client exited with status {returncode}: {tail.strip()}")


@contextmanager
def _progress(enabled: bool, total: int, description: str | None) -> Iterator[Callable[[], None]]:
    if not enabled:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, unit="req", leave=False, file=sys.stderr) as bar:
        yield lambda: bar.update(1)


def run_load(
    url: str,
    bodies: Sequence[bytes],
    concurrency: int,
    max_requests: int,
    time_limit: float,
    stream: bool,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    progress: bool = True,
    description: str | None = None,
) -> LoadResult:
    """Send up to *max_requests* requests to *url* with *concurrency* workers; block until done.

    Bodies are used in order and cycled if there are fewer than *max_requests* (pass one
    body per request for distinct prompts). No new request starts after *time_limit*
    seconds, and requests still running then are cut off. *stream* must match the
    bodies' ``"stream"`` field: it tells the client how to read responses. Shows a tqdm
    bar on stderr unless ``progress=False``.

    Raises :class:`NotLoopbackError` or :class:`ValueError` on bad arguments and
    :class:`LoadGenError` if the child process fails. Failed requests are records.
    A blocking call: from trio use :func:`run_load_trio`, which this runs in a new loop.
    """
    return trio.run(
        partial(
            run_load_trio,
            url,
            bodies,
            concurrency,
            max_requests,
            time_limit,
            stream,
            request_timeout=request_timeout,
            progress=progress,
            description=description,
        )
    )


async def run_load_trio(
    url: str,
    bodies: Sequence[bytes],
    concurrency: int,
    max_requests: int,
    time_limit: float,
    stream: bool,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    progress: bool = False,
    description: str | None = None,
) -> LoadResult:
    """:func:`run_load` for trio callers: same contract, the event loop stays free.

    File writes run in a worker thread. On cancellation the child is killed (and reaped
    under a shielded 5 s deadline) before ``trio.Cancelled`` propagates. The whole call is
    bounded by ``time_limit + STARTUP_GRACE``, after which LoadGenError is raised.
    """
    _validate(url, bodies, concurrency, max_requests, time_limit)
    collector = _Collector(url, concurrency, max_requests, time_limit, stream)
    with tempfile.TemporaryDirectory(prefix="headwater-load-") as tmp:
        cmd = await trio.to_thread.run_sync(
            _write_job,
            tmp,
            url,
            bodies,
            concurrency,
            max_requests,
            time_limit,
            stream,
            request_timeout,
        )
        stderr_path = os.path.join(tmp, "stderr.txt")
        with open(stderr_path, "wb") as err:  # noqa: ASYNC230 - opening an empty file
            proc = await trio.lowlevel.open_process(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err
            )
        try:
            assert proc.stdout is not None
            with (
                _progress(progress, max_requests, description) as tick,
                trio.fail_after(time_limit + STARTUP_GRACE),
            ):
                buffer = b""
                async for chunk in proc.stdout:
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        if collector.feed(line) is not None:
                            tick()
                await proc.wait()
        except trio.TooSlowError as exc:
            raise LoadGenError(f"load client still running after {time_limit} s + grace") from exc
        finally:
            with trio.move_on_after(5, shield=True):
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                if proc.stdout is not None:
                    await proc.stdout.aclose()
        if proc.returncode != 0:
            raise _failure(proc.returncode, stderr_path)
    return collector.result()


if __name__ == "__main__":
    from scripts.bench.cli import cli

    sys.exit(cli())
