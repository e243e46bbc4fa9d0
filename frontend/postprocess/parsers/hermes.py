"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes, Qwen 2.5/3 and many models served through ``--engine vllm``. One
JSON object per ``<tool_call>`` block; several blocks make several calls.

A block whose body is not a JSON object with a string ``name`` is not a call: its body
(without the tags) is returned as content, so nothing the model wrote is lost and the
client sees the attempt. ``arguments`` (or ``parameters``) is the model's JSON as is; a
string holding JSON is decoded first (some models encode twice), a string that is not
JSON is passed on as the arguments text (OpenAI's arguments are not guaranteed JSON either).
"""

from __future__ import annotations

from typing import Any

from frontend.postprocess.parsers.arguments import NOT_JSON, dumps, loads
from frontend.postprocess.parsers.markers import Markers
from frontend.postprocess.parsers.stream import Output, ToolFormat

__all__ = ["HermesFormat"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
#: Qwen's templates write a newline between content and a call.
SEPARATOR = "\n"
_BODY = Markers({CLOSE})


class HermesFormat(ToolFormat):
    """Hermes ``<tool_call>`` blocks."""

    openers = frozenset({OPEN, SEPARATOR + OPEN})
    strays = frozenset({CLOSE})
    live = _BODY

    def __init__(self) -> None:
        self.idle = True
        self._separator = ""
        self._body: list[str] = []

    def open(self, opener: str, out: Output) -> None:
        self.idle = False
        self._separator = opener.removesuffix(OPEN)
        self._body.clear()

    def text(self, text: str, out: Output) -> None:
        self._body.append(text)

    def marker(self, marker: str, out: Output) -> None:
        self._close(out)

    def finish(self, truncated: bool, out: Output) -> None:
        if not truncated:
            self._close(out)  # EOS before the closing tag: the body may be complete
        self.idle = True

    def _close(self, out: Output) -> None:
        self.idle = True
        body = "".join(self._body)
        self._body.clear()
        call = _call(body)
        if call is None:
            out.content(self._separator + body)
        else:
            out.call(*call)


def _call(body: str) -> tuple[str, str] | None:
    obj = loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        decoded = loads(args)
        if decoded is NOT_JSON:
            return obj["name"], args  # not JSON: passed on as written, as OpenAI does
        args = decoded
    return obj["name"], dumps(args)
