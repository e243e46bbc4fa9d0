"""The whole frontend and its workers inside the caller's trio run, without a socket.

:func:`open_server` builds a :class:`~frontend.server.Frontend` from the real server's
configuration, starts everything ``Frontend.run`` starts but the listener (tokenizer
pool, loop monitor, in-process workers, router, admission, API keys, the middlewares,
the app's lifespan) in the caller's run, and hands back a :class:`HeadwaterServer`:
clients whose transport calls that ASGI app directly, the fault plan, and the records
of what happened. What a request meets above the socket is what it meets in
``headwater serve``: the same app, limits, chat template, parsers and errors.

Virtual time: under a ``MockClock`` (pytest-trio's ``autojump_clock``) every timer of
the frontend and the workers is trio's, so the engines' pacing, timeouts, retries and
queue waits take no real time. Nothing may then run in a thread (the clock cannot see a
thread's work and would jump past it): prompts are tokenized inline
(``tokenize_mode="inline"``), the scripted engine reads on the loop, the stall
detector's watchdog thread is off (``instrument=False``; the loop canary stays, on
trio's clock), and the SDK clients look up their platform here rather than in a thread.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import trio
import trio.testing
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.lifespan import Lifespan

from frontend.config import FrontendConfig
from frontend.http.serving import serve
from frontend.metrics import FrontendMetrics
from frontend.preprocess.tokenizer import Tokenizer
from frontend.server import Frontend
from headwater.instrumentation.record import StallRecord
from headwater.testing.asgi import ASGIApp, ASGITransport
from headwater.testing.cluster import ObservedCluster, roles_of
from headwater.testing.faults import Faults, FaultyAdmission
from headwater.testing.records import Recorder, RequestRecord
from workers.engines.mocker import MockerConfig
from workers.engines.scripted import ScriptedConfig, parse_script

if TYPE_CHECKING:
    import anthropic
    import httpx2
    import openai

#: The base URL the clients use: no name is looked up, no socket opened.
BASE_URL = "http://headwater.test"
#: A script given as rules: a list of ``{"prompt_contains"|"default", "text"}`` objects.
Rules = Sequence[Mapping[str, Any]]


@functools.cache
def _tokenizer(path: str | None, backend: str) -> Tokenizer:
    """Loaded once per process and shared by every server (a tokenizer is immutable
    once loaded; the default one takes seconds to load)."""
    return Tokenizer.load(path, backend)


class HeadwaterServer:
    """A running in-process frontend; made by :func:`open_server`.

    Attributes:
      frontend: the :class:`~frontend.server.Frontend` itself.
      app: the ASGI app as the listener would serve it, behind the :class:`Recorder`.
      faults: the fault plan (:class:`~headwater.testing.faults.Faults`).
      requests: every HTTP request so far, in arrival order (:class:`RequestRecord`).
      url: the socket's base URL when the server was asked to listen, else None.
      virtual_time: whether it runs on a MockClock.
    """

    def __init__(
        self,
        frontend: Frontend,
        app: ASGIApp,
        requests: list[RequestRecord],
        cluster: ObservedCluster,
        faults: Faults,
        nursery: trio.Nursery,
        state: dict[str, Any],
        url: str | None,
        virtual_time: bool,
    ) -> None:
        self.frontend = frontend
        self.app = app
        self.requests = requests
        self.cluster = cluster
        self.faults = faults
        self.url = url
        self.virtual_time = virtual_time
        self._nursery = nursery
        self._state = state
        self._closers: list[Any] = []

    # -- clients ---------------------------------------------------------------------

    def transport(self) -> ASGITransport:
        """An httpx transport to this server (for a client of your own making)."""
        return ASGITransport(self.app, self._nursery, state=self._state)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` on this server (``base_url`` set, the first API key
        sent if the server has keys); *kwargs* are its own. Closed with the server."""
        headers = {**self._auth_headers(), **kwargs.pop("headers", {})}
        client = httpx.AsyncClient(
            transport=self.transport(), base_url=BASE_URL, headers=headers, **kwargs
        )
        self._closers.append(client)
        return client

    def httpx2_client(self) -> httpx2.AsyncClient:
        """An ``httpx2.AsyncClient`` on this server: what the SDKs send through."""
        import httpx2

        from headwater.testing.sdk import HTTPX2Transport

        transport = HTTPX2Transport(self.app, self._nursery, state=self._state)
        client = httpx2.AsyncClient(transport=transport, base_url=BASE_URL)
        self._closers.append(client)
        return client

    def openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` on this server; *kwargs* are its own (its retries
        and timeouts stay the SDK's defaults unless given). Needs the ``openai``
        package."""
        from headwater.testing.sdk import openai_client

        kwargs.setdefault("api_key", self._api_key())
        return openai_client(self.httpx2_client(), f"{BASE_URL}/v1", **kwargs)

    def anthropic_client(self, **kwargs: Any) -> anthropic.AsyncAnthropic:
        """An ``anthropic.AsyncAnthropic`` on this server (its Messages API); *kwargs* are
        its own. Needs the ``anthropic`` package."""
        from headwater.testing.sdk import anthropic_client

        kwargs.setdefault("api_key", self._api_key())
        return anthropic_client(self.httpx2_client(), BASE_URL, **kwargs)

    # -- what happened ---------------------------------------------------------------

    @property
    def metrics(self) -> FrontendMetrics:
        """The frontend's metrics (their registry: ``metrics.registry``)."""
        return self.frontend.metrics

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the frontend's metrics: *name* with or without the
        ``headwater_frontend_`` prefix (a counter's with its ``_total``), summed over
        the labels not given (``requests_total`` by ``status`` alone: every endpoint's
        and model's), 0 when absent."""
        if not name.startswith("headwater_frontend_"):
            name = f"headwater_frontend_{name}"
        self.frontend.metrics.render((name,))  # refreshes the gauges that mirror live state
        return sum(
            sample.value
            for family in self.frontend.metrics.registry.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """The loop stalls the frontend's canary saw, as (start, end) in trio time: what
        its stall-aware attribution reads (:mod:`headwater.instrumentation.attribution`)."""
        return self.frontend.monitor.stall_log.intervals()

    @property
    def stall_records(self) -> list[StallRecord]:
        """The stall detector's records (task, stack, cause): only with its watchdog
        thread on, so never under a MockClock."""
        return self.frontend.monitor.records()

    async def settled(self) -> None:
        """Return once every request so far is over on every side
        (:meth:`RequestRecord.settled`)."""
        for record in list(self.requests):
            await record.settled()

    @property
    def workers(self) -> list[str]:
        """The ids of the workers the router knows now."""
        return [view.worker_id for view in self.frontend.router.views()]

    def kill_worker(self, worker_id: str) -> None:
        """Kill a worker now (see :meth:`ObservedCluster.kill`)."""
        self.cluster.kill(worker_id)

    # -- internals -------------------------------------------------------------------

    def _api_key(self) -> str:
        keys = self.frontend.config.api_keys
        return keys[0] if keys else "unused"

    def _auth_headers(self) -> dict[str, str]:
        keys = self.frontend.config.api_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    async def _aclose(self) -> None:
        for client in self._closers:
            await client.aclose()


@asynccontextmanager
async def open_server(
    *,
    script: Rules | str | os.PathLike[str] | None = None,
    token_delay: float | None = None,
    engine_config: MockerConfig | ScriptedConfig | None = None,
    workers: str | Sequence[str] = "disagg",
    tokenizer: str | Tokenizer | None = None,
    listen: bool = False,
    **config: Any,
) -> AsyncIterator[HeadwaterServer]:
    """Run a frontend and its in-process workers in this trio run until the block ends.

    Args:
      script: the scripted engine's answers: rules (a list of
        ``{"prompt_contains": ..., "text": ...}`` and at most one
        ``{"default": true, "text": ...}``, docs/engines.md) or a JSON Lines file of
        them. Without it (nor a ``ScriptedConfig``) the workers run the mocker.
      token_delay: the scripted engine's seconds between tokens (its default if None).
      engine_config: the engine's own config, ``MockerConfig`` or ``ScriptedConfig``
        (with *script*: its ``token_delay`` and ``tokenizer`` are taken).
      workers: ``"disagg"`` (a prefill and a decode worker, the server's default),
        ``"agg"``, or a role per worker: ``["prefill", "decode", "decode"]``.
      tokenizer: the model's tokenizer (a path, or a loaded ``Tokenizer``); the
        DeepSeek-V4 one by default, loaded once per process.
      listen: also serve on a socket, 127.0.0.1 and a free port (``server.url``), with
        hypercorn as ``headwater serve`` does: for clients outside this trio run (a
        subprocess, an asyncio framework in a thread). Those are not on trio's clock.
      config: :class:`~frontend.config.FrontendConfig` fields (``max_inflight``,
        ``api_keys``, ``limits``, ``queue_timeout``, ...).

    Raises ValueError (a bad option, a bad script) before anything starts.
    """
    ours = sorted({"engine", "mode", "discovery"} & set(config))
    if ours:
        raise ValueError(
            f"{', '.join(ours)}: chosen by headwater.testing (the engine by "
            "script= or engine_config=, the layout by workers=)"
        )
    virtual = isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    # The scripted engine reads prompts with the frontend's tokenizer: one model, one.
    tokenizer_path = (
        str(tokenizer.files.tokenizer_json) if isinstance(tokenizer, Tokenizer) else tokenizer
    )
    with tempfile.TemporaryDirectory(prefix="headwater-testing-") as workdir:
        engine, engine_cfg = _engine(script, token_delay, engine_config, workdir, virtual)
        if isinstance(engine_cfg, ScriptedConfig) and tokenizer_path and not engine_cfg.tokenizer:
            engine_cfg = dataclasses.replace(engine_cfg, tokenizer=tokenizer_path)
        settings: dict[str, Any] = {
            "port": 0,  # a free one, if asked to listen
            "tokenizer_threads": 2,
            # The process is the test's: its garbage collector's settings too.
            "gc_gen0_threshold": 0,
            "engine": engine,
            "engine_config": engine_cfg,
        }
        if virtual:  # nothing in threads: see the module docstring
            settings |= {"tokenize_mode": "inline", "instrument": False}
        if isinstance(tokenizer, str):
            settings["tokenizer"] = tokenizer
        frontend_config = FrontendConfig(**(settings | config))
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = _tokenizer(frontend_config.tokenizer, frontend_config.tokenizer_backend)
        roles = roles_of(workers)
        faults = Faults()
        async with trio.open_nursery() as nursery:
            cluster = ObservedCluster(
                roles=roles,
                faults=faults,
                nursery=nursery,
                model=frontend_config.model_name,
                engine=engine,
                engine_config=engine_cfg,
                ack_timeout=frontend_config.ack_timeout,
            )
            faults.kill = cluster.kill
            frontend = Frontend(
                frontend_config, tokenizer=tokenizer, discovery=cluster, admission=FaultyAdmission
            )
            assert isinstance(frontend.admission, FaultyAdmission)
            frontend.admission.faults = faults
            requests: list[RequestRecord] = []
            app = Recorder(await frontend.start(nursery), requests)
            state: dict[str, Any] = {}
            url = None
            lifespan = Lifespan(ASGIWrapper(app), frontend.hypercorn_config(), state)
            if listen:  # serve() runs the app's lifespan itself
                urls = await nursery.start(
                    partial(
                        serve, app, frontend.hypercorn_config(), shutdown_trigger=trio.sleep_forever
                    )
                )
                url = urls[0]
            else:
                await nursery.start(lifespan.handle_lifespan)
                await lifespan.wait_for_startup()
            async with trio.open_nursery() as exchanges:  # the requests' app calls
                server = HeadwaterServer(
                    frontend, app, requests, cluster, faults, exchanges, state, url, virtual
                )
                try:
                    yield server
                finally:
                    with trio.move_on_after(5, shield=True):
                        await server._aclose()
                    exchanges.cancel_scope.cancel()
            if not listen:
                with trio.move_on_after(5):
                    await lifespan.wait_for_shutdown()
            nursery.cancel_scope.cancel()


def _engine(
    script: Rules | str | os.PathLike[str] | None,
    token_delay: float | None,
    config: MockerConfig | ScriptedConfig | None,
    workdir: str,
    virtual: bool,
) -> tuple[str, MockerConfig | ScriptedConfig]:
    """The workers' engine and its config, from :func:`open_server`'s arguments."""
    if script is None and not isinstance(config, ScriptedConfig):
        if token_delay is not None:
            raise ValueError("token_delay is the scripted engine's: give a script")
        return "mocker", config or MockerConfig()
    scripted = config if isinstance(config, ScriptedConfig) else ScriptedConfig()
    if isinstance(script, str | os.PathLike):
        scripted = dataclasses.replace(scripted, script=os.fspath(script))
    elif script is not None:
        scripted = dataclasses.replace(scripted, script=_write_script(script, workdir))
    if token_delay is not None:
        scripted = dataclasses.replace(scripted, token_delay=token_delay)
    if virtual:
        scripted = dataclasses.replace(scripted, threads=False)
    return "scripted", scripted


def _write_script(rules: Rules, workdir: str) -> str:
    """*rules* as a script file in *workdir*, checked first: its errors name the rule."""
    if isinstance(rules, Mapping) or not all(isinstance(r, Mapping) for r in rules):
        raise ValueError("script must be a list of rules (dicts) or a path")
    data = b"\n".join(orjson.dumps(dict(rule)) for rule in rules)
    parse_script(data, "the script given")  # ScriptError (a ValueError) names the line
    path = os.path.join(workdir, "script.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    return path


__all__ = ["BASE_URL", "HeadwaterServer", "open_server"]
