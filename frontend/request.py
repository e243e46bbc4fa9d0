"""The frontend's request model: what the pipeline needs to know of a request.

The HTTP layer (:mod:`frontend.http.schema`) validates an OpenAI body into a
:class:`ParsedRequest`; the pipeline takes it from there and never sees JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated chat or completions request."""

    endpoint: str  # "chat" | "completions"
    model: str
    messages: list[Any] | None = None  # chat
    prompt: Any = None  # completions: str or list of token ids
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
