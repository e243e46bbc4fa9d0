"""A real frontend on a loopback socket, for the HTTP tests.

Policy: hypercorn binds 127.0.0.1:0 inside the test's own nursery; the in-process
mocker workers run with a large speedup ratio so tests take milliseconds of engine
time. The tokenizer is loaded once per session and shared (it is immutable).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from frontend.config import FrontendConfig
from frontend.preprocess.tokenizer import Tokenizer
from frontend.server import Frontend
from workers.engines.mocker import MockerConfig


@functools.cache
def shared_tokenizer(backend: str = "fastokens") -> Tokenizer:
    return Tokenizer.load(None, backend)


async def start_frontend(
    nursery: trio.Nursery, **overrides: Any
) -> tuple[Frontend, str, trio.Event]:
    """Start a frontend in *nursery*; returns it, its base URL, and an event set when its
    ``run`` returns on its own (after :meth:`Frontend.stop`: the drain, then the shutdown).

    *overrides* are FrontendConfig fields, plus ``speedup_ratio`` for the in-process
    mocker workers (1000 unless given).
    """
    speedup = overrides.pop("speedup_ratio", 1000.0)
    settings: dict[str, Any] = {
        "port": 0, "tokenizer_threads": 2, "engine_config": MockerConfig(speedup_ratio=speedup),
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
