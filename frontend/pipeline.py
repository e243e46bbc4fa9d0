"""One request's way through the frontend, as named stages.

``preprocess`` (chat template, tokenizer pool) → ``route`` and ``plane`` (the
dispatcher, :mod:`frontend.router.dispatch`: workers picked per leg, retried,
migrated) → ``postprocess`` (incremental detokenizer, stop strings) → ``parse``
(chat only: reasoning and tool calls out of the answer's text,
:mod:`frontend.postprocess.parsers`). The same stage names appear in metrics
(``*_seconds``), logs and this code.

Two kinds of request take that path (:mod:`frontend.request`)::

    ParsedRequest (OpenAI) ─── preprocess() ────────┐
                                                    ├─▶ Prepared
    TokenRequest (token-in) ── preprocess_tokens() ─┘

    tokens(prepared)     route, plane              ─▶ TokenDelta (new ids)   token-in API
    generate(prepared)   tokens(), postprocess     ─▶ Delta (new text)       OpenAI routes

A token-in request skips every stage that needs text: no template, no tokenizer, no
detokenizer, no stop strings; its ids are only checked against the vocabulary and the
context length.

Nothing here knows HTTP: the pipeline takes the frontend's request model and raises the
frontend's own errors (:mod:`frontend.errors`), which the HTTP layer maps to statuses
and response bodies.

Structured concurrency: :meth:`Pipeline.generate` (or :meth:`Pipeline.tokens`) is
consumed by the HTTP handler in the request's own task. When the client disconnects,
that task is cancelled, the ``async with client.stream(...)`` blocks exit and the
worker is told to cancel, which frees its KV. No task outlives the request.
"""

from __future__ import annotations

import logging
import time
import uuid
from array import array
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from frontend.asks import check_honoured, fill_in_middle, template_kwargs
from frontend.errors import ContextTooLong, InvalidRequest, WorkerFailed
from frontend.limits import RequestLimits
from frontend.metrics import FrontendMetrics
from frontend.postprocess import TextPostprocessor
from frontend.postprocess.parsers import AnswerParser, ToolCallDelta, check_names, make_parser
from frontend.preprocess.messages import TemplateError, completion_prompt
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.structured import ConstraintError, structured_output
from frontend.preprocess.template import ChatTemplate
from frontend.request import ParsedRequest, SamplingOptions, TokenRequest
from frontend.router import DispatchConfig, Dispatcher, Router
from headwater.logs import current_request
from headwater.tracing import Span, current_trace, tracer
from headwater.wire import GenerateRequest, SamplingParams, StructuredOutput
from headwater.wire.tokens import token_array

log = logging.getLogger(__name__)

#: Templates for prompts longer than this render in a thread (they are pure string
#: work, but a 40k-token conversation is a few hundred kB to join).
TEMPLATE_OFFLOAD_CHARS = 256 * 1024

#: A rendered chat prompt ending in this opened the model's reasoning itself.
THINK_OPEN = "<think>"


#: The request a :class:`Prepared` came from: an OpenAI one or a token-in one.
R = TypeVar("R", ParsedRequest, TokenRequest)


@dataclass(frozen=True, slots=True)
class Prepared(Generic[R]):
    """A preprocessed request, ready for the workers: its prompt's ids and the engine's
    sampling parameters, plus the validated request (``parsed``) that the later stages
    and the response read. ``Prepared[ParsedRequest]`` for the OpenAI routes,
    ``Prepared[TokenRequest]`` for the token-in one."""

    request_id: str  # the request plane's id: fresh per request, whatever the client sent
    parsed: R
    prompt_ids: array[int]  # a token array (headwater.wire.tokens)
    sampling: SamplingParams
    created: float  # unix time, for the response's "created"
    started: float  # trio.current_time() at arrival, for TTFT
    # The rendered prompt ends inside the model's reasoning (``<think>``: DeepSeek-V4's
    # thinking mode), so the answer starts as reasoning, before any ``</think>``.
    reasoning_forced: bool = False


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What :meth:`Pipeline.tokens` yields: the ids generated since the previous delta,
    the count so far, and ``finish_reason`` on the last one.

    One delta may carry several ids: chunks that were already waiting when the consumer
    took one come merged into it (the request plane does that, so that a consumer behind
    its engine catches up in one step).
    """

    token_ids: list[int]  # not empty, but for a last delta that only finishes the stream
    completion_tokens: int
    finish_reason: str | None = None
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Delta:
    """What :meth:`Pipeline.generate` yields: new text of the response, tokens so far,
    and ``finish_reason`` on the last one.

    With the parse stage on (chat, :class:`ParserChoice`), ``text`` is the answer's
    content only; its reasoning and tool-call steps come apart in ``reasoning`` and
    ``tool_calls``, and ``finish_reason`` is "tool_calls" when the model called one.
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    cached_tokens: int = 0
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The parse stage's parsers, by vLLM's names (``--tool-call-parser``,
    ``--reasoning-parser``); "none" leaves the answer as the model wrote it. Tool calls
    are parsed only for a request that offered tools (and did not say
    ``tool_choice: "none"``), as vLLM does: a model's text that merely looks like a
    call is content when no tool was offered."""

    tool_call_parser: str = "none"
    reasoning_parser: str = "none"
    # The message field reasoning goes in: DeepSeek's and vLLM's "reasoning_content",
    # or "reasoning" (what OpenRouter-style clients read).
    reasoning_field: str = "reasoning_content"

    @property
    def active(self) -> bool:
        return self.tool_call_parser != "none" or self.reasoning_parser != "none"


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
        limits: RequestLimits | None = None,
        parsers: ParserChoice | None = None,
    ) -> None:
        self.model_name = model_name
        self.parsers = parsers or ParserChoice()
        check_names(self.parsers.tool_call_parser, self.parsers.reasoning_parser)
        #: The request limits; the pipeline applies the cap on max_tokens to a request
        #: that asked none (the HTTP layer checks those that did, before any work).
        self.limits = limits or RequestLimits()
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

    async def preprocess(self, parsed: ParsedRequest) -> Prepared[ParsedRequest]:
        """Template and tokenize; validate lengths. Raises InvalidRequest (also, before
        any work, for what the workers cannot honour: :mod:`frontend.asks`)."""
        started = trio.current_time()
        check_honoured(parsed.needs, self.router, self.model_name,
                       self.parsers.tool_call_parser)  # fmt: skip
        t0 = time.perf_counter()
        text_or_ids: str | list[int]
        param = "messages" if parsed.endpoint == "chat" else "prompt"
        root = current_trace().span
        try:
            with tracer().span("preprocess.template", parent=root):
                if parsed.endpoint == "chat":
                    text_or_ids = await self._render(parsed)
                else:
                    text_or_ids = completion_prompt(parsed.prompt)
                    if parsed.suffix is not None:
                        text_or_ids = fill_in_middle(text_or_ids, parsed.suffix, self.tokenizer)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param=param) from exc
        t1 = time.perf_counter()
        self.metrics.template_seconds.observe(t1 - t0)
        if isinstance(text_or_ids, str):
            with tracer().span("preprocess.tokenize", parent=root) as span:
                prompt_ids = await self.pool.encode(text_or_ids)
                span.set_many({"headwater.prompt_chars": len(text_or_ids),
                               "gen_ai.usage.input_tokens": len(prompt_ids)})  # fmt: skip
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t1)
        else:
            prompt_ids = self._token_ids(text_or_ids, param)
        reasoning_forced = (parsed.endpoint == "chat" and isinstance(text_or_ids, str)
                            and text_or_ids.rstrip().endswith(THINK_OPEN))  # fmt: skip
        structured = self._structured(parsed, reasoning_forced)
        return Prepared(
            request_id=plane_request_id(),
            parsed=parsed,
            prompt_ids=prompt_ids,
            sampling=self._sampling(parsed.sampling, len(prompt_ids), param, structured),
            created=time.time(),
            started=started,
            reasoning_forced=reasoning_forced,
        )

    async def preprocess_tokens(self, request: TokenRequest) -> Prepared[TokenRequest]:
        """The preprocess stage of a token-in request, which has neither a template nor
        text to tokenize: its ids go to the workers as they came, once checked.

        Raises InvalidRequest (``param`` "token_ids") for an id outside the vocabulary,
        ContextTooLong when the prompt and ``max_tokens`` exceed the context length.
        Async like :meth:`preprocess`, though nothing here waits.
        """
        started = trio.current_time()
        check_honoured(request.needs, self.router, self.model_name, "none")
        prompt_ids = self._token_ids(request.token_ids, "token_ids")
        return Prepared(
            request_id=plane_request_id(),
            parsed=request,
            prompt_ids=prompt_ids,
            sampling=self._sampling(request.sampling, len(prompt_ids), "token_ids"),
            created=time.time(),
            started=started,
        )

    def _token_ids(self, ids: list[int], param: str) -> array[int]:
        """A client's prompt ids (ints >= 0: the schema checked) as a token array, once
        each is checked against the vocabulary. An id at or above the vocabulary size
        indexes past the model's embedding table: an engine may crash on it (a vLLM
        server started without a tokenizer does), so none reaches a worker."""
        vocab = self.tokenizer.vocab_size
        if ids and max(ids) >= vocab:
            bad = next(t for t in ids if t >= vocab)
            raise InvalidRequest(
                f"prompt token ids must be below the vocabulary size ({vocab}), got {bad}",
                param=param,
            )
        return token_array(ids)

    async def _render(self, parsed: ParsedRequest) -> str:
        render = self.template.render
        kwargs = template_kwargs(parsed, self.template)
        # tool_choice "none": the tools stay out of the prompt, as Dynamo leaves them.
        tools = None if parsed.tool_choice == "none" else parsed.tools
        # The parser's count has the tools and their arguments too: a large one renders
        # off the loop like a long conversation.
        chars = parsed.text_chars
        if (_approx_chars(parsed.messages) if chars is None else chars) < TEMPLATE_OFFLOAD_CHARS:
            return render(parsed.messages or [], chat_template_kwargs=kwargs, tools=tools)

        def work() -> str:
            return render(parsed.messages or [], chat_template_kwargs=kwargs, tools=tools)

        return await trio.to_thread.run_sync(work, limiter=self.pool.limiter)

    def _structured(self, parsed: ParsedRequest, reasoning_forced: bool) -> StructuredOutput | None:
        """The engine's constraint for what ``response_format`` / ``tool_choice`` ask."""
        if parsed.constraint is None:
            return None
        try:
            return structured_output(
                parsed.constraint, tools=parsed.tools,
                tool_call_parser=self.parsers.tool_call_parser,
                reasoning_forced=reasoning_forced,
                parallel_tool_calls=parsed.parallel_tool_calls,
            )  # fmt: skip
        except ConstraintError as exc:
            raise InvalidRequest(str(exc), param=parsed.constraint.param) from exc

    def _sampling(
        self,
        options: SamplingOptions,
        prompt_len: int,
        param: str,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """The engine's parameters for a prompt of *prompt_len* tokens; ContextTooLong,
        naming *param* (where the prompt came from), when there is no room for them.
        *structured*: an OpenAI request's constraint (a token-in one's is in *options*)."""
        room = self.context_length - prompt_len
        if room < 1 or (options.max_tokens is not None and options.max_tokens > room):
            asked = options.max_tokens if options.max_tokens is not None else 1
            raise ContextTooLong(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} for the completion). Please reduce the length of the "
                "prompt or the completion.",
                param=param,
            )
        max_tokens = (options.max_tokens if options.max_tokens is not None
                      else self.limits.default_max_tokens(room))  # fmt: skip
        if options.min_tokens > max_tokens:
            # Only when max_tokens was not asked (the schema checks it against one that
            # was): refused here, before any worker would refuse it mid-stream.
            raise InvalidRequest(
                f"'min_tokens' ({options.min_tokens}) exceeds the {max_tokens} tokens this "
                "request may generate", param="min_tokens",
            )  # fmt: skip
        vocab = self.tokenizer.vocab_size
        if any(token >= vocab for token, _ in options.logit_bias):
            bias = "sampling_params.logit_bias" if param == "token_ids" else "logit_bias"
            raise InvalidRequest(f"'{bias}' token ids must be below the vocabulary size "
                                 f"({vocab})", param=bias)  # fmt: skip
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=options.min_tokens,
            ignore_eos=options.ignore_eos,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop_token_ids=options.stop_token_ids,
            top_k=options.top_k,
            min_p=options.min_p,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            repetition_penalty=options.repetition_penalty,
            logit_bias=options.logit_bias,
            structured=structured or options.structured,
        )

    # -- route → plane → postprocess --------------------------------------------------

    async def tokens(self, prep: Prepared[Any]) -> AsyncGenerator[TokenDelta, None]:
        """Route and plane: stream the generated ids as the workers send them; the last
        delta carries ``finish_reason`` ("stop": EOS or a stop token id; "length").
        Records time to first token and inter-token latency.

        Raises NoCapacity when no worker can take the request before any output,
        InvalidRequest when a worker refuses it as invalid, WorkerFailed otherwise.
        Closing the generator early cancels the request on its worker.
        """
        first = True
        last_token_at = 0.0
        cached = 0
        generated = 0
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
                generated += len(chunk.token_ids)
                cached = max(cached, chunk.cached_tokens)
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason.value
                    current_trace().span.set_many({
                        "gen_ai.request.model": self.model_name,
                        "gen_ai.usage.input_tokens": len(prep.prompt_ids),
                        "gen_ai.usage.output_tokens": generated,
                        "headwater.cached_tokens": cached,
                        "gen_ai.response.finish_reasons": reason,
                    })  # fmt: skip
                    yield TokenDelta(chunk.token_ids, generated, reason, cached)
                    return
                if chunk.token_ids:
                    yield TokenDelta(chunk.token_ids, generated, None, cached)
        raise WorkerFailed("the worker ended the stream without a finish reason")

    async def generate(self, prep: Prepared[ParsedRequest]) -> AsyncGenerator[Delta, None]:
        """Postprocess and parse on top of :meth:`tokens`: stream deltas of the answer;
        the last one carries ``finish_reason`` ("stop" also when a stop string matched,
        "tool_calls" when the parse stage found a complete call). Raises what
        :meth:`tokens` raises. A matched stop string closes :meth:`tokens`, which
        cancels the rest of the generation on the worker.
        """
        post = TextPostprocessor(
            self.tokenizer.decode, stops=prep.parsed.stop,
            special_ids=self.tokenizer.special_ids,
        )
        parse = _ParseStage(self._parser(prep), single=not prep.parsed.parallel_tool_calls)
        async with aclosing(_postprocess_span(self.tokens(prep))) as steps:
            async for step in steps:
                delta = post.step(step.token_ids)
                if delta.stopped:
                    yield parse.last(delta.text, post.completion_tokens, "stop",
                                     step.cached_tokens, cut=True)  # fmt: skip
                    return
                if step.finish_reason is not None:
                    tail = delta.text + post.finish()
                    # A stop string can complete in the held-back tail released by finish().
                    reason = "stop" if post.stopped else step.finish_reason
                    yield parse.last(tail, post.completion_tokens, reason,
                                     step.cached_tokens, cut=post.stopped)  # fmt: skip
                    return
                if delta.text:
                    out = parse.step(delta.text, post.completion_tokens, step.cached_tokens)
                    if out is not None:
                        yield out
        raise AssertionError("tokens() ends with a finishing delta or raises")

    def _parser(self, prep: Prepared[ParsedRequest]) -> AnswerParser | None:
        """This request's parse stage: chat only (``/v1/completions`` stays raw, as
        OpenAI's does), tool calls only when tools were offered."""
        parsed, choice = prep.parsed, self.parsers
        if parsed.endpoint != "chat" or not choice.active:
            return None
        offered = bool(parsed.tools) and parsed.tool_choice != "none"
        tool_parser = choice.tool_call_parser if offered else "none"
        if tool_parser == "none" and choice.reasoning_parser == "none":
            return None
        return make_parser(
            tool_parser, choice.reasoning_parser,
            tools=parsed.tools if offered else None, reasoning_forced=prep.reasoning_forced,
        )  # fmt: skip


class _ParseStage:
    """The parse stage of one response stream: each text piece through the request's
    :class:`AnswerParser`, or as it is when it has none."""

    __slots__ = ("_parser", "_single")

    def __init__(self, parser: AnswerParser | None, *, single: bool = False) -> None:
        self._parser = parser
        # parallel_tool_calls false: the first call is the answer's; later ones are
        # dropped (an engine that constrains the answer never writes them).
        self._single = single

    def _calls(self, calls: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
        return tuple(c for c in calls if c.index == 0) if self._single else calls

    def step(self, text: str, tokens: int, cached: int) -> Delta | None:
        """The delta for a piece of text mid-stream; None when all of it is held back."""
        if self._parser is None:
            return Delta(text, tokens, None, cached)
        out = self._parser.feed(text)
        calls = self._calls(out.tool_calls)
        if not (out.content or out.reasoning or calls):
            return None
        return Delta(out.content, tokens, None, cached, out.reasoning, calls)

    def last(self, text: str, tokens: int, reason: str, cached: int, *, cut: bool) -> Delta:
        """The stream's last delta. ``cut``: a stop string ended the text, so, like
        ``max_tokens`` ("length"), it may have cut a tool call, which is dropped."""
        parser = self._parser
        if parser is None:
            return Delta(text, tokens, reason, cached)
        head = parser.feed(text) if text else None
        tail = parser.finish(truncated=cut or reason == "length")
        if parser.tool_calls_made and reason == "stop":
            reason = "tool_calls"
        content = (head.content if head else "") + tail.content
        reasoning = (head.reasoning if head else "") + tail.reasoning
        calls = self._calls((head.tool_calls if head else ()) + tail.tool_calls)
        return Delta(content, tokens, reason, cached, reasoning, calls)


def plane_request_id() -> str:
    """A request's id on the request plane: the HTTP request's id (the client's
    ``X-Request-Id``, or generated) and 8 random hex digits, since two requests may
    bring the same id and the plane's must be unique; fully random outside one."""
    ctx = current_request()
    suffix = uuid.uuid4().hex
    return f"{ctx.request_id}-{suffix[:8]}" if ctx is not None else suffix


def _postprocess_span(
    steps: AsyncGenerator[TokenDelta, None],
) -> AsyncGenerator[TokenDelta, None]:
    """*steps* itself when the request is not traced; else *steps* inside one
    "postprocess" span, which sums the CPU seconds this thread spent between two steps:
    the stages downstream of the plane (detokenize, parse, the response's formatting)."""
    parent = current_trace().span
    return _timed(steps, parent) if parent.recording else steps


async def _timed(steps: AsyncGenerator[TokenDelta, None], parent: Span
                 ) -> AsyncGenerator[TokenDelta, None]:  # fmt: skip
    spent = 0.0
    with tracer().span("postprocess", parent=parent) as span:
        try:
            async with aclosing(steps):
                async for step in steps:
                    t0 = time.thread_time()
                    yield step
                    spent += time.thread_time() - t0
        finally:
            span.set("headwater.postprocess.cpu_seconds", spent)


def _approx_chars(messages: list[Any] | None) -> int:
    total = 0
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total
