"""Constrained decoding for OpenAI's ``response_format`` and ``tool_choice``: the engine's
:class:`~headwater.wire.StructuredOutput` for what a request asks (its
:class:`~frontend.request.Constraint`).

* ``response_format``: ``json_object`` and ``json_schema`` become vLLM's ``json_object``
  and ``json`` (the schema). When the prompt ends inside the model's reasoning
  (DeepSeek-V4's thinking mode), the constraint must not hold the reasoning to JSON:
  the answer is then "any text up to ``</think>``, then the JSON", as a structural tag.
* ``tool_choice: "required"`` and a named function become a structural tag in the
  model's *own* tool-call format, the one the parse stage reads (DSML for DeepSeek-V4):
  the model writes its native call, constrained to the offered tools' names and
  parameter schemas, and the answer is parsed like any other. This is what vLLM asks of
  xgrammar for the same models (its builtin structural tags; ``tests/test_structured.py``
  compares the two), built here as data so that the frontend needs no grammar library.
  ``parallel_tool_calls: false`` lets one call through.

Structural tags are xgrammar's format (a JSON document: ``{"type": "structural_tag",
"format": ...}``); each tool-call format below is its call markers around the
parameters' JSON schema (written in DSML's ``parameter`` tags for DeepSeek's, as JSON
for the others). Pure functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from frontend.request import Constraint
from headwater.wire import StructuredKind, StructuredOutput

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_DSML = "｜DSML｜"

Format = dict[str, Any]


class ConstraintError(ValueError):
    """The constraint cannot be built for this server (no tool-call format to hold the
    answer to); the message says why, for a 400."""


def structured_output(
    constraint: Constraint,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_call_parser: str,
    reasoning_forced: bool,
    parallel_tool_calls: bool = True,
) -> StructuredOutput:
    """The engine's constraint for *constraint*. *tools* are the request's (OpenAI's
    shape), *tool_call_parser* the parse stage's format (vLLM's name), and
    ``reasoning_forced`` says the prompt ends inside the reasoning. Raises
    ConstraintError when a tool call is asked and *tool_call_parser* has no format here.
    """
    if constraint.kind in ("tool_calls", "tool_call"):
        build = TOOL_CALL_FORMATS.get(tool_call_parser)
        if build is None:
            raise ConstraintError(
                "a forced tool call needs a tool-call parser whose format the answer can "
                f"be held to ({', '.join(TOOL_CALL_FORMATS)}); this server's is "
                f"{tool_call_parser!r} (--tool-call-parser)"
            )
        schemas = {name: _parameters(tools, name) for name in constraint.tools}
        named = constraint.kind == "tool_call"
        fmt = build(schemas, named=named, single=not parallel_tool_calls)
        return _tag(_after_reasoning(fmt) if reasoning_forced else fmt)
    schema: Any = constraint.schema if constraint.kind == "json_schema" else None
    if reasoning_forced:
        body = {"type": "json_schema", "json_schema": schema or {"type": "object"}}
        return _tag(_after_reasoning(body))
    if schema is None:
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    return StructuredOutput(StructuredKind.JSON, json.dumps(schema, ensure_ascii=False))


def _tag(fmt: Format) -> StructuredOutput:
    doc = {"type": "structural_tag", "format": fmt}
    return StructuredOutput(StructuredKind.STRUCTURAL_TAG, json.dumps(doc, ensure_ascii=False))


def _after_reasoning(fmt: Format) -> Format:
    """Free reasoning up to ``</think>``, then *fmt* (xgrammar's ``reasoning=True``)."""
    reasoning = {
        "type": "tag",
        "begin": "",
        "end": THINK_CLOSE,
        "content": {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]},
    }
    return {"type": "sequence", "elements": [reasoning, fmt]}


def _parameters(tools: Sequence[Mapping[str, Any]] | None, name: str) -> Any:
    """The JSON schema of tool *name*'s arguments; ``true`` (anything) when it has none."""
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            params = function.get("parameters")
            return params if isinstance(params, Mapping) and params else True
    return True


def _calls(tags: list[Format], *, named: bool, single: bool) -> Format:
    """The one tag of the named function, else one or more of *tags* (one if *single*)."""
    if named:
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": single,
    }


def _schema(schema: Any, style: str) -> Format:
    return {"type": "json_schema", "json_schema": schema, "style": style}


def _dsml(block: str) -> Callable[..., Format]:
    """DeepSeek's DSML (V4's ``tool_calls`` block, V3.2's ``function_calls``)."""

    def build(schemas: Mapping[str, Any], *, named: bool, single: bool) -> Format:
        tags: list[Format] = [
            {
                "type": "tag",
                "begin": f'<{_DSML}invoke name="{name}">\n',
                "content": _schema(schema, "deepseek_xml"),
                "end": f"</{_DSML}invoke>\n",
            }
            for name, schema in schemas.items()
        ]
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"\n\n<{_DSML}{block}>\n"},
                _calls(tags, named=named, single=single),
                {"type": "const_string", "value": f"</{_DSML}{block}>"},
            ],
        }

    return build


def _deepseek_v31(schemas: Mapping[str, Any], *, named: bool, single: bool) -> Format:
    tags: list[Format] = [
        {
            "type": "tag",
            "begin": f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
            "content": _schema(schema, "json"),
            "end": "<｜tool▁call▁end｜>",
        }
        for name, schema in schemas.items()
    ]
    if named:  # the block's markers join the one call's
        (tag,) = tags
        return {
            **tag,
            "begin": "<｜tool▁calls▁begin｜>" + tag["begin"],
            "end": tag["end"] + "<｜tool▁calls▁end｜>",
        }
    return {
        "type": "tag",
        "begin": "<｜tool▁calls▁begin｜>",
        "end": "<｜tool▁calls▁end｜>",
        "content": _calls(tags, named=named, single=single),
    }


def _hermes(schemas: Mapping[str, Any], *, named: bool, single: bool) -> Format:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, with or without the
    newlines around the JSON, as vLLM's hermes tag allows."""
    tags: list[Format] = [
        {
            "type": "tag",
            "begin": f'{begin}{name}", "arguments": ',
            "content": _schema(schema, "json"),
            "end": end,
        }
        for name, schema in schemas.items()
        for begin, end in (
            ('<tool_call>\n{"name": "', "}\n</tool_call>"),
            ('<tool_call>{"name": "', "}</tool_call>"),
        )
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": single or named,
    }


#: The tool-call formats an answer can be held to, by the parse stage's dialect names.
TOOL_CALL_FORMATS: dict[str, Callable[..., Format]] = {
    "deepseek_v4": _dsml("tool_calls"),
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v31": _deepseek_v31,
    "hermes": _hermes,
}
