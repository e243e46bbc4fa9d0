"""Assembling and running one frontend: the object that owns every part.

:class:`Frontend` builds the pipeline (tokenizer pool, template, router), the HTTP
app and the loop monitor from a :class:`FrontendConfig`; :meth:`Frontend.run` runs
them all in one nursery — monitor, workers (in-process or discovered), then the
HTTP server — and reports the bound URLs once the server listens.

Shutdown: :meth:`Frontend.stop` (the CLI calls it on SIGINT/SIGTERM) begins a drain.
``/health`` turns 503 at once, new generation requests get 503, and those in flight get
``drain_timeout`` seconds to finish while the listener stays open. Then hypercorn stops
accepting, gives what is left ``graceful_timeout`` seconds, and returns; then everything
else is cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import trio

from frontend.catalog import ModelCatalog, ModelSpec
from frontend.config import FrontendConfig
from frontend.discovery import Discovery, start_discovery
from frontend.http.admission import Admission, AdmissionControl
from frontend.http.app import ADMITTED_PATHS, GENERATION_PATHS, create_app
from frontend.http.auth import ApiKeys, RequireApiKey, exposure_warning, watch_keys_file
from frontend.http.group import GroupRelay
from frontend.http.middleware import CountResponses, MarkActivity, ShieldFinalSend
from frontend.http.observability import add_observability_routes, is_own_view
from frontend.http.observed import Observed
from frontend.http.request_ids import RequestIds
from frontend.http.responses_api.store import ResponseStore
from frontend.http.serving import REFUSAL_REASONS, ServerConfig, serve
from frontend.http.serving.balance import AcceptBalance
from frontend.metrics import FrontendMetrics, KvRoutingCollector
from frontend.pipeline import ParserChoice, Pipeline
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.template import ChatTemplate
from frontend.preprocess.tokenizer import Tokenizer, TokenizerLoadError, find_tokenizer_files
from frontend.router import DispatchConfig, Router, WorkerState
from frontend.router.health import Transition
from frontend.warmup import warm_up
from headwater.gc_tuning import collect_when_idle, tune_gc
from headwater.instrumentation import Activity, LoopMonitor, StallAttribution
from headwater.procmem import trim_heap
from headwater.tracing import TraceCollector, open_tracing

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

log = logging.getLogger(__name__)


def check_vocabulary(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids the model does not have (raises TokenizerLoadError).

    Fewer ids than the model is fine (embedding tables are often padded: DeepSeek-V3's
    tokenizer has 128,815 ids, its model 129,280); more would let the frontend send
    ids the model cannot embed. 0: the model's size is unknown, nothing to check.
    """
    if model_vocab_size and tokenizer.vocab_size > model_vocab_size:
        raise TokenizerLoadError(
            f"the tokenizer at {tokenizer.files.tokenizer_json} has {tokenizer.vocab_size} "
            f"ids but the model's vocabulary is {model_vocab_size}: not this model's "
            "tokenizer (pass --tokenizer with the model's own)"
        )


def parser_choice(config: FrontendConfig, template: ChatTemplate) -> ParserChoice:
    """The parse stage's parsers: those configured, else the model's own (DeepSeek-V4's
    for the built-in template, whose answers are DSML tool calls and ``<think>``
    reasoning), else none: an unknown model's text is passed on as it came."""
    from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate

    own = "deepseek_v4" if isinstance(template, DeepSeekV4ChatTemplate) else "none"
    return ParserChoice(
        tool_call_parser=config.tool_call_parser or own,
        reasoning_parser=config.reasoning_parser or own,
        reasoning_field=config.reasoning_field.value,  # a JSON key: a plain str
    )


class Frontend:
    """One frontend process's parts, wired; see the module docstring."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        tokenizer: Tokenizer | None = None,
        accept_balance: AcceptBalance | None = None,
        discovery: Discovery | None = None,
        admission: type[Admission] = Admission,
    ) -> None:
        """Build every part; *tokenizer* reuses an already loaded one (tests, benchmarks);
        *accept_balance*: this process's share of its group's accepts on the shared
        socket (:mod:`frontend.http.serving.balance`). *discovery* replaces the one the
        config names and *admission* the admission policy's class (both for
        :mod:`headwater.testing`: its in-process cluster, its refusals on demand)."""
        self.config = config
        self.discovery = discovery
        self.accept_balance = accept_balance
        files = tokenizer.files if tokenizer else find_tokenizer_files(config.tokenizer)
        self.tokenizer = tokenizer or Tokenizer(
            files, config.tokenizer_backend, segment_cache_bytes=config.tokenizer_cache_mb << 20
        )
        check_vocabulary(self.tokenizer, config.model_vocab_size)
        self.pool = TokenizerPool(
            self.tokenizer,
            mode=config.tokenize_mode,
            threads=config.tokenizer_threads,
            inline_max_chars=config.inline_max_chars,
        )
        self.template = ChatTemplate.from_tokenizer_config(files.config)
        #: The tokenizer pools and templates of configured models with a tokenizer of
        #: their own, by its path.
        self._pools: dict[str, TokenizerPool] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self.metrics = FrontendMetrics()
        for reason in REFUSAL_REASONS:  # every series from 0
            self.metrics.rejected_requests_total.labels(reason)
        for kind in ("new_request", "ongoing_request"):  # Dynamo's migration kinds
            self.metrics.model_migration_total.labels(kind)
        self.router = Router(
            config.router,
            health=config.health,
            busy=config.busy,
            on_transition=self._count_transition,
            kv=config.kv,
        )
        #: The primary model's pipeline (``--model-name``): the warm-up's, the
        #: dashboard's; the catalog holds it with every other served model's.
        self.pipeline = self._pipeline(config.model_name, self.pool, self.template)
        self.catalog = ModelCatalog(
            self.pipeline,
            self.router,
            configured=tuple(self._configured(spec) for spec in config.served_models),
            # The in-process workers serve the primary model only; other sources may
            # register any model.
            discover=(
                (lambda name: self._pipeline(name, self.pool, self.template))
                if config.workers or config.discovery or discovery is not None
                else None
            ),
        )
        # HTTP requests in flight: the loop monitor rests while there are none.
        self.activity = Activity()
        self.monitor = LoopMonitor(
            self.metrics.registry,
            prefix="headwater_frontend_",
            threshold_s=config.stall_threshold_ms / 1000,
            enabled=config.instrument,
            activity=self.activity,
        )
        #: Excuses the workers for deadlines missed while this loop was stalled.
        self.attribution = StallAttribution(
            self.monitor.stall_log,
            enabled=config.stall_attribution,
            on_excuse=self.metrics.excused_timeouts_total.inc,
        )
        # Generation requests in flight, and whether to take another (--max-inflight, drain).
        self.admission = admission(config.max_inflight, gauge=self.metrics.inflight_requests)
        self.app = create_app(
            self.catalog,
            self.metrics,
            max_body_bytes=config.max_body_bytes,
            admission=self.admission,
            limits=config.limits,
            api_keys=bool(config.api_keys or config.api_keys_file),
            responses_store=ResponseStore(config.responses_store),
        )
        self.observed = Observed(
            config.model_name, self.metrics, self.monitor, self.pool, self.router
        )
        #: One of a group's processes: the shared port's views are the supervisor's.
        self.group = (
            GroupRelay(config.group_url, config.listen_fd)
            if config.group_url and config.listen_fd is not None
            else None
        )
        add_observability_routes(
            self.app, self.observed, debug_endpoints=config.debug_endpoints, group=self.group
        )
        self.metrics.on_collect(self._refresh_gauges)
        self.metrics.registry.register(
            KvRoutingCollector("headwater_frontend_", self.router.kv_statistics)
        )
        #: Set by :meth:`stop`: the drain, then the shutdown, has begun.
        self.shutdown = trio.Event()

    def _pipeline(
        self,
        name: str,
        pool: TokenizerPool,
        template: ChatTemplate,
        spec: ModelSpec | None = None,
    ) -> Pipeline:
        """The pipeline of the model *name*: the configuration's settings, or *spec*'s
        where it sets them (docs/api.md, "Several models")."""
        config = self.config
        parsers = parser_choice(config, template)
        if spec is not None:
            parsers = replace(
                parsers,
                tool_call_parser=spec.tool_call_parser or parsers.tool_call_parser,
                reasoning_parser=spec.reasoning_parser or parsers.reasoning_parser,
            )
        return Pipeline(
            model_name=name,
            context_length=(spec and spec.context_length) or config.context_length,
            pool=pool,
            template=template,
            router=self.router,
            metrics=self.metrics,
            dispatch=DispatchConfig(
                migration_limit=config.migration_limit,
                route_attempts=config.route_attempts,
                queue_timeout=config.queue_timeout,
                queue_size=config.queue_size,
                local_prefill_max_tokens=config.local_prefill_max_tokens,
            ),
            limits=config.limits,
            parsers=parsers,
        )

    def _configured(self, spec: ModelSpec) -> Pipeline:
        """A configured model's pipeline; with a tokenizer of its own, a tokenizer pool
        of its own (one per tokenizer, shared by the models that name it)."""
        if spec.tokenizer is None:
            return self._pipeline(spec.name, self.pool, self.template, spec)
        pool = self._pools.get(spec.tokenizer)
        if pool is None:
            config = self.config
            files = find_tokenizer_files(spec.tokenizer)
            tokenizer = Tokenizer(
                files,
                config.tokenizer_backend,
                segment_cache_bytes=config.tokenizer_cache_mb << 20,
            )
            pool = self._pools[spec.tokenizer] = TokenizerPool(
                tokenizer,
                mode=config.tokenize_mode,
                threads=config.tokenizer_threads,
                inline_max_chars=config.inline_max_chars,
            )
            self._templates[spec.tokenizer] = ChatTemplate.from_tokenizer_config(files.config)
        return self._pipeline(spec.name, pool, self._templates[spec.tokenizer], spec)

    def stop(self) -> None:
        """Begin a graceful stop: drain, then shut down (see the module docstring);
        :meth:`run` returns when it is done. What SIGTERM and SIGINT do. Idempotent;
        returns at once."""
        self.shutdown.set()

    def _count_transition(self, worker_id: str, change: Transition) -> None:
        self.metrics.worker_state_transitions_total.labels(change.old.value, change.new.value).inc()

    def _refresh_gauges(self) -> None:
        admitted = self.admission.statistics()
        self.metrics.max_inflight_requests.set(admitted.max_inflight)
        self.metrics.draining.set(int(admitted.draining))
        stats = self.pool.statistics()
        self.metrics.tokenizer_threads.set(stats.threads)
        self.metrics.tokenizer_threads_busy.set(stats.busy)
        self.metrics.queued_requests.set(stats.waiting)
        self.metrics.worker_state.clear()
        self.metrics.worker_inflight.clear()
        for v in self.router.views():
            for state in WorkerState:  # one 0/1 series per state, as Prometheus prefers
                value = 1 if state is v.state else 0
                self.metrics.worker_state.labels(v.worker_id, v.role.value, state.value).set(value)
            self.metrics.worker_inflight.labels(v.worker_id, v.role.value).set(v.inflight)

    def _count_refusal(self, reason: str) -> None:
        self.metrics.rejected_requests_total.labels(reason).inc()

    def _count_answer(self, status: int) -> None:
        self.metrics.http_responses_total.labels(str(status)).inc()

    def hypercorn_config(self) -> ServerConfig:
        """The HTTP server's config: hypercorn's fields, the fixes' (read sizes at their
        defaults) and the transport limits', from this frontend's; the limits' refusals
        count in ``rejected_requests_total``, the server's own answers (a request it
        cannot parse, the limits' 431 and 408) in ``http_responses_total``."""
        cfg = self.config
        hc = ServerConfig()
        if cfg.listen_fd is None:
            hc.bind = [f"{cfg.host}:{cfg.port}"]
        else:  # one of several processes: the shared socket, then a port of its own,
            # on loopback whatever --host is: only the supervisor and this host use it
            hc.bind = [f"fd://{cfg.listen_fd}", "127.0.0.1:0"]
        hc.certfile, hc.keyfile = cfg.ssl_certfile, cfg.ssl_keyfile  # both bound over TLS
        hc.keep_alive_timeout = cfg.keep_alive_timeout
        hc.graceful_timeout = cfg.graceful_timeout
        hc.write_timeout = cfg.write_timeout
        hc.h11_max_incomplete_size = cfg.max_header_bytes
        hc.http_parser = str(cfg.http_parser)
        hc.header_timeout = cfg.header_timeout
        hc.body_read_timeout = cfg.read_timeout
        hc.max_connections_per_client = cfg.max_connections_per_client
        hc.on_refusal = self._count_refusal
        hc.on_answer = self._count_answer
        hc.accept_balance = self.accept_balance
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        return hc

    async def start(self, nursery: trio.Nursery) -> ASGIFramework:
        """Start every part but the HTTP listener in *nursery* (the tokenizer pool's
        warm-up, the loop monitor, the workers or their discovery, the API keys' file
        watch) and return the app as the listener serves it: the HTTP app behind
        admission, API keys and the middlewares. :meth:`run` serves it with hypercorn;
        :mod:`headwater.testing` calls it in-process, without a socket. Cancelling
        *nursery* stops what this started."""
        cfg = self.config
        # Warm-up first: its one-off initialisation costs (thread creation, the
        # encoder's lazy set-up, each loop-side path's first call) are not stalls
        # of the serving loop (frontend/warmup.py).
        warm = await warm_up(self.pipeline)
        for pool in self._pools.values():  # a configured model's own tokenizer
            await warm_up(next(p for p in self.catalog if p.pool is pool))
        log.info(
            "request path warm (%s, %s mode, %d threads) in %.0f ms",
            self.tokenizer.backend.value,
            self.pool.mode.value,
            self.pool.statistics().threads,
            warm * 1000,
        )
        # The warm-up's encodes leave their buffers in malloc's arenas (one per pool
        # thread): tens of MB per process that nothing uses. Before serving, once.
        trim_heap()
        if cfg.gc_gen0_threshold:
            tune_gc(cfg.gc_gen0_threshold)
            # Rarer collections leave cyclic garbage waiting: collected when idle instead.
            nursery.start_soon(collect_when_idle, self.activity)
        await nursery.start(self.monitor.run)
        await nursery.start(self.catalog.run)  # the choices of requests with n > 1
        await self._start_workers(nursery)
        admitted = AdmissionControl(
            self.app,
            self.admission,
            paths=ADMITTED_PATHS,
            metrics=self.metrics,
            max_body_bytes=cfg.max_body_bytes,
        )
        keys = ApiKeys(cfg.api_keys)
        if cfg.api_keys_file is not None:  # kept in step with the file (rotation)
            await nursery.start(partial(watch_keys_file, keys, cfg.api_keys, cfg.api_keys_file))
        keyed = RequireApiKey(
            admitted,
            keys,
            metrics=self.metrics,
            metrics_open=not cfg.metrics_auth,
            max_body_bytes=cfg.max_body_bytes,
        )
        if (warning := exposure_warning(cfg.host, keys)) is not None:
            log.warning("%s", warning)
        counted = CountResponses(
            keyed, self._count_answer, skip=is_own_view, errors=self.observed.errors
        )
        return RequestIds(
            MarkActivity(ShieldFinalSend(counted, deadline=cfg.write_timeout), self.activity),
            traced_paths=GENERATION_PATHS,
            max_body_bytes=cfg.max_body_bytes,
        )

    async def run(
        self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until :attr:`shutdown` is set; reports the listening URLs."""
        async with self._tracing(), trio.open_nursery() as nursery:
            app = await self.start(nursery)
            async with trio.open_nursery() as http:
                urls: list[str] = await http.start(
                    partial(serve, app, self.hypercorn_config(), shutdown_trigger=self._drain)
                )
                models = ", ".join(self.catalog.names())
                log.info("headwater serving %s on %s", models, ", ".join(urls))
                task_status.started(urls)
            # serve() returned: the drain ended and what was left had its
            # graceful_timeout. Now stop the workers and the monitor.
            nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def _tracing(self) -> AsyncIterator[None]:
        """Tracing on for the block when ``otlp_endpoint`` is set (its counters in
        /metrics), else nothing."""
        if not self.config.otlp_endpoint:
            yield
            return
        async with open_tracing(
            self.config.otlp_endpoint,
            "headwater-frontend",
            attributes={"headwater.model": self.config.model_name},
            sample_ratio=self.config.otlp_sample_ratio,
        ) as statistics:
            collector = TraceCollector("headwater_frontend_", statistics)
            self.metrics.registry.register(collector)
            try:
                yield
            finally:
                self.metrics.registry.unregister(collector)

    async def _drain(self) -> None:
        """The HTTP server's shutdown trigger: once :meth:`stop` is called, refuse new
        generation requests (503) and turn ``/health`` 503 while those in flight finish,
        for up to ``drain_timeout`` seconds. The server keeps accepting meanwhile; when
        this returns it stops, and ``graceful_timeout`` applies to what is left."""
        await self.shutdown.wait()
        self.admission.drain()
        timeout = self.config.drain_timeout
        log.info(
            "draining: %d requests in flight get up to %g s",
            self.admission.statistics().inflight,
            timeout,
        )
        with trio.move_on_after(timeout):
            await self.admission.wait_idle()
        left = self.admission.statistics().inflight
        if left:
            log.warning(
                "drain timed out with %d requests in flight; they get %g s more",
                left,
                self.config.graceful_timeout,
            )
        else:
            log.info("drained: no request in flight")

    async def _start_workers(self, nursery: trio.Nursery) -> None:
        """The workers this frontend routes to, from whichever source the config names
        (in-process by default, ``--workers``, or etcd), all through one membership."""
        await nursery.start(self.router.run)  # the probes of inhibited workers
        await start_discovery(
            nursery,
            self.config,
            self.router,
            attribution=self.attribution,
            discovery=self.discovery,
        )
