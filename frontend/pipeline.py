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
    generate(prepared)   tokens(), postprocess,    ─▶ Delta (new text)       OpenAI routes
                         parse

A token-in request skips every stage that needs text: no template, no tokenizer, no
detokenizer, no stop strings; its ids are only checked against the vocabulary and the
context length.

**Choices.** A request for ``n`` > 1 choices runs ``n`` streams, one per choice: each
its own request on the plane (``<id>.c<i>``, the seed ``seed + i`` as vLLM derives
its children's) with its own postprocessing (one
:class:`~frontend.postprocess.choice.ChoiceStream` each), and their deltas come
merged, each with its choice's ``index``. Choice 0 goes first; the others start once
its first token is out (its prompt is in its worker's prefix cache then) and prefer
that worker (the dispatcher's affinity), so the prompt's KV is computed once and
found in the cache by the others, on the mocker and on vLLM with prefix caching. The
streams run in the pipeline's own nursery (:meth:`Pipeline.run`), since the consumer
is an async generator, which must not hold one across its ``yield``; they are
cancelled, and waited for, when the consumer closes it (the client left), so no
choice outlives its request.

Nothing here knows HTTP: the pipeline takes the frontend's request model and raises the
frontend's own errors (:mod:`frontend.errors`), which the HTTP layer maps to statuses
and response bodies.

Structured concurrency: :meth:`Pipeline.generate` (or :meth:`Pipeline.tokens`) is
consumed by the HTTP handler in the request's own task. When the client disconnects,
that task is cancelled, the ``async with client.stream(...)`` blocks exit and the
worker is told to cancel, which frees its KV. No task outlives the request.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from array import array
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Generic, TypeVar

import trio

from frontend.asks import OneCall, check_honoured, fill_in_middle, template_kwargs
from frontend.errors import ContextTooLong, InvalidRequest, WorkerFailed
from frontend.limits import RequestLimits
from frontend.metrics import FrontendMetrics
from frontend.postprocess import TextPostprocessor
from frontend.postprocess.choice import ChoiceStream, Echo, echo
from frontend.postprocess.logprobs import LogprobEntry, TokenTexts
from frontend.postprocess.parsers import AnswerParser, ToolCallDelta, check_names, make_parser
from frontend.preprocess.messages import TemplateError, completion_prompt
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.structured import ConstraintError, structured_output
from frontend.preprocess.template import ChatTemplate
from frontend.request import ParsedRequest, SamplingOptions, TokenRequest
from frontend.router import DispatchConfig, Dispatcher, Policy, Router
from frontend.router.kv_index import prompt_hashes
from headwater.logs import current_request
from headwater.tracing import Span, current_trace, tracer
from headwater.wire import GenerateRequest, Role, SamplingParams, StructuredOutput, TokenLogprobs
from headwater.wire.tokens import token_array

log = logging.getLogger(__name__)

#: Templates for prompts longer than this render in a thread (they are pure string
#: work, but a 40k-token conversation is a few hundred kB to join).
TEMPLATE_OFFLOAD_CHARS = 256 * 1024
#: Completions' echo of a prompt longer than this (tokens) is built in a thread: with
#: logprobs, it decodes the prompt a token at a time (~3 µs each).
ECHO_OFFLOAD_TOKENS = 1024
#: Seconds the choices of a request get to wind down (their workers told to cancel)
#: once the request is over.
CHOICES_CLEANUP_S = 5.0
_INT64 = 1 << 64
_NO_LOGPROBS = "the worker sent no logprobs for a request that asked for them"

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
    # The prompt's block hashes for ``--router kv``, when preprocess computed them
    # beside the encoding (else dispatch computes them).
    block_hashes: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What :meth:`Pipeline.tokens` yields: the ids of choice ``index`` generated since
    its previous delta, the request's completion tokens so far (every choice's), and
    ``finish_reason`` on the choice's last one; ``final`` on the request's last one.

    One delta may carry several ids: chunks that were already waiting when the consumer
    took one come merged into it (the request plane does that, so that a consumer behind
    its engine catches up in one step). ``logprobs``: one per id, when asked; the first
    delta with ids of choice 0 carries the prompt's (``prompt_logprobs``), when asked.
    """

    token_ids: list[int]  # not empty, but for a last delta that only finishes the stream
    completion_tokens: int
    finish_reason: str | None = None
    cached_tokens: int = 0
    index: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    final: bool = False


@dataclass(frozen=True, slots=True)
class Delta:
    """What :meth:`Pipeline.generate` yields: new text of choice ``index``, the
    request's completion tokens so far (every choice's), ``finish_reason`` on the
    choice's last one, ``final`` on the request's last one; ``logprobs``: the entries
    of the tokens whose text this delta carries (completions' echo: the prompt's
    first), when asked.

    With the parse stage on (chat, :class:`ParserChoice`), ``text`` is the answer's
    content only; its reasoning and tool-call steps come apart in ``reasoning`` and
    ``tool_calls``, and ``finish_reason`` is "tool_calls" when the model called one.
    The logprobs then come with the delta in which the parse stage lets their text out
    (of a marker it held back, up to one delta early).

    ``stop_sequence`` is the stop string that ended the response, on the last delta
    (Anthropic's API reports it).
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    cached_tokens: int = 0
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    index: int = 0
    logprobs: tuple[LogprobEntry, ...] = ()
    final: bool = False
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic's API reports it)


#: A delta of either kind.
D = TypeVar("D", Delta, TokenDelta)


@dataclass(eq=False, slots=True)
class _Choices:
    """What the choices of one request (``n`` > 1) share."""

    #: The worker per role choice 0 picked, which the others prefer (dispatch).
    affinity: dict[Role, str] = field(default_factory=dict)
    #: Choice 0's first token came (or it ended): the others may start.
    first_token: trio.Event = field(default_factory=trio.Event)
    #: Choice 0's prompt logprobs (asked of it alone).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    #: Completions' echo, built once for every choice.
    echo: Echo | None = None
    echo_lock: trio.Lock = field(default_factory=trio.Lock)


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
            offload=pool.offload,
        )
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()
        #: Token texts for logprobs (shared by every request).
        self.token_texts = TokenTexts(self.tokenizer.hf)
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the streams of the choices of requests with ``n`` > 1 until cancelled
        (see the module docstring). Start it with ``await nursery.start(pipeline.run)``
        before serving such requests."""
        try:
            async with trio.open_nursery() as nursery:
                self.attach(nursery)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Run the streams of the choices of requests with ``n`` > 1 in *nursery*, which
        outlives this pipeline's requests (a :class:`~frontend.catalog.ModelCatalog`'s,
        for every model's pipeline; :meth:`run` opens one of its own)."""
        self._nursery = nursery

    # -- health ------------------------------------------------------------------

    def ready(self) -> bool:
        """A request could be served now: prefill + decode, or an aggregated worker."""
        return self.dispatcher.ready()

    # -- preprocess ------------------------------------------------------------------

    async def preprocess(self, parsed: ParsedRequest) -> Prepared[ParsedRequest]:
        """Template and tokenize; validate lengths. Raises InvalidRequest (also, before
        any work, for what the workers cannot honour: :mod:`frontend.asks`)."""
        started = trio.current_time()
        check_honoured(parsed.needs, self.router, self.model_name, self.parsers.tool_call_parser)
        param = "messages" if parsed.endpoint == "chat" else "prompt"
        prompt_ids, reasoning_forced, hashes = await self._prompt(
            parsed, hashed=self.router.policy is Policy.KV
        )
        structured = self._structured(parsed, reasoning_forced)
        return Prepared(
            request_id=plane_request_id(),
            parsed=parsed,
            prompt_ids=prompt_ids,
            sampling=self._sampling(parsed.sampling, len(prompt_ids), param, structured),
            created=time.time(),
            started=started,
            reasoning_forced=reasoning_forced,
            block_hashes=hashes,
        )

    async def encode_prompt(self, parsed: ParsedRequest) -> array[int]:
        """The prompt's ids: the chat template rendered (chat) or the prompt normalised
        (completions), then tokenized in the pool; no length is checked (``/tokenize``
        reports a prompt of any length). Raises InvalidRequest."""
        prompt_ids, _, _ = await self._prompt(parsed, hashed=False)
        return prompt_ids

    async def _prompt(
        self, parsed: ParsedRequest, *, hashed: bool
    ) -> tuple[array[int], bool, tuple[int, ...] | None]:
        """:meth:`encode_prompt`, whether the rendered prompt opened the model's
        reasoning itself (it ends in ``<think>``), and, when *hashed*, the prompt's
        block hashes for ``--router kv``, computed beside the encoding in the
        tokenizer's thread (None when not asked, or for a prompt given as ids)."""
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
                hashes: tuple[int, ...] | None = None
                if hashed:
                    block = partial(prompt_hashes, block_size=self.router.kv.block_size)
                    prompt_ids, waited, hashes = await self.pool.encode_with(text_or_ids, block)
                else:
                    prompt_ids, waited = await self.pool.encode_timed(text_or_ids)
                span.set_many(
                    {
                        "headwater.prompt_chars": len(text_or_ids),
                        "gen_ai.usage.input_tokens": len(prompt_ids),
                        "headwater.tokenize.queue_wait_s": waited,
                    }
                )
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t1)
        else:
            prompt_ids = self._token_ids(text_or_ids, param)
            hashes = None
        forced = isinstance(text_or_ids, str) and text_or_ids.rstrip().endswith(THINK_OPEN)
        return prompt_ids, parsed.endpoint == "chat" and forced, hashes

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
        kwargs = template_kwargs(parsed, self.template)
        # tool_choice "none": the tools stay out of the prompt, as Dynamo leaves them.
        tools = None if parsed.tool_choice == "none" else parsed.tools

        def work() -> str:
            return self.template.render(
                parsed.messages or [],
                add_generation_prompt=parsed.add_generation_prompt,
                chat_template_kwargs=kwargs,
                tools=tools,
            )

        # The parser's count has the tools and their arguments too: a large one renders
        # off the loop like a long conversation.
        chars = parsed.text_chars
        if (_approx_chars(parsed.messages) if chars is None else chars) < TEMPLATE_OFFLOAD_CHARS:
            return work()
        return await self.pool.offload(work)

    def _structured(self, parsed: ParsedRequest, reasoning_forced: bool) -> StructuredOutput | None:
        """The engine's constraint for what ``response_format`` / ``tool_choice`` ask."""
        if parsed.constraint is None:
            return None
        try:
            return structured_output(
                parsed.constraint,
                tools=parsed.tools,
                tool_call_parser=self.parsers.tool_call_parser,
                reasoning_forced=reasoning_forced,
                parallel_tool_calls=parsed.parallel_tool_calls,
            )
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
        max_tokens = (
            options.max_tokens
            if options.max_tokens is not None
            else self.limits.default_max_tokens(room)
        )
        if options.min_tokens > max_tokens:
            # Only when max_tokens was not asked (the schema checks it against one that
            # was): refused here, before any worker would refuse it mid-stream.
            raise InvalidRequest(
                f"'min_tokens' ({options.min_tokens}) exceeds the {max_tokens} tokens this "
                "request may generate",
                param="min_tokens",
            )
        vocab = self.tokenizer.vocab_size
        if any(token >= vocab for token, _ in options.logit_bias):
            bias = "sampling_params.logit_bias" if param == "token_ids" else "logit_bias"
            raise InvalidRequest(
                f"'{bias}' token ids must be below the vocabulary size ({vocab})", param=bias
            )
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=options.min_tokens,
            ignore_eos=options.ignore_eos,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop_token_ids=options.stop_token_ids,
            logprobs=options.logprobs,
            prompt_logprobs=options.prompt_logprobs,
            top_k=options.top_k,
            min_p=options.min_p,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            repetition_penalty=options.repetition_penalty,
            logit_bias=options.logit_bias,
            structured=structured or options.structured,
        )

    # -- route → plane → postprocess --------------------------------------------------

    def tokens(self, prep: Prepared[Any]) -> AsyncGenerator[TokenDelta, None]:
        """Route and plane: stream the generated ids as the workers send them, of every
        choice (see :class:`TokenDelta`); a choice's last delta carries
        ``finish_reason`` ("stop": EOS or a stop token id; "length"). Records time to
        first token and inter-token latency.

        Raises NoCapacity when no worker can take the request before any output,
        InvalidRequest when a worker refuses it as invalid, WorkerFailed otherwise.
        Closing the generator early cancels the request on its workers.
        """
        if prep.parsed.sampling.n > 1:
            return self._choices(prep, self._choice_tokens)
        return self._choice_tokens(prep)

    def generate(self, prep: Prepared[ParsedRequest]) -> AsyncGenerator[Delta, None]:
        """Postprocess and parse on top of :meth:`tokens`: stream deltas of every
        choice's answer; a choice's last one carries ``finish_reason`` ("stop" also when
        a stop string matched, "tool_calls" when the parse stage found a complete
        call). Raises what :meth:`tokens` raises. A matched stop string closes the
        choice's token stream, which cancels the rest of its generation on the worker.
        """
        if prep.parsed.sampling.n > 1:
            return self._choices(prep, self._choice)
        return self._choice(prep)

    async def _choice_tokens(
        self, prep: Prepared[Any], index: int = 0, shared: _Choices | None = None
    ) -> AsyncGenerator[TokenDelta, None]:
        """The token stream of choice *index* (see :meth:`tokens`)."""
        first = True
        last_token_at = 0.0
        cached = 0
        generated = 0
        sampling = prep.sampling
        request = GenerateRequest(
            request_id=prep.request_id,
            model=self.model_name,
            token_ids=prep.prompt_ids,
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
        )
        if index:
            # vLLM's own children: the seed plus the index (kept in int64), and the
            # prompt's logprobs asked of choice 0 alone.
            seed = sampling.seed
            sampling = replace(
                sampling,
                prompt_logprobs=None,
                seed=None if seed is None else (seed + index + _INT64 // 2) % _INT64 - _INT64 // 2,
            )
            request = replace(request, request_id=f"{prep.request_id}.c{index}", sampling=sampling)
        dispatched = self.dispatcher.stream(
            request, None if shared is None else shared.affinity, hashes=prep.block_hashes
        )
        try:
            async with aclosing(dispatched) as chunks:
                async for chunk in chunks:
                    now = trio.current_time()
                    if n := len(chunk.token_ids):
                        if first:
                            self._check_logprobs(
                                sampling,
                                chunk.logprobs,
                                chunk.prompt_logprobs,
                                len(prep.prompt_ids),
                            )
                            if shared is not None and index == 0:
                                shared.prompt_logprobs = chunk.prompt_logprobs
                                shared.first_token.set()
                        elif sampling.logprobs is not None and chunk.logprobs is None:
                            raise WorkerFailed(_NO_LOGPROBS)
                        # One ITL sample per token after the first: a chunk's gap is
                        # shared by its tokens (the plane merges chunks that arrived
                        # together), and tokens that came with the first one came 0 s
                        # after it. Time to first token: the request's, choice 0's.
                        if first:
                            if index == 0:
                                ttft = now - prep.started
                                self.metrics.time_to_first_token_seconds.observe(ttft)
                            first = False
                            gap, n = 0.0, n - 1
                        else:
                            gap = (now - last_token_at) / n
                        for _ in range(n):
                            self.metrics.inter_token_latency_seconds.observe(gap)
                        last_token_at = now
                    generated += len(chunk.token_ids)
                    cached = max(cached, chunk.cached_tokens)
                    if chunk.finish_reason is not None or chunk.token_ids:
                        reason = chunk.finish_reason and chunk.finish_reason.value
                        if reason is not None and shared is None:  # n > 1: _choices'
                            _trace_usage(
                                self.model_name, len(prep.prompt_ids), generated, cached, reason
                            )
                        yield TokenDelta(
                            chunk.token_ids,
                            generated,
                            reason,
                            cached,
                            index,
                            chunk.logprobs,
                            chunk.prompt_logprobs,
                            final=reason is not None,
                        )
                        if reason is not None:
                            return
        finally:
            if shared is not None and index == 0:
                shared.first_token.set()  # never leave the other choices waiting
        raise WorkerFailed("the worker ended the stream without a finish reason")

    @staticmethod
    def _check_logprobs(
        sampling: SamplingParams,
        logprobs: tuple[TokenLogprobs, ...] | None,
        prompt: tuple[TokenLogprobs, ...] | None,
        prompt_len: int,
    ) -> None:
        """Raise WorkerFailed when a worker's chunk lacks the logprobs the request
        asked for: an engine that does not compute them."""
        asked_prompt = sampling.prompt_logprobs is not None
        if (sampling.logprobs is not None and logprobs is None) or (
            asked_prompt and (prompt is None or len(prompt) != prompt_len - 1)
        ):
            raise WorkerFailed(_NO_LOGPROBS)

    async def _choice(
        self, prep: Prepared[ParsedRequest], index: int = 0, shared: _Choices | None = None
    ) -> AsyncGenerator[Delta, None]:
        """Choice *index*'s deltas, postprocessed and parsed by its own
        :class:`~frontend.postprocess.choice.ChoiceStream` (see :meth:`generate`)."""
        parsed = prep.parsed
        asked = parsed.sampling.logprobs is not None
        choice: ChoiceStream | None = None
        steps = _postprocess_span(self._choice_tokens(prep, index, shared))
        async with aclosing(steps):
            async for step in steps:
                if choice is None:  # the first step: completions' echo goes first
                    post = TextPostprocessor(
                        self.tokenizer.decode,
                        stops=parsed.stop,
                        track_tokens=asked,
                        special_ids=self.tokenizer.special_ids,
                    )
                    prompt = await self._echo(prep, step, shared) if parsed.echo else None
                    choice = ChoiceStream(
                        index,
                        post,
                        texts=self.token_texts if asked else None,
                        echo=prompt,
                        parser=self._parser(prep),
                    )
                out = choice.step(step.token_ids, step.logprobs, step.finish_reason)
                if out.finish_reason is not None or out:
                    ended = out.finish_reason is not None
                    yield Delta(
                        out.text,
                        choice.completion_tokens,
                        out.finish_reason,
                        step.cached_tokens,
                        out.reasoning,
                        out.tool_calls,
                        index,
                        out.logprobs,
                        final=ended,
                        stop_sequence=post.stop_string if ended else None,
                    )
                if out.finish_reason is not None:
                    # A matched stop string ends the choice: closing its token stream
                    # cancels the rest of its generation.
                    return
        raise AssertionError("_choice_tokens() ends with a finishing delta or raises")

    async def _echo(
        self, prep: Prepared[ParsedRequest], step: TokenDelta, shared: _Choices | None
    ) -> Echo:
        """Completions' echo of the prompt, built once per request."""
        if shared is None:
            return await self._build_echo(prep, step.prompt_logprobs)
        async with shared.echo_lock:
            if shared.echo is None:
                shared.echo = await self._build_echo(prep, shared.prompt_logprobs)
            return shared.echo

    async def _build_echo(
        self, prep: Prepared[ParsedRequest], prompt_logprobs: tuple[TokenLogprobs, ...] | None
    ) -> Echo:
        prompt = completion_prompt(prep.parsed.prompt)
        texts = self.token_texts if prep.parsed.sampling.logprobs is not None else None
        work = partial(
            echo,
            prompt if isinstance(prompt, str) else None,
            prep.prompt_ids,
            partial(self.tokenizer.decode, skip_special_tokens=False),
            texts,
            prompt_logprobs,
        )
        cheap = texts is None and isinstance(prompt, str)  # no decoding at all
        if cheap or len(prep.prompt_ids) < ECHO_OFFLOAD_TOKENS:
            return work()
        return await self.pool.offload(work)

    async def _choices(
        self,
        prep: Prepared[Any],
        choice: Callable[[Prepared[Any], int, _Choices], AsyncGenerator[D, None]],
    ) -> AsyncGenerator[D, None]:
        """The deltas of the request's ``n`` choices, each from ``choice(prep, i,
        shared)`` run in the pipeline's nursery, merged as they come (see the module
        docstring): each delta's ``completion_tokens`` becomes the request's (every
        choice's), ``cached_tokens`` choice 0's, and the last one is ``final``."""
        if self._nursery is None:
            raise RuntimeError("a request for n > 1 choices needs Pipeline.run running")
        n = prep.parsed.sampling.n
        shared = _Choices()
        scopes = [trio.CancelScope() for _ in range(n)]
        ended = _Countdown(n)
        send, receive = trio.open_memory_channel[D | Exception](n)

        async def run(index: int, send: trio.MemorySendChannel[D | Exception]) -> None:
            try:
                with scopes[index], send:
                    try:
                        if index:
                            await shared.first_token.wait()
                        async with aclosing(choice(prep, index, shared)) as deltas:
                            async for delta in deltas:
                                await send.send(delta)
                    except Exception as exc:  # the request's error: its consumer raises it
                        with contextlib.suppress(trio.BrokenResourceError):
                            await send.send(exc)
            except Exception:  # a fault of this request's must not end the nursery's others
                log.exception("choice %d of request %s failed", index, prep.request_id)
            finally:
                ended.one()

        for index in range(n):
            self._nursery.start_soon(run, index, send.clone())
        send.close()
        counts, cached, reasons = [0] * n, 0, [""] * n
        finished = 0
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, Exception):
                        raise item
                    counts[item.index] = item.completion_tokens
                    if item.index == 0:
                        cached = item.cached_tokens
                    if item.finish_reason is not None:
                        reasons[item.index] = item.finish_reason
                        finished += 1
                        if finished == n:
                            _trace_usage(
                                self.model_name,
                                len(prep.prompt_ids),
                                sum(counts),
                                cached,
                                ",".join(reasons),
                            )
                    yield replace(
                        item,
                        completion_tokens=sum(counts),
                        cached_tokens=cached,
                        final=finished == n,
                    )
        finally:
            for scope in scopes:
                scope.cancel()
            with trio.move_on_after(CHOICES_CLEANUP_S, shield=True):
                await ended.wait()
        if finished < n:
            raise WorkerFailed("a choice's stream ended without a finish reason")

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
        parser = make_parser(
            tool_parser,
            choice.reasoning_parser,
            tools=parsed.tools if offered else None,
            reasoning_forced=prep.reasoning_forced,
        )
        return parser if parsed.parallel_tool_calls else OneCall(parser)


def _trace_usage(model: str, prompt: int, generated: int, cached: int, reasons: str) -> None:
    """The request's usage on its trace's span (the request's, every choice's)."""
    current_trace().span.set_many(
        {
            "gen_ai.request.model": model,
            "gen_ai.usage.input_tokens": prompt,
            "gen_ai.usage.output_tokens": generated,
            "headwater.cached_tokens": cached,
            "gen_ai.response.finish_reasons": reasons,
        }
    )


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


async def _timed(
    steps: AsyncGenerator[TokenDelta, None], parent: Span
) -> AsyncGenerator[TokenDelta, None]:
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


class _Countdown:
    """An event set once :meth:`one` was called *n* times."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._done = trio.Event()

    def one(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._done.set()

    async def wait(self) -> None:
        await self._done.wait()
