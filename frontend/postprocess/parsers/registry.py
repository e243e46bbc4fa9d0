"""The parsers by vLLM's names (``--tool-call-parser``, ``--reasoning-parser``), and the
one factory the pipeline calls per response stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend.postprocess.parsers.base import AnswerParser
from frontend.postprocess.parsers.dialects import DIALECTS
from frontend.postprocess.parsers.stream import StreamParser

#: Tool-call parsers: a dialect each, or none.
TOOL_CALL_PARSERS: tuple[str, ...] = (*DIALECTS, "none")
#: Reasoning parsers: each reads ``<think>…</think>`` (DeepSeek-V4's and R1's), or none.
REASONING_PARSERS: tuple[str, ...] = ("deepseek_v4", "deepseek_r1", "qwen3", "none")


def check_names(tool_call_parser: str, reasoning_parser: str) -> None:
    """Raises ValueError naming the known parsers for an unknown one."""
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}"
        )
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_PARSERS)}"
        )


def make_parser(
    tool_call_parser: str,
    reasoning_parser: str,
    *,
    tools: Sequence[Any] | None = None,
    reasoning_forced: bool = False,
) -> AnswerParser:
    """One response stream's parser. *tools*: the request's (their schemas type the
    arguments); ``reasoning_forced``: the prompt ends inside the reasoning. Raises
    ValueError for an unknown name."""
    check_names(tool_call_parser, reasoning_parser)
    return StreamParser(
        DIALECTS.get(tool_call_parser),
        reasoning=reasoning_parser != "none",
        tools=tools,
        reasoning_forced=reasoning_forced,
    )
