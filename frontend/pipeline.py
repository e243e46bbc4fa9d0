"""One request's way through the frontend, as named stages.

``preprocess`` (chat template, tokenizer pool) → ``route`` (router picks workers) →
``plane`` (request plane: prefill leg then decode leg, or one aggregated leg) →
``postprocess`` (incremental detokenizer, stop strings). The same stage names appear
in metrics (``*_seconds``), logs and this code.

Structured concurrency: :meth:`Pipeline.generate` is consumed by the HTTP handler in
the request's own task. When the client disconnects, that task is cancelled, the
``async with client.stream(...)`` blocks exit and the worker is told to cancel, which
frees its KV. No task outlives the request.
"""

from __future__ import annotations

import logging
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

import trio

from frontend.http.errors import ApiError, bad_request
from frontend.http.schema import ParsedRequest
from frontend.metrics import FrontendMetrics
from frontend.postprocess import TextPostprocessor
from frontend.preprocess.messages import TemplateError, completion_prompt
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.template import ChatTemplate
from frontend.router import NoWorkers, Router
from headwater.plane import CannotConnect, Disconnected, WorkerClient, WorkerError
from headwater.wire import Chunk, ErrorCode, GenerateRequest, KvHandle, Role, SamplingParams
from headwater.wire.tokens import token_array

log = logging.getLogger(__name__)

#: Templates for prompts longer than this render in a thread (they are pure string
#: work, but a 40k-token conversation is a few hundred kB to join).
TEMPLATE_OFFLOAD_CHARS = 256 * 1024


@dataclass(frozen=True, slots=True)
class Prepared:
    """A preprocessed request: token ids in, plus what postprocess needs."""

    request_id: str
    parsed: ParsedRequest
    prompt_ids: array[int]  # a token array (headwater.wire.tokens)
    sampling: SamplingParams
    created: float  # unix time, for the response's "created"
    started: float  # trio.current_time() at arrival, for TTFT


@dataclass(frozen=True, slots=True)
class Delta:
    """Text produced by one step of postprocess; ``finish_reason`` on the last one."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    cached_tokens: int = 0


class Pipeline:
    """The frontend's request path; see the module docstring."""

    def __init__(
        self,
        *,
        model_name: str,
        context_length: int,
        pool: TokenizerPool,
        template: ChatTemplate,
        router: Router,
        metrics: FrontendMetrics,
        migration_limit: int = 3,
        route_attempts: int = 3,
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.pool = pool
        self.tokenizer = pool.tokenizer
        self.template = template
        self.router = router
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.route_attempts = route_attempts
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    # -- health ------------------------------------------------------------------

    def ready(self) -> bool:
        """A request could be served now: prefill + decode, or an aggregated worker."""
        r, m = self.router, self.model_name
        disagg = r.routable(Role.PREFILL, m) > 0 and r.routable(Role.DECODE, m) > 0
        return disagg or r.routable(Role.AGG, m) > 0

    # -- preprocess ------------------------------------------------------------------

    async def preprocess(self, parsed: ParsedRequest) -> Prepared:
        """Template and tokenize; validate lengths. Raises ApiError (400)."""
        started = trio.current_time()
        t0 = time.perf_counter()
        try:
            if parsed.endpoint == "chat":
                text_or_ids = await self._render(parsed)
            else:
                text_or_ids = completion_prompt(parsed.prompt)
        except TemplateError as exc:
            param = "messages" if parsed.endpoint == "chat" else "prompt"
            raise bad_request(str(exc), param) from exc
        t1 = time.perf_counter()
        self.metrics.template_seconds.observe(t1 - t0)
        if isinstance(text_or_ids, str):
            prompt_ids = await self.pool.encode(text_or_ids)
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t1)
        else:
            if any(t >= self.tokenizer.vocab_size for t in text_or_ids):  # >= 0: schema
                raise bad_request("prompt token ids must be below the vocabulary size", "prompt")
            prompt_ids = token_array(text_or_ids)
        return Prepared(
            request_id=uuid.uuid4().hex,
            parsed=parsed,
            prompt_ids=prompt_ids,
            sampling=self._sampling(parsed, len(prompt_ids)),
            created=time.time(),
            started=started,
        )

    async def _render(self, parsed: ParsedRequest) -> str:
        render = self.template.render
        kwargs = parsed.chat_template_kwargs
        if _approx_chars(parsed.messages) < TEMPLATE_OFFLOAD_CHARS:
            return render(parsed.messages or [], chat_template_kwargs=kwargs, tools=parsed.tools)

        def work() -> str:
            return render(parsed.messages or [], chat_template_kwargs=kwargs, tools=parsed.tools)

        return await trio.to_thread.run_sync(work, limiter=self.pool.limiter)

    def _sampling(self, parsed: ParsedRequest, prompt_len: int) -> SamplingParams:
        room = self.context_length - prompt_len
        if room < 1 or (parsed.max_tokens is not None and parsed.max_tokens > room):
            asked = parsed.max_tokens if parsed.max_tokens is not None else 1
            raise bad_request(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} for the completion). Please reduce the length of the "
                "prompt or the completion.",
                "messages" if parsed.endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=parsed.max_tokens if parsed.max_tokens is not None else room,
            min_tokens=parsed.min_tokens,
            ignore_eos=parsed.ignore_eos,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            seed=parsed.seed,
            stop_token_ids=parsed.stop_token_ids,
        )

    # -- route → plane → postprocess --------------------------------------------------

    async def generate(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Stream text deltas; the last one carries ``finish_reason``.

        Raises ApiError 503 when no worker can take the request before any output.
        """
        post = TextPostprocessor(
            self.tokenizer.decode, stops=prep.parsed.stop,
            special_ids=self.tokenizer.special_ids,
        )
        first = True
        last_token_at = 0.0
        cached = 0
        async with aclosing(self._token_stream(prep)) as chunks:
            async for chunk in chunks:
                now = trio.current_time()
                if n := len(chunk.token_ids):
                    # One ITL sample per token after the first: a chunk's gap is shared
                    # by its tokens (the plane merges chunks that arrived together), and
                    # tokens that came with the first one came 0 s after it.
                    if first:
                        self.metrics.time_to_first_token_seconds.observe(now - prep.started)
                        first = False
                        gap, n = 0.0, n - 1
                    else:
                        gap = (now - last_token_at) / n
                    for _ in range(n):
                        self.metrics.inter_token_latency_seconds.observe(gap)
                    last_token_at = now
                cached = max(cached, chunk.cached_tokens)
                delta = post.step(chunk.token_ids)
                if delta.stopped:
                    yield Delta(delta.text, post.completion_tokens, "stop", cached)
                    return
                if chunk.finish_reason is not None:
                    tail = delta.text + post.finish()
                    # A stop string can complete in the held-back tail released by finish().
                    reason = "stop" if post.stopped else chunk.finish_reason.value
                    yield Delta(tail, post.completion_tokens, reason, cached)
                    return
                if delta.text:
                    yield Delta(delta.text, post.completion_tokens, None, cached)
        raise ApiError(502, "the worker ended the stream without a finish reason")

    async def _token_stream(self, prep: Prepared) -> AsyncIterator[Chunk]:
        """Chunks for the request, migrating to another worker if a stream breaks."""
        generated = token_array()
        migrations = 0
        while True:
            request = GenerateRequest(
                request_id=prep.request_id if migrations == 0
                else f"{prep.request_id}.m{migrations}",
                model=self.model_name,
                # The prompt's array itself until a migration has output to carry over:
                # nothing downstream writes to it.
                token_ids=prep.prompt_ids + generated if generated else prep.prompt_ids,
                sampling=replace(
                    prep.sampling,
                    max_tokens=prep.sampling.max_tokens - len(generated),
                    min_tokens=max(0, prep.sampling.min_tokens - len(generated)),
                ),
                eos_token_ids=self.eos_token_ids,
            )
            try:
                role, request = await self._route(request)
                async with aclosing(self._stream_on(role, request)) as chunks:
                    async for chunk in chunks:
                        generated.extend(chunk.token_ids)
                        yield chunk
                return
            except Disconnected as exc:
                if migrations >= self.migration_limit:
                    raise ApiError(502, "the worker's stream broke") from exc
                migrations += 1
                self.metrics.model_migration_total.inc()
                log.warning("request %s: stream broke (%s); migrating with %d tokens",
                            prep.request_id, exc, len(generated))

    async def _route(self, request: GenerateRequest) -> tuple[Role, GenerateRequest]:
        """Where the output of one attempt comes from: disaggregated when possible (the
        prefill leg runs here, and the request gains its KV handle), else aggregated."""
        r, m = self.router, self.model_name
        if r.routable(Role.PREFILL, m) and r.routable(Role.DECODE, m):
            handle = await self._prefill(request)
            return Role.DECODE, replace(request, kv_handle=handle)
        if r.routable(Role.AGG, m):
            return Role.AGG, request
        return Role.DECODE, request  # a decode worker can prefill locally when alone

    async def _prefill(self, request: GenerateRequest) -> KvHandle | None:
        handle = None
        async with aclosing(self._stream_on(Role.PREFILL, request)) as chunks:
            async for chunk in chunks:
                handle = chunk.kv_handle or handle
        if handle is None:
            raise ApiError(502, "the prefill worker returned no KV handle")
        return handle

    async def _stream_on(self, role: Role, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Route to a worker of *role* and relay its chunks.

        Workers that cannot be reached (no ACK) or refuse retryably are skipped, up to
        ``route_attempts``; the unreachable ones are inhibited by the router.
        """
        tried: set[str] = set()
        while True:
            client = self._pick(role, frozenset(tried))
            tried.add(client.instance.worker_id)
            # The consumer closes this generator at the yield of the final chunk, so
            # success is booked in `finally`, from what was seen, not after the loop.
            finished = False
            try:
                with self.router.track(client):
                    async with client.stream(request) as replies:
                        async for chunk in replies:
                            finished = chunk.finish_reason is not None
                            yield chunk
                finished = True  # End received (a prefill leg has no finish reason)
                return
            except CannotConnect as exc:
                self.router.report_unreachable(client, exc)
                log.warning("worker %s unreachable: %s", client.instance.worker_id, exc)
                if len(tried) >= self.route_attempts:
                    raise ApiError(503, "no worker could take the request") from exc
            except WorkerError as exc:
                if exc.code is ErrorCode.INVALID_REQUEST:
                    raise bad_request(exc.message) from exc
                if not exc.retryable or len(tried) >= self.route_attempts:
                    why = f"the worker failed the request ({exc.code.value})"
                    raise ApiError(502, why) from exc
            finally:
                if finished:
                    self.router.report_success(client)

    def _pick(self, role: Role, exclude: frozenset[str]) -> WorkerClient:
        try:
            return self.router.pick(role, self.model_name, exclude)
        except NoWorkers as exc:
            raise ApiError(503, str(exc), code="no_workers") from exc


def _approx_chars(messages: list | None) -> int:
    total = 0
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total
