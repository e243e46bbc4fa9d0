"""The parsers by name, as vLLM names them (``--tool-call-parser``, ``--reasoning-parser``).

Tool-call parsers: ``deepseek_v4`` (DSML ``tool_calls``), ``deepseek_v32`` (DSML
``function_calls``), ``deepseek_v31``, ``hermes``, ``none``. Reasoning parsers:
``deepseek_v4`` (``<think>…</think>``, the answer starting inside it when the prompt
ended in ``<think>``), ``deepseek_r1`` (the same, always starting inside it, as R1's
template always opens it), ``none``.

:func:`make_parser` composes one of each into one :class:`~.base.AnswerParser`; a new
one per response stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from frontend.postprocess.parsers.arguments import ToolSchemas
from frontend.postprocess.parsers.base import AnswerParser
from frontend.postprocess.parsers.deepseek_v31 import DeepSeekV31Format
from frontend.postprocess.parsers.dsml import V4_WRAPPERS, V32_WRAPPERS, DsmlFormat
from frontend.postprocess.parsers.hermes import HermesFormat
from frontend.postprocess.parsers.stream import THINK_START, AnswerStream, ToolFormat

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParserNames",
    "check_parser_names",
    "default_parsers",
    "make_parser",
    "prompt_ends_in_reasoning",
]

_TOOL_FORMATS: dict[str, Callable[[ToolSchemas], ToolFormat] | None] = {
    "deepseek_v4": lambda schemas: DsmlFormat(V4_WRAPPERS, schemas),
    "deepseek_v32": lambda schemas: DsmlFormat(V32_WRAPPERS, schemas),
    "deepseek_v31": lambda _schemas: DeepSeekV31Format(),
    "hermes": lambda _schemas: HermesFormat(),
    "none": None,
}
#: Reasoning parser name -> whether the answer always starts inside the reasoning
#: (None: no reasoning parsing).
_REASONING: dict[str, bool | None] = {"deepseek_v4": False, "deepseek_r1": True, "none": None}

TOOL_PARSERS: tuple[str, ...] = tuple(_TOOL_FORMATS)
REASONING_PARSERS: tuple[str, ...] = tuple(_REASONING)


class ParserNames(NamedTuple):
    """A tool-call parser and a reasoning parser, by name."""

    tool: str
    reasoning: str


def check_parser_names(tool_parser: str, reasoning_parser: str) -> None:
    """Raises ValueError naming the valid choices for an unknown name."""
    if tool_parser not in _TOOL_FORMATS:
        raise ValueError(
            f"unknown tool-call parser {tool_parser!r}; valid: {', '.join(TOOL_PARSERS)}"
        )
    if reasoning_parser not in _REASONING:
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r}; "
            f"valid: {', '.join(REASONING_PARSERS)}"
        )


def make_parser(
    tool_parser: str = "none",
    reasoning_parser: str = "none",
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_forced: bool = False,
) -> AnswerParser:
    """One response stream's parser: reasoning first, then tool calls.

    ``tools``: the request's OpenAI tool definitions, whose schemas type DSML arguments.
    ``reasoning_forced``: the prompt ended inside ``<think>`` (see
    :func:`prompt_ends_in_reasoning`), so the answer starts as reasoning.

    Raises ValueError for an unknown parser name (see :func:`check_parser_names`).
    """
    check_parser_names(tool_parser, reasoning_parser)
    factory = _TOOL_FORMATS[tool_parser]
    fmt = factory(ToolSchemas(tools)) if factory is not None else None
    always = _REASONING[reasoning_parser]
    return AnswerStream(
        fmt, reasoning=always is not None, reasoning_forced=bool(always) or reasoning_forced
    )


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the answer inside ``<think>``: DeepSeek-V4's
    thinking mode ends it with ``<｜Assistant｜><think>``, R1-style templates with
    ``<think>\\n``. Reads the prompt's last characters only."""
    return prompt[-64:].rstrip().endswith(THINK_START)


def default_parsers(template: object) -> ParserNames:
    """The parsers a model's chat renderer implies: DeepSeek-V4's built-in one gets
    ``deepseek_v4`` for both; any other (a model's own jinja template) gets none, as
    vLLM parses nothing unless told."""
    # Imported here: the parse stage does not otherwise depend on the preprocessing.
    from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate

    if isinstance(template, DeepSeekV4ChatTemplate):
        return ParserNames("deepseek_v4", "deepseek_v4")
    return ParserNames("none", "none")
