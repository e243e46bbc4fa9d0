"""The frontend's Prometheus metrics, named after Dynamo's so dashboards carry over.

Prefix ``headwater_frontend_``; suffixes as in Dynamo's ``dynamo_frontend_*``. One
:class:`prometheus_client.CollectorRegistry` per frontend (not the global one), so
tests and several in-process frontends never collide. The loop metrics
(``event_loop_*``) are registered on the same registry by the stall detector.

TTFT and ITL also feed a :class:`RecentWindow` (through :class:`WindowedHistogram`),
so the dashboard can show percentiles of the last minute without a Prometheus server.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from headwater.instrumentation.exposition import TextExposition

PREFIX = "headwater_frontend_"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 32768, 65536, 131072, 262144)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_STAGE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Percentiles of a :class:`RecentWindow`'s observations; ``None`` when it is empty."""

    window_s: float
    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


class RecentWindow:
    """The latest observations of one quantity: at most *max_samples*, none older
    than *window_s* seconds (of *clock*).

    Why: a histogram's percentiles need a Prometheus server and PromQL; the dashboard
    wants them from the process itself. Feeding is a deque append (the ITL is observed
    once per streamed chunk); :meth:`statistics` sorts a copy, on read only. Not
    thread-safe: feed and read it on the event loop.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        max_samples: int = 4096,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, value)

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def values(self) -> list[float]:
        """The observations still inside the window, oldest first."""
        oldest = self._clock() - self.window_s
        samples = self._samples
        while samples and samples[0][0] < oldest:
            samples.popleft()
        return [value for _, value in samples]

    def statistics(self) -> WindowStats:
        """Nearest-rank p50 / p90 / p99 and the max of :meth:`values`."""
        ordered = sorted(self.values())
        n = len(ordered)

        def rank(q: float) -> float | None:
            return ordered[max(0, math.ceil(q * n) - 1)] if n else None

        return WindowStats(
            self.window_s, n, rank(0.50), rank(0.90), rank(0.99), ordered[-1] if n else None
        )


class WindowedHistogram:
    """A Prometheus :class:`Histogram` that also feeds a :class:`RecentWindow`.

    Stands where the histogram stood: callers keep calling ``observe(value)``.
    """

    __slots__ = ("histogram", "window")

    def __init__(self, histogram: Histogram, window: RecentWindow | None = None) -> None:
        self.histogram = histogram
        self.window = window if window is not None else RecentWindow()

    def observe(self, value: float) -> None:
        self.histogram.observe(value)
        self.window.add(value)


class FrontendMetrics:
    """All request-level metrics of one frontend."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests_total = Counter(
            f"{p}requests",
            "Requests finished, by endpoint, request type, status and model (a served "
            "model's name; empty for a request refused before its model was known)",
            ["endpoint", "request_type", "status", "model"],
            registry=r,
        )
        self.http_responses_total = Counter(
            f"{p}http_responses",
            "HTTP answers by status code, on every path but the server's own views "
            "(/metrics, /health, /live, /dashboard, /debug)",
            ["code"],
            registry=r,
        )
        self.inflight_requests = Gauge(
            f"{p}inflight_requests",
            "Generation requests admitted and not yet answered (what --max-inflight limits)",
            registry=r,
        )
        self.queued_requests = Gauge(
            f"{p}queued_requests", "Requests waiting for a tokenizer thread", registry=r
        )
        self.request_duration_seconds = Histogram(
            f"{p}request_duration_seconds",
            "End-to-end request time, by model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token_seconds = WindowedHistogram(
            Histogram(
                f"{p}time_to_first_token_seconds",
                "Time from request to the first token",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.inter_token_latency_seconds = WindowedHistogram(
            Histogram(
                f"{p}inter_token_latency_seconds",
                "Time between streamed tokens",
                buckets=_ITL_BUCKETS,
                registry=r,
            )
        )
        self.input_sequence_tokens = Histogram(
            f"{p}input_sequence_tokens",
            "Prompt length in tokens, by model",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_sequence_tokens = Histogram(
            f"{p}output_sequence_tokens",
            "Completion length in tokens, by model",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            f"{p}tokenize_seconds",
            "Time to tokenize a prompt (preprocess stage)",
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.template_seconds = Histogram(
            f"{p}template_seconds",
            "Time to render a chat template (preprocess stage)",
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.disconnected_clients = Counter(
            f"{p}disconnected_clients",
            "Clients that went away before their response ended",
            registry=r,
        )
        self.model_migration_total = Counter(
            f"{p}model_migration",
            "Requests moved to other workers after a worker failed them, before any token "
            "reached the client (new_request) or during the stream (ongoing_request)",
            ["migration_type"],
            registry=r,
        )
        self.excused_timeouts_total = Counter(
            f"{p}excused_timeouts",
            "Missed ACKs and heartbeats not blamed on the worker: this frontend's loop "
            "was stalled while it waited",
            registry=r,
        )
        self.worker_state_transitions_total = Counter(
            f"{p}worker_state_transitions",
            "Changes of a worker's routing state",
            ["from", "to"],
            registry=r,
        )
        self.model_cancellation_total = Counter(
            f"{p}model_cancellation", "Requests cancelled on the worker", registry=r
        )
        self.tokenizer_threads_busy = Gauge(
            f"{p}tokenizer_threads_busy", "Tokenizer pool threads encoding now", registry=r
        )
        self.tokenizer_threads = Gauge(f"{p}tokenizer_threads", "Tokenizer pool size", registry=r)
        self.worker_state = Gauge(
            f"{p}worker_state",
            "1 for the state each worker is in, 0 for the others",
            ["worker_id", "role", "state"],
            registry=r,
        )
        self.worker_inflight = Gauge(
            f"{p}worker_inflight_requests",
            "In-flight requests per worker",
            ["worker_id", "role"],
            registry=r,
        )
        # Admission (frontend.http.admission): the reasons are the labels of the one
        # counter, so another limit counts its refusals here under a reason of its own.
        self.rejected_requests_total = Counter(
            f"{p}rejected_requests",
            "Requests and connections turned away before any work, by reason",
            ["reason"],
            registry=r,
        )
        self.max_inflight_requests = Gauge(
            f"{p}max_inflight_requests", "The limit on admitted requests (0: none)", registry=r
        )
        self.draining = Gauge(
            f"{p}draining", "1 while this frontend drains for shutdown, else 0", registry=r
        )
        self._collect_hooks: list[Callable[[], None]] = []
        self._exposition = TextExposition(self.registry)

    def on_collect(self, hook: Callable[[], None]) -> None:
        """Run *hook* before each scrape (gauges that mirror live objects' statistics())."""
        self._collect_hooks.append(hook)

    def render(self, names: Collection[str] | None = None) -> bytes:
        """The text exposition format, with gauges refreshed first; *names* keeps only
        the samples of those names (``/metrics?name[]=...``). On the loop: see
        :mod:`headwater.instrumentation.exposition` for why not ``generate_latest``."""
        for hook in self._collect_hooks:
            hook()
        return self._exposition.render(names)


class KvRoutingCounts(Protocol):
    """What :class:`KvRoutingCollector` reads (``frontend.router.KvStats``)."""

    @property
    def routed(self) -> int: ...
    @property
    def overlap_blocks(self) -> int: ...
    @property
    def prompt_blocks(self) -> int: ...
    @property
    def prefill_tokens_saved(self) -> int: ...
    @property
    def events(self) -> int: ...
    @property
    def dumps(self) -> int: ...
    @property
    def gaps(self) -> int: ...


class KvRoutingCollector(Collector):
    """``--router kv``'s counters, read from the router at each scrape (the router
    counts in plain ints on the loop; nothing is written twice):
    ``<prefix>kv_routed_requests_total`` (requests routed by cached overlap),
    ``kv_overlap_blocks_total`` (their leading blocks found cached on the chosen worker;
    over routed requests: the mean overlap), ``kv_prompt_blocks_total`` (their prompts'
    blocks: overlap blocks over these is the hit rate), ``kv_prefill_tokens_saved_total``,
    ``kv_events_total`` (KV events received from the workers), ``kv_dumps_total``
    (full dumps asked for), ``kv_event_gaps_total`` (gaps in a worker's numbering).
    All zero under the other policies (docs/routing.md)."""

    FAMILIES = (
        ("kv_routed_requests", "Requests routed by their prefix's cached overlap", "routed"),
        ("kv_overlap_blocks", "Prompt blocks found cached on the chosen worker", "overlap_blocks"),
        ("kv_prompt_blocks", "Prompt blocks of the requests routed by cache", "prompt_blocks"),
        (
            "kv_prefill_tokens_saved",
            "Prompt tokens the chosen worker had cached",
            "prefill_tokens_saved",
        ),
        ("kv_events", "KV events received from the workers", "events"),
        ("kv_dumps", "Full dumps of a worker's cache asked for", "dumps"),
        ("kv_event_gaps", "Gaps seen in a worker's KV event numbers", "gaps"),
    )

    def __init__(self, prefix: str, counts: Callable[[], KvRoutingCounts]) -> None:
        self.prefix = prefix
        self.counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        counts = self.counts()
        for name, doc, field in self.FAMILIES:
            family = CounterMetricFamily(f"{self.prefix}{name}", doc)
            family.add_metric([], getattr(counts, field))
            yield family
