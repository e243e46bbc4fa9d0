"""The frontend's one configuration object, with every default documented in place.

``headwater serve --help`` is generated from the same fields (see :mod:`headwater.cli.serve`),
and ``HEADWATER_*`` environment variables mirror each option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.catalog import ModelSpec
from frontend.http.responses_api.store import StoreConfig
from frontend.limits import RequestLimits
from frontend.postprocess.parsers import check_names
from headwater.etcd.client import EtcdCredentials
from headwater.gc_tuning import GEN0_THRESHOLD
from headwater.machine import usable_cpus
from headwater.plane.tls import TlsConfig, tls_config
from workers.engines import registry


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    # -- HTTP ---------------------------------------------------------------------
    host: str = "127.0.0.1"  # loopback by default: exposing the API is a deliberate choice
    port: int = 8000
    max_body_bytes: int = 64 * 1024 * 1024  # 413 above this
    keep_alive_timeout: float = 5.0  # seconds an idle HTTP/1.1 connection stays open
    write_timeout: float = 30.0  # seconds a client may stall reading before we drop it
    # TLS on the listener (hypercorn's certfile/keyfile, PEM): both or neither; the URLs are
    # then https://. Behind a TLS-terminating proxy, leave both unset (docs/security.md).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # -- transport limits on slow and greedy clients (frontend/http/serving/limits.py;
    # each refusal counts in rejected_requests_total{reason}) --
    # Bytes of a request head (request line and header fields); a larger one gets 431.
    # 16 KiB is h11's and hypercorn's default and Node's limit; a chat request's head is
    # ~0.5 KiB, an API key adds ~60 bytes.
    max_header_bytes: int = 16 * 1024
    # Seconds a request head may take from its first byte (and a TLS handshake from the
    # connection's accept); then 408 and close. A real client sends its head at once.
    header_timeout: float = 10.0
    # Seconds a request body may go without a byte while the server waits for it; then
    # the connection closes. Never while a response streams (the client is silent then).
    read_timeout: float = 30.0
    # Connections open at once per client IP address, loopback included; one more is
    # closed at once. Behind a proxy every connection is the proxy's: raise it, or 0.
    max_connections_per_client: int = 256
    # Generation requests (chat, completions) in flight at once, each from its head's
    # arrival to its response's last byte; one more gets 429 with Retry-After before its
    # body is read (frontend.http.admission). 0: no limit. 1024 is 16x the benchmarks'
    # highest concurrency (64), so they never meet it, and it caps what a flood of
    # clients can make one process hold (docs/architecture.md, "Admission and drain").
    max_inflight: int = 1024
    # On SIGTERM or SIGINT: seconds in-flight requests get to finish while /health says
    # 503 "draining", new generation requests get 503 and the listener stays open (a load
    # balancer sees the 503s, not refused connections). 30 s, as a worker's drain. 0: none.
    drain_timeout: float = 30.0
    # Seconds what is still in flight after the drain gets once the listener has closed;
    # then it is cancelled. A stop takes at most drain_timeout + graceful_timeout.
    graceful_timeout: float = 10.0
    # API keys (frontend/http/auth.py): empty serves anyone who reaches the port, which
    # is why the host defaults to loopback. /live and /health never need one.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # A file of more keys, one per line, re-read when it changes (rotation without a
    # restart; frontend/http/auth.py). Its keys join api_keys.
    api_keys_file: str | None = None
    metrics_auth: bool = False  # /metrics needs a key too (else it stays open)
    # Frontend processes sharing the port, each a whole frontend with its own event loop
    # (headwater.cluster.frontend_group): one loop is one core's worth of HTTP, template,
    # routing and streaming, so the default is one per usable core (`--processes auto`).
    # 1: this process serves; N > 1: it supervises N children forked from one preloaded
    # zygote, which share the tokenizer's memory.
    processes: int = field(default_factory=usable_cpus)
    # Serve on this inherited listening socket instead of binding host:port, plus a
    # private host:0 listener for this process's own /metrics. Set by the supervisor.
    listen_fd: int | None = None
    # Where this process's shared-port /metrics and /dashboard/data come from: the
    # supervisor's view of the whole group (http://127.0.0.1:PORT). Set by the supervisor;
    # the private listener keeps answering for this process alone.
    group_url: str | None = None
    # What one request may ask: max_tokens, messages, prompt characters, stop strings,
    # and its deadline (--request-timeout); each default and its reason in
    # frontend/limits.py, all of them in docs/security.md ("Request limits").
    limits: RequestLimits = field(default_factory=RequestLimits)
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}):
    # per process, bounded, oldest evicted first (frontend/http/responses_api/store.py).
    responses_store: StoreConfig = field(default_factory=StoreConfig)

    # -- model and preprocessing ----------------------------------------------------
    model_name: str = "deepseek-v4"
    # More models served beside it, each with a pipeline of its own (its tokenizer,
    # context length, parsers: the settings below where it sets none), listed in
    # /v1/models whether a worker serves it or not. A model a worker registers that is
    # not configured is served too, while it has workers (frontend/catalog.py).
    served_models: tuple[ModelSpec, ...] = ()
    tokenizer: str | None = None  # tokenizer.json or a directory; None: the DeepSeek-V4 one
    # The served model's vocabulary size (its config.json's); 0: unknown. When known,
    # a tokenizer with more ids than the model has is refused at start: it would
    # produce ids the model cannot embed (a vLLM without a tokenizer dies on one).
    model_vocab_size: int = 0
    context_length: int = 131072  # prompt + completion tokens
    tokenizer_backend: str = "fastokens"  # "fastokens" | "hf"
    # "thread" | "inline" | "thread-gil"; inline: virtual-time tests and repro, thread-gil: repro
    tokenize_mode: str = "thread"
    tokenizer_threads: int = field(default_factory=usable_cpus)
    # MiB for fastokens' cache of the text segments between added tokens (a repeated
    # system prompt is encoded once; same ids either way). 0: off. fastokens keeps no
    # segment over 1/64 of it: 64 MiB caches up to ~1 MiB, a ~100k-token prompt.
    # (frontend.preprocess.tokenizer.SEGMENT_CACHE_BYTES, not imported: it loads HF.)
    tokenizer_cache_mb: int = 64
    # Prompts up to this many characters encode on the loop, where that is cheaper than
    # the thread hop; None picks the backend's measured default (docs/tokenization.md).
    inline_max_chars: int | None = None
    # The parse stage (frontend/postprocess/parsers; docs/api.md, "Parsers"), by vLLM's
    # names: tool calls (deepseek_v4, deepseek_v32, deepseek_v31, hermes, none) and
    # reasoning (deepseek_v4, deepseek_r1, none) out of a chat answer's text. None: the
    # model's own, deepseek_v4 for the built-in DeepSeek-V4 template, else none.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The message field reasoning goes in: "reasoning_content" (DeepSeek's and vLLM's
    # name) or "reasoning" (what some clients read).
    reasoning_field: str = "reasoning_content"

    # -- workers and routing ----------------------------------------------------------
    engine: str = "mocker"  # engine of the in-process workers (workers.engines.registry)
    # That engine's own config (its dataclass: MockerConfig for the mocker); None: its
    # defaults. `headwater serve` fills it from the engine's options (--speedup-ratio).
    engine_config: Any = None
    mode: str = "disagg"  # "disagg": in-process prefill + decode pair; "agg": one worker
    workers: str | None = None  # static remote workers: "tcp://host:port?role=...,..."
    discovery: str | None = None  # "etcd://127.0.0.1:2379": find workers there
    router: str = "round-robin"  # "round-robin" | "random" | "least-loaded" | "p2c" | "kv"
    # --router kv (frontend/router/kv_routing.py; docs/routing.md): the engines' block
    # size (tokens), the weight of uncached prefill blocks against blocks in flight, the
    # softmax temperature (0: lowest cost), the workers' KV events or approximate mode,
    # and how long approximate mode remembers a routed prefix (seconds).
    kv_block_size: int = 64
    kv_prefill_load_scale: float = 1.0
    kv_temperature: float = 0.0
    kv_events: str = "on"  # "on" | "off"
    kv_approx_ttl: float = 120.0
    ack_timeout: float = 5.0  # seconds a worker has to ACK a request (as Dynamo)
    # Mutual TLS to remote workers (headwater/plane/tls.py): this frontend's certificate
    # and key, and the CA the workers' certificates must chain to (their advertised
    # hosts are checked). All three or none; none: plain TCP. In-process workers: unused.
    plane_tls_certfile: str | None = None
    plane_tls_keyfile: str | None = None
    plane_tls_ca_file: str | None = None
    # etcd's credentials for --discovery (headwater/etcd/client.py); None: etcd is open.
    etcd_credentials: EtcdCredentials | None = field(default=None, repr=False)
    migration_limit: int = 3  # times a broken stream may move to another worker
    route_attempts: int = 3  # workers tried when one cannot be reached
    # Conditional disaggregation: a prompt with at most this many uncached tokens runs
    # whole on a decode worker, no prefill leg (docs/routing.md); 0: always disaggregate.
    local_prefill_max_tokens: int = 0

    # -- worker health (frontend/router/health.py; docs/fault-tolerance.md) ---------------
    inhibit_after: int = 2  # consecutive faults that take a worker out of routing
    probe_backoff: float = 1.0  # seconds before the first probe; doubles per failed probe
    probe_backoff_max: float = 30.0  # upper bound of that delay
    recover_after: int = 2  # probes in a row answered before the worker is healthy again
    # A missed ACK or heartbeat while this frontend's own loop was stalled is not blamed
    # on the worker (headwater/instrumentation/attribution.py); off only to reproduce.
    stall_attribution: bool = True
    busy_kv_usage: float = 0.95  # a worker with this share of its KV cache in use is busy
    busy_waiting: int = 64  # a worker with this many requests waiting is busy
    # Seconds a request waits for a worker that is not busy when all are, then 503
    # "all workers are busy"; and how many may wait so at once.
    queue_timeout: float = 10.0
    queue_size: int = 1024

    # -- observability -----------------------------------------------------------------
    instrument: bool = True  # stall detector (trio instrument + watchdog thread)
    # Allocations between two young-generation collections of the cyclic GC (Python's
    # default: 700). Every young collection walks every young container, and a request's
    # token-id lists are containers of 40k items: at 700 the collector ran many times per
    # long request, on the loop. 0 keeps Python's default (headwater/gc_tuning.py).
    gc_gen0_threshold: int = GEN0_THRESHOLD
    stall_threshold_ms: float = 20.0  # loop delay above this is a stall
    # POST /debug/stall?ms=N blocks the event loop on purpose (to test the stall
    # detector and the dashboard); off in production, where that route is a 404.
    debug_endpoints: bool = False
    log_level: str = "info"
    log_format: str = "text"  # "text" or "json" (headwater/logs.py)
    # OTLP/HTTP collector to send traces to (``http://host:4318``); "" = tracing off.
    otlp_endpoint: str = ""
    # The share of requests traced when the client's traceparent does not decide (a
    # traced request costs ~2-3 ms of CPU: docs/observability.md, "What tracing costs").
    otlp_sample_ratio: float = 1.0

    @property
    def plane_tls(self) -> TlsConfig | None:
        """The request plane's TLS to remote workers, or None."""
        return tls_config(self.plane_tls_certfile, self.plane_tls_keyfile, self.plane_tls_ca_file)

    @property
    def scheme(self) -> str:
        """``https`` with TLS on the listener, else ``http``."""
        return "https" if self.ssl_certfile else "http"

    @property
    def stop_timeout(self) -> float:
        """The longest a graceful stop of this frontend takes (seconds): the drain, then
        the graceful timeout for what is left. A supervisor waits this long, and a margin,
        before it kills the process."""
        return self.drain_timeout + self.graceful_timeout

    def __post_init__(self) -> None:
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0 (0: no limit), got {self.max_inflight}")
        if self.tokenizer_cache_mb < 0:
            raise ValueError(f"tokenizer_cache_mb must be >= 0, got {self.tokenizer_cache_mb}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if not (self.header_timeout > 0 and self.read_timeout > 0):
            raise ValueError("header_timeout and read_timeout must be positive")
        tls_config(self.plane_tls_certfile, self.plane_tls_keyfile, self.plane_tls_ca_file)
        if self.max_connections_per_client < 0:
            raise ValueError(
                "max_connections_per_client must be >= 0 (0: no limit), got "
                f"{self.max_connections_per_client}"
            )
        if self.reasoning_field not in ("reasoning_content", "reasoning"):
            raise ValueError(
                "reasoning_field must be 'reasoning_content' or 'reasoning', "
                f"got {self.reasoning_field!r}"
            )
        # ValueError naming the known parsers for an unknown one.
        check_names(self.tool_call_parser or "none", self.reasoning_parser or "none")
        cls = registry.config_type(self.engine)  # ValueError for an unknown engine
        if self.engine_config is None:
            object.__setattr__(self, "engine_config", cls())
        elif not isinstance(self.engine_config, cls):
            raise ValueError(f"engine {self.engine!r} takes a {cls.__name__} config")
