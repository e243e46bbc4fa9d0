"""The parse stage: reasoning and tool calls out of a model's answer text.

The contract every parser keeps is in :mod:`frontend.postprocess.parsers.base`; one
implementation (:mod:`~frontend.postprocess.parsers.stream`) runs every combination,
built by name with :func:`make_parser` (docs/api.md, "Parsers").
"""

from frontend.postprocess.parsers.base import AnswerDelta, AnswerParser, ToolCallDelta
from frontend.postprocess.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParserNames,
    check_parser_names,
    default_parsers,
    make_parser,
    prompt_ends_in_reasoning,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "AnswerDelta",
    "AnswerParser",
    "ParserNames",
    "ToolCallDelta",
    "check_parser_names",
    "default_parsers",
    "make_parser",
    "prompt_ends_in_reasoning",
]
