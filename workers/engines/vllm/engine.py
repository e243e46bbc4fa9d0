"""The vLLM engine's trio shell: GenerateRequests to vLLM, and its answers back as chunks.

:class:`VllmEngine` is what a worker hosts. :meth:`VllmEngine.run` owns the way to
vLLM (a :mod:`.backend`: vLLM's engine in-process, or its API server, started and
supervised or attached) and a poller of vLLM's metrics whose last answer
:meth:`~VllmEngine.statistics` returns. It reports readiness only once vLLM serves, so
the worker registers and ACKs nothing before.

Per request (:meth:`VllmEngine.generate`), by role:

* ``agg``, or ``decode`` without a handle: one streamed request, a
  :class:`~headwater.wire.Chunk` per token event (with its logprobs when asked), the
  finish reason and the cached prompt tokens on the last. Prompt logprobs come on the
  first chunk: with the stream's first event in-process; through the API server, whose
  stream does not carry them, from a unary request of one token before it.
* ``prefill``: one unary request with ``max_tokens`` 1 and ``kv_transfer_params:
  {"do_remote_decode": true}``; vLLM's answer (its ``kv_transfer_params``) becomes the
  :class:`~headwater.wire.KvHandle`'s opaque ``params``, with the first token in the
  chunk. vLLM holds the KV for a decode server to pull over NIXL.
* ``decode`` with a handle: the stream above, with the handle's ``params`` handed to
  vLLM unchanged; vLLM pulls the KV over NIXL before its first token.

Errors, as :class:`~workers.engines.base.EngineError` codes: ids at or above the
vocabulary, an empty prompt, bad lengths: ``invalid_request``, checked here before
vLLM sees them (one id past the vocabulary kills a vLLM started without a tokenizer);
vLLM's 400: ``invalid_request``; a decode leg whose transfer failed (vLLM's error, or
no first token within ``kv_pull_timeout``): ``kv_transfer_failed``, so the frontend
prefills again; vLLM unreachable, dead or restarting: ``shutting_down`` (retryable:
another worker takes the request, or it migrates with what it generated). Closing the
generator closes the backend's stream, and vLLM aborts the request at once.

A started vLLM that dies fails every request in flight, is started again up to
``vllm_restarts`` times (the worker refuses requests meanwhile), then
:meth:`~VllmEngine.run` raises :class:`~workers.engines.base.EngineFailed` and the
worker exits.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Iterable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field, replace

import httpx
import orjson
import trio
from prometheus_client.core import Metric

from headwater.wire import (
    Chunk,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Role,
    StructuredKind,
    StructuredOutput,
    TokenLogprobs,
)
from headwater.wire.capabilities import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    LOGPROBS,
    MIN_P,
    PRESENCE_PENALTY,
    PROMPT_LOGPROBS,
    REPETITION_PENALTY,
    SEED,
    STRUCTURED_OUTPUTS,
    TOP_K,
    Capabilities,
)
from headwater.wire.kv_events import KvEventLog
from workers.engines.base import Engine, EngineContext, EngineError, EngineFailed, EngineStats
from workers.engines.vllm.api_server import ApiServerBackend
from workers.engines.vllm.backend import VllmBackend, VllmUnreachable
from workers.engines.vllm.config import NO_VOCABULARY, VllmClient, VllmConfig
from workers.engines.vllm.in_process import InProcessBackend
from workers.engines.vllm.kv_events import VllmKvEvents, subscribe
from workers.engines.vllm.protocol import (
    FINISH_REASONS,
    ProtocolError,
    StreamEvent,
    VllmCall,
    VllmMetrics,
    VllmRequestError,
)
from workers.engines.vllm.server import VllmStartError

log = logging.getLogger(__name__)

#: What a prefill server is asked to do with a prompt's KV (vLLM's NixlConnector).
REMOTE_DECODE = {"do_remote_decode": True}


@dataclass(slots=True)
class VllmCounters:
    """Counts a vLLM worker exports (its ``engine_*`` stats and metrics)."""

    requests_started: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    #: Refused before reaching vLLM (an id at or above the vocabulary, bad lengths).
    requests_refused: int = 0
    vllm_up: int = 0
    vllm_starts: int = 0
    vllm_deaths: int = 0
    metrics_poll_failures: int = 0
    #: From vLLM's /metrics: where its prompt tokens came from, and NIXL transfers.
    prompt_tokens_computed: float = 0.0
    prompt_tokens_cached: float = 0.0
    prompt_tokens_transferred: float = 0.0
    nixl_transfers: float = 0.0
    nixl_transfer_seconds: float = 0.0


@dataclass(slots=True)
class _Watch:
    """The cancel scopes of requests waiting on vLLM, cancelled when it goes down."""

    scopes: set[trio.CancelScope] = field(default_factory=set)

    def cancel_all(self) -> None:
        for scope in self.scopes:
            scope.cancel()


class VllmEngine(Engine):
    """A worker's engine backed by vLLM; see the module docstring.

    Start it with ``await nursery.start(engine.run)``; requests before that, or while
    vLLM is down, fail with ``shutting_down``. *vocab_size* overrides the config's;
    *transport* replaces httpx's and so chooses the API server's way (tests play
    vLLM's API server with an ``httpx.MockTransport``).
    """

    def __init__(
        self,
        config: VllmConfig,
        role: Role | str,
        worker_id: str,
        *,
        transfer_address: str = "",
        vocab_size: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        otlp_endpoint: str = "",
        beside_frontend: bool = False,
    ) -> None:
        if not config.model and not config.vllm_url:
            raise ValueError("the vllm engine needs --model PATH or --vllm-url URL")
        self.config = config
        self.role = Role(role)
        self.worker_id = worker_id
        self.transfer_address = transfer_address or f"memory://{worker_id}"
        vocab = vocab_size if vocab_size is not None else config.model_vocab_size()
        if vocab is None:
            raise ValueError(NO_VOCABULARY)
        self.vocab_size = vocab
        #: Set from vLLM's /v1/models once it is up (prompt + completion tokens).
        self.max_model_len = config.max_model_len
        self.served_model = ""
        features = set(SAMPLING_FEATURES)
        if config.tokenizer_path() is not None:
            features.add(STRUCTURED_OUTPUTS)
        self._capabilities = Capabilities("vllm", frozenset(features))
        self.counters = VllmCounters()
        self.backend: VllmBackend = _backend(
            config,
            self.role,
            worker_id,
            transport=transport,
            otlp_endpoint=otlp_endpoint,
            beside_frontend=beside_frontend,
        )
        #: vLLM's KV cache events, republished (:mod:`.kv_events`); None when vLLM
        #: publishes none here (attached, or --no-vllm-kv-events): approximate routing.
        self._kv: VllmKvEvents | None = None
        if config.vllm_kv_events and not config.attached:
            self.kv_events = KvEventLog()
            self._kv = VllmKvEvents(self.kv_events)
        self.metrics = VllmMetrics()
        self._up = False
        self._up_event = trio.Event()
        self._watch = _Watch()
        self._inflight = 0
        self._started = False

    # ---- Engine API -------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """Every sampling feature maps to vLLM's own (:func:`.protocol.sampling_params`);
        structured outputs only when the model directory holds a tokenizer, which vLLM
        builds their grammars over: a started server then loads it, and an attached one
        is taken to have been started with it (if not, its own refusal reaches the
        client as a 400)."""
        return self._capabilities

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start (or attach to) vLLM, report readiness once it is healthy, then keep it
        so until cancelled: poll its metrics, restart it when it dies. Stops a started
        server on the way out. Raises EngineFailed when vLLM cannot be started, or died
        more than ``vllm_restarts`` times."""
        if self._started:
            raise RuntimeError("VllmEngine.run() may only be called once")
        self._started = True
        backend = self.backend
        async with backend.open():
            try:
                async with trio.open_nursery() as nursery:
                    if self._kv is not None:  # listening before vLLM publishes
                        backend.events_endpoint = await nursery.start(subscribe, self._kv)
                    await self._start()
                    nursery.start_soon(self._poll_metrics)
                    task_status.started()
                    await self._supervise()
            finally:
                self._set_down("stopped")
                with trio.move_on_after(30, shield=True):
                    await backend.stop()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        """Serve *request* on vLLM; see the module docstring for the mapping.

        Raises EngineError: ``invalid_request``, ``kv_transfer_failed`` (decode leg),
        ``shutting_down`` (vLLM down), ``internal`` (vLLM failed it otherwise).
        """
        self._check(request)
        if not self._up:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id}: vLLM is not up")
        self.counters.requests_started += 1
        self._inflight += 1
        outcome = "cancelled"
        try:
            if self.role is Role.PREFILL:
                yield await self._prefill(request)
            else:
                async for chunk in self._stream(request):
                    if chunk.finish_reason is not None:
                        outcome = "finished"
                    yield chunk
            outcome = "finished"
        except EngineError:
            outcome = "failed"
            raise
        finally:
            self._inflight -= 1
            if outcome == "finished":
                self.counters.requests_finished += 1
            elif outcome == "failed":
                self.counters.requests_failed += 1
            else:
                self.counters.requests_cancelled += 1

    def statistics(self) -> EngineStats:
        """vLLM's load from its last ``/metrics`` answer (at most ``metrics_interval``
        old): running, waiting (or the requests sent that it does not run yet, if
        more), KV blocks in use."""
        m = self.metrics
        total = m.kv_blocks_total or 100
        return EngineStats(
            active_requests=m.running,
            waiting_requests=max(m.waiting, self._inflight - m.running),
            kv_blocks_used=round(m.kv_usage * total),
            kv_blocks_total=total,
        )

    def metric_families(self) -> Iterable[Metric]:
        """vLLM's own series when it runs in this process (:mod:`.in_process`)."""
        return self.backend.metric_families()

    @property
    def up(self) -> bool:
        """vLLM is healthy and taking requests."""
        return self._up

    # ---- requests -----------------------------------------------------------------

    def _check(self, request: GenerateRequest) -> None:
        """Refuse what vLLM must not see. An id at or above the vocabulary kills a
        vLLM started without a tokenizer (it does not range-check); negative ids and
        lengths are refused here too, so vLLM's errors stay vLLM's."""
        ids = request.token_ids
        s = request.sampling
        problem = None
        if not ids:
            problem = "empty prompt"
        elif max(ids) >= self.vocab_size or min(ids) < 0:
            problem = f"prompt token ids must be in [0, {self.vocab_size})"
        elif any(not 0 <= t < self.vocab_size for t in s.stop_token_ids):
            problem = f"stop token ids must be in [0, {self.vocab_size})"
        elif any(not 0 <= t < self.vocab_size for t, _ in s.logit_bias):
            problem = f"logit_bias token ids must be in [0, {self.vocab_size})"
        elif s.structured is not None and not _readable(s.structured):
            problem = f"structured output spec is not valid {s.structured.kind.value}"
        elif len(ids) >= self.max_model_len:
            problem = (
                f"prompt of {len(ids)} tokens leaves no room in vLLM's context of "
                f"{self.max_model_len} tokens"
            )
        elif s.max_tokens < 1:
            problem = f"max_tokens must be >= 1, got {s.max_tokens}"
        elif not 0 <= s.min_tokens <= s.max_tokens:
            problem = f"min_tokens must be in [0, max_tokens], got {s.min_tokens}"
        elif request.kv_handle is not None and self.role is Role.PREFILL:
            problem = "a prefill engine cannot take a kv_handle"
        if problem is not None:
            self.counters.requests_refused += 1
            raise EngineError(ErrorCode.INVALID_REQUEST, problem)

    async def _prefill(self, request: GenerateRequest) -> Chunk:
        call = VllmCall(request, stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
        with self._vllm_errors(kv=False):
            answer = await self._answer(call)
        if answer.kv_transfer_params is None:
            raise EngineError(
                ErrorCode.INTERNAL,
                f"{self.worker_id}: vLLM returned no kv_transfer_params (is it started "
                "with a kv_producer NixlConnector?)",
            )
        handle = KvHandle(
            worker_id=self.worker_id,
            address=self.transfer_address,
            transfer_id=str(answer.kv_transfer_params.get("remote_request_id", "")),
            num_tokens=len(request.token_ids),
            params=answer.kv_transfer_params,
        )
        return Chunk(request.request_id, list(answer.token_ids), kv_handle=handle)

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        handle = request.kv_handle
        kv = handle is not None
        if handle is not None and not handle.params:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"{self.worker_id}: the KV handle from {handle.worker_id} carries no vLLM "
                "kv_transfer_params (a prefill worker of another engine?)",
            )
        inline = self.backend.streams_prompt_logprobs
        prompt = None if inline else await self._prompt_logprobs(request)
        call = VllmCall(
            request,
            stream=True,
            kv_transfer_params=handle.params if handle else None,
            prompt_logprobs=inline,
        )
        rid = request.request_id
        held: Chunk | None = None  # the last token's chunk, until the stream's end
        cached = 0
        first_deadline = self.config.kv_pull_timeout if kv else None
        with self._vllm_errors(kv=kv):
            async with aclosing(self.backend.stream(call)) as events:
                first = True
                while True:
                    with self._watched(first_deadline if first else None) as scope:
                        event = await anext(events, None)
                    if scope.cancelled_caught:
                        raise self._gone(first=first, deadline=first_deadline)
                    if event is None or event.done:
                        break
                    if event.cached_tokens is not None:
                        cached = event.cached_tokens
                    if event.prompt_logprobs is not None:
                        prompt = event.prompt_logprobs
                    if event.token_ids:
                        first = False
                    if event.finish is not None:
                        held = Chunk(
                            rid,
                            list(event.token_ids),
                            finish_reason=_finish(event.finish, self._up, kv=kv),
                            logprobs=event.logprobs,
                            prompt_logprobs=prompt,
                        )
                    elif event.token_ids:
                        yield Chunk(
                            rid,
                            list(event.token_ids),
                            logprobs=event.logprobs,
                            prompt_logprobs=prompt,
                        )
                        prompt = None  # on the first chunk only
        if held is None:
            raise EngineError(
                ErrorCode.SHUTTING_DOWN, f"{self.worker_id}: vLLM's stream ended early"
            )
        yield replace(held, cached_tokens=cached)

    async def _prompt_logprobs(self, request: GenerateRequest) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, when the request asked and the backend's stream does
        not carry them: a unary request of one token asks for them first (vLLM
        computes the prompt once more for it: it does not read its prefix cache for
        prompt logprobs)."""
        if request.sampling.prompt_logprobs is None:
            return None
        call = VllmCall(
            request,
            stream=False,
            max_tokens=1,
            prompt_logprobs=True,
            request_id=request.request_id + ".prompt",
        )
        with self._vllm_errors(kv=False):
            answer = await self._answer(call)
        return answer.prompt_logprobs

    async def _answer(self, call: VllmCall) -> StreamEvent:
        with self._watched() as scope:
            answer = await self.backend.answer(call)
        if scope.cancelled_caught:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id}: vLLM went down")
        return answer

    def _gone(self, *, first: bool, deadline: float | None) -> EngineError:
        """What a wait on vLLM's stream cancelled by :meth:`_watched` means: the decode
        leg's first token late (its KV transfer did not complete), or vLLM down."""
        if self._up and first and deadline is not None:
            return EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"{self.worker_id}: no first token within {deadline:g} s "
                "(the KV transfer did not complete)",
            )
        return EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id}: vLLM went down")

    @contextmanager
    def _watched(self, deadline: float | None = None) -> Iterator[trio.CancelScope]:
        """A cancel scope that vLLM going down cancels (and *deadline* s, if given).
        Never held across a yield: each wait on vLLM gets its own."""
        scope = trio.CancelScope()
        if deadline is not None:
            scope.deadline = trio.current_time() + deadline
        if not self._up:
            scope.cancel()
        self._watch.scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._watch.scopes.discard(scope)

    @contextmanager
    def _vllm_errors(self, *, kv: bool) -> Iterator[None]:
        """Translate what the backend raised into EngineError (see the module
        docstring); *kv*: a decode leg that pulls KV."""
        try:
            yield
        except VllmRequestError as exc:
            if exc.status == 400 or exc.status == 422:
                code = ErrorCode.INVALID_REQUEST
            elif kv:
                code = ErrorCode.KV_TRANSFER_FAILED
            elif exc.status == 503 or not self._up:
                code = ErrorCode.SHUTTING_DOWN
            else:
                code = ErrorCode.INTERNAL
            raise EngineError(code, f"{self.worker_id}: {exc}") from exc
        except VllmUnreachable as exc:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id}: {exc}") from exc
        except ProtocolError as exc:
            raise EngineError(ErrorCode.INTERNAL, f"{self.worker_id}: {exc}") from exc

    # ---- vLLM's life ---------------------------------------------------------------

    async def _start(self) -> None:
        try:
            served = await self.backend.start()
        except VllmStartError as exc:
            raise EngineFailed(f"{self.worker_id}: {exc}") from exc
        self.served_model = served.name
        if served.max_model_len is not None:
            self.max_model_len = served.max_model_len
        self.counters.vllm_starts += 1
        self._set_up()

    async def _supervise(self) -> None:
        """Restart a started vLLM that died, up to ``vllm_restarts`` times (a start
        that fails counts as one); an attached one is watched by the metrics poller."""
        restarts = 0
        while True:
            why = await self.backend.wait()
            self.counters.vllm_deaths += 1
            self._set_down(why)
            await self.backend.stop()  # what is left of its processes
            while True:
                if restarts >= self.config.vllm_restarts:
                    raise EngineFailed(
                        f"{self.worker_id}: vLLM died and {restarts} restarts failed or "
                        f"died too (--vllm-restarts {self.config.vllm_restarts})"
                    )
                restarts += 1
                log.warning(
                    "%s: restarting vLLM (%d of %d)",
                    self.worker_id,
                    restarts,
                    self.config.vllm_restarts,
                )
                if self._kv is not None:
                    self._kv.restarted()  # an empty cache, its event numbers from 0
                try:
                    await self._start()
                    break
                except EngineFailed as exc:
                    log.error("%s", exc)

    async def _poll_metrics(self) -> None:
        """Read vLLM's metrics every ``metrics_interval`` s into :attr:`metrics`. For
        an attached server it is the health check too: ``down_after_polls`` failures
        in a row take it down, one answer brings it back."""
        backend = self.backend
        failures = 0
        while True:
            await trio.sleep(self.config.metrics_interval)
            if not self._up and not backend.attached:
                continue  # being restarted by _supervise
            try:
                metrics = await backend.metrics()
            except VllmUnreachable as exc:
                failures += 1
                self.counters.metrics_poll_failures += 1
                if backend.attached and failures >= self.config.down_after_polls:
                    self._set_down(f"metrics failed {failures} times: {exc}")
                continue
            failures = 0
            self._record(metrics)
            if backend.attached and not self._up:
                self._set_up()

    def _record(self, m: VllmMetrics) -> None:
        self.metrics = m
        c = self.counters
        sources = m.prompt_tokens_by_source or {}
        c.prompt_tokens_computed = sources.get("local_compute", 0.0)
        c.prompt_tokens_cached = sources.get("local_cache_hit", 0.0)
        c.prompt_tokens_transferred = sources.get("external_kv_transfer", 0.0)
        c.nixl_transfers = m.nixl_xfer_count
        c.nixl_transfer_seconds = m.nixl_xfer_seconds_sum

    def _set_up(self) -> None:
        if not self._up:
            log.info("%s: vLLM up at %s", self.worker_id, self.backend.where)
        self._up = True
        self.counters.vllm_up = 1

    def _set_down(self, why: str) -> None:
        if self._up:
            log.warning("%s: vLLM down: %s", self.worker_id, why)
        self._up = False
        self.counters.vllm_up = 0
        self.metrics = VllmMetrics()
        self._watch.cancel_all()


#: The sampling features every vLLM honours (structured outputs need its tokenizer).
SAMPLING_FEATURES = (
    SEED,
    TOP_K,
    MIN_P,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
    LOGIT_BIAS,
    LOGPROBS,
    PROMPT_LOGPROBS,
)


def _readable(structured: StructuredOutput) -> bool:
    """A choice's spec is a JSON list of strings (vLLM reads the others itself)."""
    if structured.kind is not StructuredKind.CHOICE:
        return True
    try:
        choices = orjson.loads(structured.spec)
    except orjson.JSONDecodeError:
        return False
    return isinstance(choices, list) and all(isinstance(c, str) for c in choices)


def _backend(
    config: VllmConfig,
    role: Role,
    worker_id: str,
    *,
    transport: httpx.AsyncBaseTransport | None,
    otlp_endpoint: str,
    beside_frontend: bool,
) -> VllmBackend:
    """The way to vLLM that *config* asks for (:mod:`.backend`, ``auto`` resolved by
    whether the worker shares the frontend's process); an attached vLLM, or a test's
    *transport*, is always its API server."""
    client = config.vllm_client
    if client is VllmClient.AUTO:
        client = VllmClient.API_SERVER if beside_frontend else VllmClient.IN_PROCESS
    if config.attached or transport is not None or client is VllmClient.API_SERVER:
        return ApiServerBackend(
            config, role, worker_id, transport=transport, otlp_endpoint=otlp_endpoint
        )
    return InProcessBackend(config, role, worker_id, otlp_endpoint=otlp_endpoint)


def _finish(reason: str, up: bool, *, kv: bool = False) -> FinishReason:
    """vLLM's finish reason as headwater's, or the error it means: on a decode leg that
    pulls KV (*kv*), an ``error`` finish is the transfer's (vLLM in-process says so this
    way; through its API server it is an error event), retryable by prefilling again."""
    known = FINISH_REASONS.get(reason)
    if known is not None:
        return known
    if reason == "abort":
        code = ErrorCode.INTERNAL if up else ErrorCode.SHUTTING_DOWN
        raise EngineError(code, "vLLM aborted the request")
    code = ErrorCode.KV_TRANSFER_FAILED if kv and reason == "error" else ErrorCode.INTERNAL
    raise EngineError(code, f"vLLM finished the request with {reason!r}")


def build_engine(config: VllmConfig, context: EngineContext) -> VllmEngine:
    """The registry's factory (:mod:`workers.engines.registry`). Raises EngineFailed
    for a config it cannot serve with (no model or URL, no vocabulary size)."""
    try:
        return VllmEngine(
            config,
            context.role,
            context.worker_id,
            transfer_address=context.transfer_address,
            otlp_endpoint=context.otlp_endpoint,
            beside_frontend=context.beside_frontend,
        )
    except ValueError as exc:
        raise EngineFailed(str(exc)) from exc
