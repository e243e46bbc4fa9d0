"""A DSML parameter's value, typed by the tool's JSON schema.

DSML writes every value as text, with a ``string="true|false"`` hint that models
sometimes leave out or get the wrong way round; the tool's schema says what the client
expects. :func:`type_value` reconciles the two and never invents: a value that fits
neither reading stays the text the model wrote.

Only a parameter's top-level type is read from its schema (``type``, a list of types,
``enum`` values, ``anyOf``/``oneOf``/``allOf``); JSON inside the value (an object's
fields, an array's items) is kept as the model wrote it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["param_types", "type_value"]

#: The JSON types a Python value has (an integral float is an integer too, as in JSON
#: Schema).
_JSON_TYPES: dict[type, frozenset[str]] = {
    bool: frozenset({"boolean"}),
    int: frozenset({"integer", "number"}),
    float: frozenset({"number"}),
    str: frozenset({"string"}),
    type(None): frozenset({"null"}),
    list: frozenset({"array"}),
    dict: frozenset({"object"}),
}
_NOT_JSON: Any = object()


def param_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a parameter's schema allows; None when it does not say."""
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
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else ():
            types |= param_types(choice) or frozenset()
    return frozenset(types) or None


def type_value(text: str, string: bool | None, types: frozenset[str] | None) -> Any:
    """One parameter's value from its text.

    ``string``: the model's ``string=`` hint (None when it left it out); ``types``: what
    the schema allows (None: no schema). A value marked as a string stays text where the
    schema allows a string. Otherwise (a non-string schema, ``string="false"``, no hint)
    the text is decoded as JSON when it decodes to a type the schema allows, or to any
    type without a schema; a schema that wants a string gets the text as written.
    Anything else stays text.
    """
    if string and (types is None or "string" in types):
        return text
    value = _loads(text)
    if value is _NOT_JSON:
        return text
    if types is None or _fits(value, types):
        return value
    if string or "string" in types:
        return text
    return value  # the schema is not met either way: the model's JSON is the better guess


def _reject(text: str) -> Any:
    raise ValueError(text)  # NaN, Infinity: not JSON, and not representable in it


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)  # 1e999: not representable in JSON either
    return value


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject, parse_float=_finite)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return _NOT_JSON


def _fits(value: Any, types: frozenset[str]) -> bool:
    if isinstance(value, float) and value.is_integer() and "integer" in types:
        return True
    return not _JSON_TYPES.get(type(value), frozenset()).isdisjoint(types)
