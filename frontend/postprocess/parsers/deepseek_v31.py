"""DeepSeek V3.1's tool calls: special-token delimited, JSON arguments.

::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line in the model's output; broken here to fit).

Several ``tool▁call`` blocks inside one ``tool▁calls`` block make several calls; a call
block without the outer one is accepted too, and ``<｜tool▁calls▁end｜>`` closes a call
left open. Arguments that are JSON are passed on normalised
(``json.dumps``); arguments that are not are passed on as written, as OpenAI does (its
arguments are not guaranteed JSON either). A call without a name is dropped.
"""

from __future__ import annotations

from enum import Enum, auto

from frontend.postprocess.parsers.arguments import NOT_JSON, dumps, loads
from frontend.postprocess.parsers.markers import Markers
from frontend.postprocess.parsers.stream import Output, ToolFormat

__all__ = ["DeepSeekV31Format"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class _State(Enum):
    IDLE = auto()
    BLOCK = auto()  # between calls
    NAME = auto()
    ARGS = auto()


_MARKERS = {
    _State.BLOCK: Markers({CALL_BEGIN, CALLS_END}),
    _State.NAME: Markers({SEP, CALL_END, CALLS_END, CALL_BEGIN}),
    _State.ARGS: Markers({CALL_END, CALLS_END, CALL_BEGIN}),
}


class DeepSeekV31Format(ToolFormat):
    """DeepSeek V3.1 ``<｜tool▁calls▁begin｜>`` blocks."""

    openers = frozenset({CALLS_BEGIN, CALL_BEGIN})
    strays = frozenset({CALLS_END, CALL_END, SEP})

    def __init__(self) -> None:
        self._go(_State.IDLE)
        self._in_block = False
        self._name: list[str] = []
        self._args: list[str] = []

    def _go(self, state: _State) -> None:
        self._state = state
        self.idle = state is _State.IDLE
        if not self.idle:
            self.live = _MARKERS[state]

    def open(self, opener: str, out: Output) -> None:
        self._in_block = opener == CALLS_BEGIN
        if self._in_block:
            self._go(_State.BLOCK)
        else:
            self._start()

    def text(self, text: str, out: Output) -> None:
        if self._state is _State.NAME:
            self._name.append(text)
        elif self._state is _State.ARGS:
            self._args.append(text)

    def marker(self, marker: str, out: Output) -> None:
        if marker == SEP:
            self._go(_State.ARGS)
            return
        if self._state in (_State.NAME, _State.ARGS):
            self._close(out)
        if marker == CALL_BEGIN:
            self._start()
        elif marker == CALL_END and self._in_block:
            self._go(_State.BLOCK)
        else:
            self._go(_State.IDLE)

    def finish(self, truncated: bool, out: Output) -> None:
        if not truncated and self._state in (_State.NAME, _State.ARGS):
            self._close(out)
        self._go(_State.IDLE)

    def _start(self) -> None:
        self._name.clear()
        self._args.clear()
        self._go(_State.NAME)

    def _close(self, out: Output) -> None:
        name = "".join(self._name).strip()
        raw = "".join(self._args).strip()
        self._name.clear()
        self._args.clear()
        if not name:
            return
        value = loads(raw) if raw else {}
        out.call(name, raw if value is NOT_JSON else dumps(value))
