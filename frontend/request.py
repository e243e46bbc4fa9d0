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

from dataclasses import dataclass, field
from typing import Any


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
