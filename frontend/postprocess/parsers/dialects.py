"""The tool-call formats models write, as data: markers, and how a call's body reads.

Every format is the same shape, so one state machine (:mod:`.stream`) parses them all::

    [block start]  call start  NAME  name end  BODY  call end  ...  [block end]

- DeepSeek-V4's DSML (``deepseek_v4``)::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  with what models write in production besides: the block's spelling variants
  (``toolcalls``, ``tool``), an invoke without its block, an invoke tag spaced
  differently (``<｜DSML｜invoke  name="f" >``), and a parameter whose ``string``
  attribute is missing or wrong (the tool's schema types it: :mod:`.arguments`).
- DeepSeek-V3.2's DSML (``deepseek_v32``): the same, in a ``function_calls`` block.
- DeepSeek-V3.1's (``deepseek_v31``)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
      <｜tool▁call▁end｜><｜tool▁calls▁end｜>

- hermes (``hermes``, Qwen's and many others'): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, with no block and the name inside the JSON body.

A body becomes ``(name, arguments JSON)`` through the dialect's ``read``; None means the
body is not a call. A hermes body is then kept as content (the model's JSON, its words not
lost); a DSML or V3.1 one is markup (an invoke without a name), dropped. Markup never
reaches the content, and neither does a stray closer met outside a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from frontend.postprocess.parsers.arguments import param_types, type_value

#: A tool's parameter schemas by tool name: ``{"get_weather": {"city": {...}, ...}}``.
Schemas = Mapping[str, Mapping[str, Any]]

#: Reads a call: (name from the markers or "", raw body, schemas) → (name, arguments
#: JSON), or None when it is not a call.
Reader = Callable[[str, str, Schemas], "tuple[str, str] | None"]


@dataclass(frozen=True, slots=True)
class Dialect:
    """One tool-call format; see the module docstring."""

    name: str
    call_start: str
    call_end: str
    read: Reader
    name_end: str | None = None  # None: the name is in the body (hermes)
    block_starts: tuple[str, ...] = ()  # empty: calls stand alone in the text
    block_ends: tuple[str, ...] = ()
    # Markers that end an open call too (a model that forgot the call's own end).
    call_ends_also: tuple[str, ...] = ()
    # A call start outside a block opens a call too (a model that left the block out).
    bare_calls: bool = False
    # Markers that mean nothing outside a call (a stray closer): dropped there, as markup.
    strays: tuple[str, ...] = ()
    # A body that reads as no call is the model's text (hermes' JSON): it becomes content.
    # Otherwise it is markup (DSML's parameters), and dropped.
    body_is_text: bool = False


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- DSML --------------------------------------------------------------------------------

_DSML = "｜DSML｜"
_INVOKE_NAME = re.compile(r'\bname\s*=\s*(?:"([^"]*)"|([^\s"]+))')
_PARAM = re.compile(
    rf'<{_DSML}parameter\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>'
    rf"(.*?)(?:</{_DSML}parameter>|(?=<{_DSML}parameter\s+name=)|\Z)",
    re.DOTALL,
)


def _string_hint(attribute: str | None) -> bool | None:
    return None if attribute is None else attribute.strip().lower() == "true"


def _unwrap(args: dict[str, Any], properties: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments a model wrapped in one ``arguments``/``input`` key the tool does not
    have, unwrapped when what is inside matches the tool's parameters."""
    for wrapper in ("arguments", "input"):
        if set(args) != {wrapper} or wrapper in properties:
            continue
        inner = args[wrapper]
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                return args
        if isinstance(inner, dict) and set(inner) <= set(properties):
            return inner
    return args


def read_dsml(head: str, body: str, schemas: Schemas) -> tuple[str, str] | None:
    """*head*: the invoke tag's attributes (`` name="get_weather"``), read leniently, as
    models space them; *body*: its parameters, typed by the tool's schema
    (:func:`~.arguments.type_value`)."""
    found = _INVOKE_NAME.search(head)
    name = (found.group(1) if found.group(1) is not None else found.group(2)) if found else ""
    name = name.strip()
    if not name:
        return None
    params = schemas.get(name, {})
    args: dict[str, Any] = {}
    for m in _PARAM.finditer(body):
        param, string, raw = m.group(1), m.group(2), m.group(3)
        args[param] = type_value(raw, _string_hint(string), param_types(params.get(param)))
    if properties := schemas.get(name):
        args = _unwrap(args, properties)
    return name, _dumps(args)


DEEPSEEK_V4 = Dialect(
    name="deepseek_v4",
    block_starts=(f"<{_DSML}tool_calls>", f"<{_DSML}toolcalls>", f"<{_DSML}tool>"),
    block_ends=(f"</{_DSML}tool_calls>", f"</{_DSML}toolcalls>", f"</{_DSML}tool>"),
    call_start=f"<{_DSML}invoke",
    name_end=">",
    call_end=f"</{_DSML}invoke>",
    call_ends_also=(f"</{_DSML}tool_calls>",),
    bare_calls=True,
    strays=(
        f"</{_DSML}tool_calls>",
        f"</{_DSML}toolcalls>",
        f"</{_DSML}tool>",
        f"</{_DSML}invoke>",
        f"</{_DSML}parameter>",
    ),
    read=read_dsml,
)

DEEPSEEK_V32 = Dialect(
    name="deepseek_v32",
    block_starts=(f"<{_DSML}function_calls>",),
    block_ends=(f"</{_DSML}function_calls>",),
    call_start=f"<{_DSML}invoke",
    name_end=">",
    call_end=f"</{_DSML}invoke>",
    call_ends_also=(f"</{_DSML}function_calls>",),
    bare_calls=True,
    strays=(f"</{_DSML}function_calls>", f"</{_DSML}invoke>", f"</{_DSML}parameter>"),
    read=read_dsml,
)


# -- JSON bodies ---------------------------------------------------------------------------


def _typed_json(name: str, args: Any) -> tuple[str, str] | None:
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, _dumps(args)


def read_v31(name: str, body: str, schemas: Schemas) -> tuple[str, str] | None:
    """A named call is a call: arguments that are not a JSON object are passed on as
    written (OpenAI's arguments are not guaranteed JSON either)."""
    name = name.strip()
    if not name:
        return None
    try:
        args = json.loads(body)
    except ValueError:
        return name, body.strip()
    return _typed_json(name, args) or (name, body.strip())


def read_hermes(_: str, body: str, schemas: Schemas) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    return _typed_json(call["name"], call.get("arguments", {}))


DEEPSEEK_V31 = Dialect(
    name="deepseek_v31",
    block_starts=("<｜tool▁calls▁begin｜>",),
    block_ends=("<｜tool▁calls▁end｜>",),
    call_start="<｜tool▁call▁begin｜>",
    name_end="<｜tool▁sep｜>",
    call_end="<｜tool▁call▁end｜>",
    call_ends_also=("<｜tool▁calls▁end｜>",),
    strays=("<｜tool▁calls▁end｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    read=read_v31,
)

HERMES = Dialect(
    name="hermes",
    call_start="<tool_call>",
    call_end="</tool_call>",
    strays=("</tool_call>",),
    body_is_text=True,
    read=read_hermes,
)

DIALECTS: dict[str, Dialect] = {
    d.name: d for d in (DEEPSEEK_V4, DEEPSEEK_V32, DEEPSEEK_V31, HERMES)
}
