"""The parse stage: reasoning and tool calls out of a model's answer text.

The contract every parser keeps is in :mod:`frontend.postprocess.parsers.base`.
"""

from frontend.postprocess.parsers.base import AnswerDelta, AnswerParser, ToolCallDelta
from frontend.postprocess.parsers.registry import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    check_names,
    make_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "AnswerDelta",
    "AnswerParser",
    "ToolCallDelta",
    "check_names",
    "make_parser",
]
