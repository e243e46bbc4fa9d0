"""What a request asks beyond its prompt, honoured or refused before dispatch.

The pipeline calls these in its preprocess stage, before any worker sees the request:

* :func:`check_honoured`: every declared feature the request asks for (``top_k``,
  structured outputs, ...: ``ParsedRequest.needs``) is honoured by every worker that
  could serve it, else a 400 naming the field and the engine that cannot
  (:mod:`headwater.wire.capabilities`). A forced tool call also needs a tool-call
  format the answer can be held to (:mod:`frontend.preprocess.structured`).
* :func:`template_kwargs`: a top-level ``reasoning_effort`` goes to the chat template as
  vLLM passes it (the ``reasoning_effort`` switch, and ``enable_thinking`` unless
  ``none``), and is refused by a template that reads neither.
* :func:`fill_in_middle`: a completions ``suffix`` frames the prompt for
  fill-in-the-middle with the tokenizer's own FIM tokens (DeepSeek's), and is refused
  by a tokenizer without them.
* :class:`OneCall`: ``parallel_tool_calls: false`` keeps an answer's first tool call
  (an engine that constrains the answer writes no other).

Pure functions over what the pipeline holds; each raises
:class:`~frontend.errors.InvalidRequest` (a 400) naming the field.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import InvalidRequest
from frontend.postprocess.parsers import AnswerDelta, AnswerParser
from frontend.preprocess.structured import TOOL_CALL_FORMATS
from frontend.preprocess.template import ChatTemplate
from frontend.preprocess.tokenizer import Tokenizer
from frontend.request import ParsedRequest
from frontend.router import Router
from headwater.wire.capabilities import STRUCTURED_OUTPUTS

#: DeepSeek's fill-in-the-middle tokens: the prompt before the hole, the hole, the end
#: of the suffix after it; the model writes the middle.
FIM_BEGIN, FIM_HOLE, FIM_END = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"
#: How a refusal words a feature that another field asked for.
_WHAT = {STRUCTURED_OUTPUTS: "constrained decoding, structured outputs"}


def check_honoured(
    needs: tuple[tuple[str, str], ...], router: Router, model: str, tool_call_parser: str
) -> None:
    """Raise InvalidRequest, naming the field, for the first of *needs* (feature, field)
    that a worker serving *model* does not declare; or for a forced tool call (its
    field ``tool_choice``) with no tool-call format to hold the answer to. Workers not
    known yet are not asked: dispatch waits for them, and they refuse it themselves."""
    for feature, param in needs:
        lacking = router.lacking(model, feature)
        if lacking is not None:
            what = _WHAT.get(feature, feature.replace("_", " "))
            why = "" if param.endswith(feature) else f" (it needs {what})"
            raise InvalidRequest(
                f"'{param}' is not supported by {lacking.describe()}{why}", param=param
            )
        if param == "tool_choice" and tool_call_parser not in TOOL_CALL_FORMATS:
            raise InvalidRequest(
                "'tool_choice' forces a tool call, which needs a tool-call parser whose "
                f"format the answer can be held to ({', '.join(TOOL_CALL_FORMATS)}); this "
                f"server's is {tool_call_parser!r} (--tool-call-parser)",
                param=param,
            )


def template_kwargs(parsed: ParsedRequest, template: ChatTemplate) -> dict[str, Any]:
    """The chat template's switches for *parsed*: its ``chat_template_kwargs``, with a
    top-level ``reasoning_effort`` added as vLLM adds it. Keys the client set in
    ``chat_template_kwargs`` win (they are the more specific ask)."""
    kwargs = parsed.chat_template_kwargs
    effort = parsed.reasoning_effort
    if effort is None:
        return kwargs
    if not (template.reads("reasoning_effort") or template.reads("enable_thinking")):
        raise InvalidRequest(
            "'reasoning_effort' is not supported by this model's chat template (it reads "
            "neither reasoning_effort nor enable_thinking)",
            param="reasoning_effort",
        )
    return {"reasoning_effort": effort, "enable_thinking": effort != "none", **kwargs}


def fill_in_middle(prompt: str | list[int], suffix: str, tokenizer: Tokenizer) -> str:
    """*prompt* framed so that the model writes what goes between it and *suffix*:
    ``<｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>``, DeepSeek's format.
    Raises InvalidRequest for a prompt of token ids or a tokenizer without FIM tokens."""
    if not isinstance(prompt, str):
        raise InvalidRequest("'suffix' needs a text prompt, not token ids", param="suffix")
    if any(tokenizer.token_to_id(t) is None for t in (FIM_BEGIN, FIM_HOLE, FIM_END)):
        raise InvalidRequest(
            "'suffix' is not supported: this model's tokenizer has no fill-in-the-middle tokens",
            param="suffix",
        )
    return f"{FIM_BEGIN}{prompt}{FIM_HOLE}{suffix}{FIM_END}"


class OneCall(AnswerParser):
    """*parser*, with every tool call after the answer's first dropped: what
    ``parallel_tool_calls: false`` asks when the engine did not hold the answer to one."""

    def __init__(self, parser: AnswerParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> AnswerDelta:
        return self._first(self._parser.feed(text))

    def finish(self, *, truncated: bool = False) -> AnswerDelta:
        return self._first(self._parser.finish(truncated=truncated))

    @property
    def tool_calls_made(self) -> int:
        return min(1, self._parser.tool_calls_made)

    @staticmethod
    def _first(out: AnswerDelta) -> AnswerDelta:
        if all(call.index == 0 for call in out.tool_calls):
            return out
        calls = tuple(call for call in out.tool_calls if call.index == 0)
        return AnswerDelta(out.content, out.reasoning, calls)
