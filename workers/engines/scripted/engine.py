"""The scripted engine's trio shell: a prompt in, the script's answer out, token by token.

:class:`ScriptedEngine` is what a worker hosts. :meth:`~ScriptedEngine.run` loads the
script and the model's tokenizer in a thread, and encodes every answer once, before it
reports ready. Per request (:meth:`~ScriptedEngine.generate`) it reads the prompt's
ids as text (special tokens kept, so a rule may match on the chat template's markers),
finds the rule that answers (:meth:`.Script.match`) and streams that answer's tokens
(:func:`.answer_tokens`; after the tokens a migrated request's prompt ends with, as a
model goes on from there), one chunk every ``token_delay`` seconds on trio's clock, so
a test's MockClock makes the stream exact.

Reading a prompt as text costs about 0.4 us per token. Prompts up to
:data:`INLINE_MAX_TOKENS` are read on the loop, where the thread hop would cost more;
longer ones (an agent's 40k-token session: ~20 ms) in a thread, with a decode call that
releases the GIL (HF ``decode_batch``; ``decode`` holds it), so the loop stays free;
with ``threads=False`` (virtual-time tests) everything is read on the loop.

No KV: a prefill engine answers with a handle to nothing (and loads neither script nor
tokenizer), and a decode engine ignores the handle it is given and reads the whole
prompt, which every leg carries. A prompt
that no rule answers fails with ``invalid_request``: the client's 400, naming the
script, and nothing counts against the worker.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import tokenizers
import trio

from headwater.wire import Chunk, ErrorCode, GenerateRequest, KvHandle, Role
from headwater.wire.capabilities import SEED, Capabilities
from headwater.wire.tokens import token_array
from workers.engines.base import Engine, EngineContext, EngineError, EngineFailed, EngineStats
from workers.engines.scripted.answer import answer_tokens, continued
from workers.engines.scripted.config import ScriptedConfig
from workers.engines.scripted.script import Rule, Script, ScriptError, load_script
from workers.engines.scripted.tokenizer import TokenizerLoadError, load_tokenizer

#: Longest prompt (tokens) read as text on the loop: ~0.1 ms of decoding there, less
#: than a thread hop costs.
INLINE_MAX_TOKENS = 256
#: Threads reading long prompts at once, per engine.
DECODE_THREADS = 2
#: What the scripted engine honours beyond the baseline.
CAPABILITIES = Capabilities("scripted", frozenset({SEED}))


@dataclass(slots=True)
class ScriptedCounters:
    """Monotonic counters for tests and metrics (read them, never write)."""

    requests_started: int = 0
    requests_finished: int = 0  # the final chunk was handed to the consumer
    requests_cancelled: int = 0  # the consumer left before the final chunk
    requests_failed: int = 0  # ended by an EngineError (no rule answered, shutdown)
    requests_unmatched: int = 0  # no rule answered and the script has no default
    default_answers: int = 0  # answered by the default rule
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What :meth:`ScriptedEngine.run` loads: the script, the tokenizer, each rule's
    answer as token ids."""

    script: Script
    tokenizer: tokenizers.Tokenizer
    answers: dict[Rule, array[int]]


class ScriptedEngine(Engine):
    """The scripted engine in one :class:`~headwater.wire.Role`; see the module docstring.

    Start it with ``await nursery.start(engine.run)``; requests before that, or after
    :meth:`run` ended, fail with ``shutting_down``. Raises ValueError for a config
    without a script.
    """

    def __init__(
        self,
        config: ScriptedConfig,
        role: Role | str,
        worker_id: str,
        transfer_address: str = "",
    ) -> None:
        if not config.script:
            raise ValueError("the scripted engine needs a script (--script FILE)")
        self.config = config
        self.role = Role(role)
        self.worker_id = worker_id
        self.transfer_address = transfer_address or f"memory://{worker_id}"
        self.counters = ScriptedCounters()
        self._loaded: _Loaded | None = None
        self._limiter = trio.CapacityLimiter(DECODE_THREADS)
        self._answering = 0  # requests streaming their answer
        self._reading = 0  # requests whose prompt is being read
        self._started = False
        self._running = False  # between run()'s start-up and its end

    # ---- Engine API -------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """Seeds (trivially: the answer is the script's, the same for every seed) and
        nothing else: no distribution to reshape, no answer to constrain (docs/api.md,
        "Fields")."""
        return CAPABILITIES

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the script and the tokenizer (in a thread; a prefill engine needs
        neither), report ready, then wait until cancelled. May be called once. Raises
        EngineFailed when the script or the tokenizer cannot be loaded.

        HF's tokenizer parser holds the GIL in long stretches: the loop may stall for
        a few hundred ms here, at start, before the worker serves anything."""
        if self._started:
            raise RuntimeError("ScriptedEngine.run() may only be called once")
        self._started = True
        if self.role is not Role.PREFILL:  # a prefill answers nothing: it needs neither
            try:
                if self.config.threads:
                    self._loaded = await trio.to_thread.run_sync(self._load)
                else:
                    self._loaded = self._load()
            except (ScriptError, TokenizerLoadError) as exc:
                raise EngineFailed(str(exc)) from exc
        self._running = True
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            self._running = False

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        """Serve *request*; see :meth:`Engine.generate`.

        Yields one chunk per output token, the last with ``finish_reason``; a prefill
        engine yields a single token-less chunk carrying a :class:`KvHandle`. Raises
        EngineError: ``invalid_request`` (empty prompt, ``max_tokens < 1``, bad
        ``min_tokens``, no rule answers the prompt), ``shutting_down`` (not running).
        Closing or cancelling the consumer ends it at once; it holds nothing.
        """
        self._check(request)
        self.counters.requests_started += 1
        finished = failed = False
        try:
            if self._loaded is None:  # the prefill role
                await trio.lowlevel.checkpoint()
                finished = True
                self.counters.requests_finished += 1
                yield Chunk(request.request_id, [], kv_handle=self._handle(request))
                return
            answer = await self._answer(self._loaded, request.token_ids)
            self._answering += 1
            try:
                delay = self.config.token_delay
                start = trio.current_time()
                eos = request.eos_token_ids
                # A migrated request's prompt ends with the answer's first tokens: go on.
                said = continued(request.token_ids, answer, len(answer) - (not eos))
                tokens = answer_tokens(answer, request.sampling, eos, said)
                for n, (token, finish) in enumerate(tokens, start=1):
                    if delay:
                        await trio.sleep_until(start + n * delay)
                    else:
                        await trio.lowlevel.checkpoint()
                    self.counters.output_tokens += 1
                    if finish is not None:
                        finished = True
                        self.counters.requests_finished += 1
                    yield Chunk(request.request_id, [token], finish_reason=finish)
            finally:
                self._answering -= 1
        except Exception:
            failed = True
            raise
        finally:
            # Synchronous on purpose: runs under cancellation and GeneratorExit alike.
            if not finished:
                if failed:
                    self.counters.requests_failed += 1
                else:
                    self.counters.requests_cancelled += 1

    def statistics(self) -> EngineStats:
        """Requests streaming an answer (active) and reading their prompt (waiting);
        no KV."""
        return EngineStats(
            active_requests=self._answering,
            waiting_requests=self._reading,
            kv_blocks_used=0,
            kv_blocks_total=0,
        )

    # ---- request side -----------------------------------------------------------

    def _check(self, request: GenerateRequest) -> None:
        """Raises the EngineError that refuses *request*, if any."""
        if not self._running:
            raise EngineError(ErrorCode.SHUTTING_DOWN, f"{self.worker_id} is not running")
        sampling = request.sampling
        problem = None
        if not request.token_ids:
            problem = "empty prompt"
        elif sampling.max_tokens < 1:
            problem = f"max_tokens must be >= 1, got {sampling.max_tokens}"
        elif not 0 <= sampling.min_tokens <= sampling.max_tokens:
            problem = f"min_tokens must be in [0, max_tokens], got {sampling.min_tokens}"
        if problem is not None:
            raise EngineError(ErrorCode.INVALID_REQUEST, problem)

    def _handle(self, request: GenerateRequest) -> KvHandle:
        """A prefill's answer: a handle to no KV (the decode leg reads the prompt)."""
        return KvHandle(
            worker_id=self.worker_id,
            address=self.transfer_address,
            transfer_id=request.request_id,
            num_tokens=len(request.token_ids),
        )

    async def _answer(self, loaded: _Loaded, prompt: Sequence[int]) -> array[int]:
        """The token ids of the answer to *prompt*. Raises EngineError (no rule)."""
        self._reading += 1
        try:
            if len(prompt) <= INLINE_MAX_TOKENS or not self.config.threads:
                rule = _match(loaded, prompt)
            else:
                rule = await trio.to_thread.run_sync(
                    _match, loaded, prompt, limiter=self._limiter, abandon_on_cancel=True
                )
        finally:
            self._reading -= 1
        if rule is None:
            self.counters.requests_unmatched += 1
            raise EngineError(
                ErrorCode.INVALID_REQUEST,
                "The scripted engine has no answer for this prompt: no prompt_contains "
                f"of its script {loaded.script.source} occurs in it, and the script has "
                "no default line",
            )
        if rule.is_default:
            self.counters.default_answers += 1
        return loaded.answers[rule]

    # ---- loading ----------------------------------------------------------------

    def _load(self) -> _Loaded:
        """The script, the tokenizer and every answer's ids (blocking: in a thread).
        Raises ScriptError, TokenizerLoadError."""
        script = load_script(self.config.script)
        tokenizer = load_tokenizer(self.config.tokenizer)
        texts = [rule.text for rule in script.rules]
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        answers: dict[Rule, array[int]] = {}
        for rule, encoding in zip(script.rules, encodings, strict=True):
            if not encoding.ids:
                raise ScriptError(
                    f"script {script.source}, line {rule.line}: its text has no tokens"
                )
            answers[rule] = token_array(encoding.ids)
        return _Loaded(script, tokenizer, answers)


def _match(loaded: _Loaded, prompt: Sequence[int]) -> Rule | None:
    """The rule answering *prompt* (ids), read as text with its special tokens.
    ``decode_batch`` releases the GIL while it runs (``decode`` does not)."""
    (text,) = loaded.tokenizer.decode_batch([prompt], skip_special_tokens=False)
    return loaded.script.match(text)


def build_engine(config: ScriptedConfig, context: EngineContext) -> ScriptedEngine:
    """The registry's factory (:mod:`workers.engines.registry`). Raises EngineFailed
    for a config without a script."""
    try:
        return ScriptedEngine(
            config, context.role, context.worker_id, transfer_address=context.transfer_address
        )
    except ValueError as exc:
        raise EngineFailed(str(exc)) from exc
