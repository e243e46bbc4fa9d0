"""One request's way through the frontend, as named stages.

``preprocess`` (chat template, tokenizer pool) → ``route`` and ``plane`` (the
dispatcher, :mod:`frontend.router.dispatch`: workers picked per leg, retried,
migrated) → ``postprocess`` (incremental detokenizer, stop strings). The same stage
names appear in metrics (``*_seconds``), logs and this code.

Nothing here knows HTTP: the pipeline takes a :class:`~frontend.request.ParsedRequest`
and raises the frontend's own errors (:mod:`frontend.errors`), which the HTTP layer
maps to statuses and OpenAI bodies.

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
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import trio

from frontend.errors import ContextTooLong, InvalidRequest, WorkerFailed
from frontend.metrics import FrontendMetrics
from frontend.postprocess import TextPostprocessor
from frontend.preprocess.messages import TemplateError, completion_prompt
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.template import ChatTemplate
from frontend.request import ParsedRequest
from frontend.router import DispatchConfig, Dispatcher, Router
from headwater.wire import GenerateRequest, SamplingParams
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
    """What the pipeline yields: new text of the response, tokens so far, and
    ``finish_reason`` on the last one."""

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
        dispatch: DispatchConfig | None = None,
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.pool = pool
        self.tokenizer = pool.tokenizer
        self.template = template
        self.router = router
        self.metrics = metrics
        self.dispatcher = Dispatcher(
            router,
            model_name,
            config=dispatch,
            metrics=metrics,
        )
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    # -- health ------------------------------------------------------------------

    def ready(self) -> bool:
        """A request could be served now: prefill + decode, or an aggregated worker."""
        return self.dispatcher.ready()

    # -- preprocess ------------------------------------------------------------------

    async def preprocess(self, parsed: ParsedRequest) -> Prepared:
        """Template and tokenize; validate lengths. Raises InvalidRequest."""
        started = trio.current_time()
        t0 = time.perf_counter()
        text_or_ids: str | list[int]
        try:
            if parsed.endpoint == "chat":
                text_or_ids = await self._render(parsed)
            else:
                text_or_ids = completion_prompt(parsed.prompt)
        except TemplateError as exc:
            param = "messages" if parsed.endpoint == "chat" else "prompt"
            raise InvalidRequest(str(exc), param=param) from exc
        t1 = time.perf_counter()
        self.metrics.template_seconds.observe(t1 - t0)
        if isinstance(text_or_ids, str):
            prompt_ids = await self.pool.encode(text_or_ids)
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t1)
        else:
            if any(t >= self.tokenizer.vocab_size for t in text_or_ids):  # >= 0: schema
                raise InvalidRequest(
                    "prompt token ids must be below the vocabulary size", param="prompt"
                )
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
            raise ContextTooLong(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} for the completion). Please reduce the length of the "
                "prompt or the completion.",
                param="messages" if parsed.endpoint == "chat" else "prompt",
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

    async def generate(self, prep: Prepared) -> AsyncGenerator[Delta, None]:
        """Stream text deltas; the last one carries ``finish_reason``.

        Raises NoCapacity when no worker can take the request before any output,
        InvalidRequest when a worker refuses it as invalid, WorkerFailed otherwise.
        """
        post = TextPostprocessor(
            self.tokenizer.decode, stops=prep.parsed.stop,
            special_ids=self.tokenizer.special_ids,
        )
        first = True
        last_token_at = 0.0
        cached = 0
        request = GenerateRequest(
            request_id=prep.request_id,
            model=self.model_name,
            token_ids=prep.prompt_ids,
            sampling=prep.sampling,
            eos_token_ids=self.eos_token_ids,
        )
        async with aclosing(self.dispatcher.stream(request)) as chunks:
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
        raise WorkerFailed("the worker ended the stream without a finish reason")


def _approx_chars(messages: list[Any] | None) -> int:
    total = 0
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total
