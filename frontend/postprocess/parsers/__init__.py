"""The parse stage: reasoning and tool calls out of a model's answer text.

The contract every parser keeps is in :mod:`frontend.postprocess.parsers.base`.
"""

from frontend.postprocess.parsers.base import AnswerDelta, AnswerParser, ToolCallDelta

__all__ = ["AnswerDelta", "AnswerParser", "ToolCallDelta"]
