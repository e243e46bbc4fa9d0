"""DeepSeek's DSML tool calls: DeepSeek-V4 (``tool_calls``) and V3.2 (``function_calls``).

The format, as DeepSeek-V4's chat template teaches it (frontend/preprocess/deepseek_v4.py)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V3.2 wraps the invokes in ``function_calls`` instead. Spellings tolerated, as models
emit them in production: the wrapper as ``toolcalls`` or ``tool`` (V4), ``|DSML|`` with
ASCII bars, a parameter without its ``string`` attribute, an invoke without the wrapper,
a missing ``</｜DSML｜parameter>`` (the next parameter or the invoke's end closes it) and a
missing ``</｜DSML｜invoke>`` (the next invoke or the wrapper's end closes it). Text inside
the wrapper and outside an invoke is layout, dropped. An invoke without a name is dropped.

Values are typed by :func:`~.arguments.type_value`; the arguments object keeps the
parameters' order.
"""

from __future__ import annotations

import re
from enum import Enum, auto
from typing import Any

from frontend.postprocess.parsers.arguments import ToolSchemas, dumps, type_value, unwrap
from frontend.postprocess.parsers.markers import Markers
from frontend.postprocess.parsers.stream import Output, ToolFormat

__all__ = ["V4_WRAPPERS", "V32_WRAPPERS", "DsmlFormat"]

#: How "｜DSML｜" is spelled: DeepSeek's fullwidth bars, and ASCII bars seen in the wild.
_BARS = ("｜DSML｜", "|DSML|")
#: The chat template's separator before a call block, part of the opener.
SEPARATOR = "\n\n"
V4_WRAPPERS = ("tool_calls", "toolcalls", "tool")
V32_WRAPPERS = ("function_calls",)

_NAME = re.compile(r'\bname\s*=\s*(?:"([^"]*)"|([^\s"]+))')
_STRING = re.compile(r'\bstring\s*=\s*"?(true|false)', re.IGNORECASE)


class _State(Enum):
    IDLE = auto()
    BLOCK = auto()  # inside the wrapper, between invokes
    INVOKE_HEAD = auto()  # ` name="...">` of an invoke
    INVOKE = auto()  # inside an invoke, between parameters
    PARAM_HEAD = auto()  # ` name="..." string="...">` of a parameter
    VALUE = auto()  # a parameter's value
    SKIP = auto()  # inside an invoke without a name, up to its end


def _tags(form: str, names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(form.format(bars=b, name=n) for b in _BARS for n in names)


class DsmlFormat(ToolFormat):
    """DSML with the given wrapper names (:data:`V4_WRAPPERS`, :data:`V32_WRAPPERS`)."""

    def __init__(self, wrappers: tuple[str, ...], schemas: ToolSchemas) -> None:
        self._schemas = schemas
        block_open = _tags("<{bars}{name}>", wrappers)
        self._block_close = _tags("</{bars}{name}>", wrappers)
        self._invoke = _tags("<{bars}invoke", ("",))
        self._invoke_end = _tags("</{bars}invoke>", ("",))
        self._param = _tags("<{bars}parameter", ("",))
        self._param_end = _tags("</{bars}parameter>", ("",))
        self._block_open = block_open
        bare = block_open | self._invoke
        self.openers = bare | {SEPARATOR + m for m in bare}
        self.strays = self._block_close | self._invoke_end | self._param | self._param_end
        self._markers = _markers_for(wrappers, self)
        self._go(_State.IDLE)
        self._in_block = False  # the invoke was opened inside a wrapper
        self._head: list[str] = []
        self._value: list[str] = []
        self._name = ""
        self._param_name = ""
        self._param_string: bool | None = None
        self._args: dict[str, Any] = {}

    def _go(self, state: _State) -> None:
        self._state = state
        self.idle = state is _State.IDLE
        if not self.idle:
            self.live = self._markers[state]

    def open(self, opener: str, out: Output) -> None:
        opener = opener.removeprefix(SEPARATOR)
        if opener in self._block_open:
            self._in_block = True
            self._go(_State.BLOCK)
        else:
            self._in_block = False
            self._start_invoke()

    def text(self, text: str, out: Output) -> None:
        if self._state in (_State.INVOKE_HEAD, _State.PARAM_HEAD):
            self._head.append(text)
        elif self._state is _State.VALUE:
            self._value.append(text)
        # BLOCK, INVOKE, SKIP: layout between tags, dropped

    def marker(self, marker: str, out: Output) -> None:
        state = self._state
        if state is _State.INVOKE_HEAD:  # marker is ">"
            self._name = _attribute(_NAME, "".join(self._head))
            self._head.clear()
            self._go(_State.INVOKE if self._name else _State.SKIP)
        elif state is _State.PARAM_HEAD:  # marker is ">"
            head = "".join(self._head)
            self._head.clear()
            self._param_name = _attribute(_NAME, head)
            hint = _STRING.search(head)
            self._param_string = hint.group(1).lower() == "true" if hint else None
            self._go(_State.VALUE)
        elif marker in self._invoke:  # a new invoke; one left open ends here
            if state is not _State.BLOCK:
                self._close_invoke(out)
            self._start_invoke()
        elif marker in self._param:
            self._close_param()
            self._head.clear()
            self._go(_State.PARAM_HEAD)
        elif marker in self._param_end:
            self._close_param()
            self._go(_State.INVOKE)
        elif marker in self._invoke_end:
            self._close_invoke(out)
            self._go(_State.BLOCK if self._in_block else _State.IDLE)
        else:  # a wrapper's end; it also ends an invoke left open
            if state in (_State.INVOKE, _State.VALUE, _State.SKIP):
                self._close_invoke(out)
            self._go(_State.IDLE)

    def finish(self, truncated: bool, out: Output) -> None:
        if not truncated and self._state in (_State.INVOKE, _State.VALUE, _State.SKIP):
            self._close_invoke(out)
        self._go(_State.IDLE)

    def _start_invoke(self) -> None:
        self._head.clear()
        self._args = {}
        self._go(_State.INVOKE_HEAD)

    def _close_param(self) -> None:
        if self._state is not _State.VALUE:
            return
        text = "".join(self._value)
        self._value.clear()
        if self._param_name:
            types = self._schemas.types(self._name, self._param_name)
            self._args[self._param_name] = type_value(text, self._param_string, types)
        self._go(_State.INVOKE)

    def _close_invoke(self, out: Output) -> None:
        if self._state is _State.SKIP:
            return
        self._close_param()
        out.call(self._name, dumps(unwrap(self._name, self._args, self._schemas)))
        self._args = {}


def _attribute(pattern: re.Pattern[str], head: str) -> str:
    found = pattern.search(head)
    if found is None:
        return ""
    return (found.group(1) if found.group(1) is not None else found.group(2)).strip()


_MARKERS: dict[tuple[str, ...], dict[_State, Markers]] = {}


def _markers_for(wrappers: tuple[str, ...], fmt: DsmlFormat) -> dict[_State, Markers]:
    """Each state's markers, compiled once per wrapper set."""
    table = _MARKERS.get(wrappers)
    if table is None:
        close = fmt._block_close
        table = _MARKERS[wrappers] = {
            _State.BLOCK: Markers(fmt._invoke | close),
            _State.INVOKE_HEAD: Markers({">"}),
            _State.INVOKE: Markers(fmt._param | fmt._invoke | fmt._invoke_end | close),
            _State.PARAM_HEAD: Markers({">"}),
            _State.VALUE: Markers(
                fmt._param_end | fmt._param | fmt._invoke | fmt._invoke_end | close
            ),
            _State.SKIP: Markers(fmt._invoke | fmt._invoke_end | close),
        }
    return table
