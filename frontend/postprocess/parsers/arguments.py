"""Tool-call arguments typed by the request's tool schemas.

DSML writes every parameter as text, with a ``string="true|false"`` hint that models
sometimes leave out or get wrong; the tool's JSON schema says what the client expects.
:func:`type_value` reconciles the two, and never invents: a value that fits neither
reading stays the text the model wrote.

Only a parameter's top-level type is read from the schema (``type``, a list of types,
``enum`` values, ``anyOf``/``oneOf``/``allOf``); values inside a JSON object or array
are the model's JSON, kept as written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["NOT_JSON", "ToolSchemas", "dumps", "loads", "type_value", "unwrap"]

#: JSON types a Python value has (an integral float is also an integer, as in JSON Schema).
_JSON_TYPES: dict[type, frozenset[str]] = {
    bool: frozenset({"boolean"}),
    int: frozenset({"integer", "number"}),
    float: frozenset({"number"}),
    str: frozenset({"string"}),
    type(None): frozenset({"null"}),
    list: frozenset({"array"}),
    dict: frozenset({"object"}),
}
# Wrappers a model sometimes puts the whole arguments object in (DeepSeek's own encoder
# renders unparseable arguments as {"arguments": ...}).
_WRAPPERS = ("arguments", "input")


def dumps(value: Any) -> str:
    """JSON as OpenAI's arguments strings look: ``{"a": 1}``, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


class ToolSchemas:
    """The parameter schemas of a request's tools, by tool name.

    ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {"name",
    "parameters"}}``); entries of another shape are ignored, as the template that
    rendered them decided what the model saw.
    """

    __slots__ = ("_properties",)

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._properties: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                continue
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            if isinstance(props, Mapping):
                self._properties.setdefault(fn["name"], props)

    def properties(self, tool: str) -> Mapping[str, Any] | None:
        """The tool's parameter schemas, None when the tool or its schema is unknown."""
        return self._properties.get(tool)

    def types(self, tool: str, param: str) -> frozenset[str] | None:
        """The JSON types a parameter may take; None when the schema does not say."""
        props = self._properties.get(tool)
        if props is None:
            return None
        return _schema_types(props.get(param))


def _schema_types(schema: Any) -> frozenset[str] | None:
    if not isinstance(schema, Mapping):
        return None
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    if isinstance(schema.get("enum"), list):
        for value in schema["enum"]:
            types |= _JSON_TYPES.get(type(value), frozenset())
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or ():
            types |= _schema_types(choice) or frozenset()
    return frozenset(types) or None


#: What :func:`loads` returns for text that is not JSON.
NOT_JSON: Any = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN, Infinity: not JSON, and not representable in it


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)  # 1e999: not representable in JSON
    return value


def loads(text: str) -> Any:
    """The JSON value ``text`` holds, or ``NOT_JSON``."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return NOT_JSON


def _fits(value: Any, types: frozenset[str]) -> bool:
    if isinstance(value, float) and value.is_integer() and "integer" in types:
        return True
    return not _JSON_TYPES.get(type(value), frozenset()).isdisjoint(types)


def type_value(text: str, string: bool | None, types: frozenset[str] | None) -> Any:
    """One parameter's value.

    ``string``: the model's ``string=`` hint (None when it left it out); ``types``:
    what the schema allows (None: no schema). A value the model marked as a string
    stays text where the schema allows a string; otherwise (a non-string schema, a
    ``string="false"`` hint, no hint) the text is decoded as JSON when it decodes to
    something the schema allows, or to anything when there is no schema. A schema
    that wants a string gets the text as written. Anything else stays text.
    """
    if string and (types is None or "string" in types):
        return text
    value = loads(text)
    if value is NOT_JSON:
        return text
    if types is None or _fits(value, types):
        return value
    if string or "string" in types:
        return text
    return value  # the schema is not met either way; the model's JSON is the better guess


def unwrap(tool: str, args: dict[str, Any], schemas: ToolSchemas) -> dict[str, Any]:
    """Undo a wrapper: ``{"arguments": {...}}`` (or ``input``) as the only parameter,
    when the tool has no such parameter and the wrapped object's keys are the tool's."""
    props = schemas.properties(tool)
    if not props or len(args) != 1:
        return args
    (key, inner), = args.items()
    if key not in _WRAPPERS or key in props:
        return args
    if isinstance(inner, str):
        inner = loads(inner)
    if isinstance(inner, dict) and inner.keys() <= props.keys():
        return inner
    return args
