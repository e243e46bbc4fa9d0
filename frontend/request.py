"""The frontend's request model: what the pipeline needs to know of a request.

The HTTP layer (:mod:`frontend.http.schema`) validates a body into one of two requests,
and the pipeline takes it from there and never sees JSON:

- :class:`ParsedRequest`: an OpenAI chat or completions request (text in, text out;
  a completions prompt may be token ids).
- :class:`TokenRequest`: a token-in request (``POST /inference/v1/generate``, vLLM's
  shape): token ids in, token ids out, with no template, tokenizer or detokenizer.

Both carry the client's generation options as one :class:`SamplingOptions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from headwater.wire import StructuredOutput


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How to generate, as the client asked; the pipeline turns these into the engine's
    :class:`~headwater.wire.SamplingParams` once it knows the prompt's length."""

    max_tokens: int | None = None  # None: as many as the context length leaves room for
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    #: Choices to generate, each with its own sampling (and seed, derived from ``seed``).
    n: int = 1
    #: Each generated token's logprob and this many most likely tokens at its place
    #: (0: the token's own only). None: no logprobs.
    logprobs: int | None = None
    #: The same for the prompt's tokens (completions' ``echo`` with ``logprobs``, the
    #: token-in API's ``prompt_logprobs``). None: none.
    prompt_logprobs: int | None = None
    # Beyond the baseline: engines honour these as they declare
    # (headwater.wire.capabilities); the defaults ask for nothing.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The token-in API's structured output, as asked; an OpenAI request's comes from
    # its Constraint once the prompt is rendered.
    structured: StructuredOutput | None = None


@dataclass(frozen=True, slots=True)
class Constraint:
    """What an OpenAI answer must be, by constrained decoding (engines that declare
    structured outputs): ``kind`` "json_object", "json_schema" (``schema``),
    "tool_calls" (``tool_choice: "required"``: one or more calls of ``tools``, every
    offered tool's name) or "tool_call" (a named function: one call of ``tools``' one
    name). ``param`` is the field that asked, as errors name it."""

    kind: str
    param: str
    schema: Mapping[str, Any] | None = None
    tools: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated chat or completions request."""

    endpoint: str  # "chat" | "completions"
    model: str
    messages: list[Any] | None = None  # chat
    prompt: Any = None  # completions: str or list of token ids
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop: tuple[str, ...] = ()  # stop strings: matched on the text, by the frontend
    user: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    # None: not given ("auto" when there are tools, as OpenAI's)
    tool_choice: Any = None
    #: Characters of text counted against --max-prompt-chars (messages, tools, template
    #: kwargs; or the prompt); None: not counted (a request built without the parser).
    text_chars: int | None = None
    echo: bool = False  # completions: the prompt's text (and logprobs) before the answer's
    add_generation_prompt: bool = True  # chat: open the assistant's turn after the last one
    parallel_tool_calls: bool = True  # False: at most one tool call
    constraint: Constraint | None = None
    reasoning_effort: str | None = None  # chat: to the template (see Pipeline.preprocess)
    suffix: str | None = None  # completions: fill in the middle, before this
    #: The declared features the request asks for, each with the field asking for it
    #: (as errors name it): what the pipeline checks against the workers before dispatch.
    needs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """A validated token-in request: the prompt's ids go to the workers as they are and
    the generated ids come back as they are (no text, so no stop strings)."""

    token_ids: list[int]  # non-empty, each >= 0; the pipeline checks the vocabulary
    request_id: str | None = None  # the client's name for the request; None: none given
    model: str | None = None  # None: the model this frontend serves
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    needs: tuple[tuple[str, str], ...] = ()  # as ParsedRequest's
