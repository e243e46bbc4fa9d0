"""Constrained decoding for response_format and tool_choice (frontend/preprocess/structured.py).

The structural tags are checked against xgrammar, the grammar library vLLM hands them
to: equal to the tags xgrammar itself builds for the same models, compiled by it, and
accepting exactly the calls the model's own format writes (the chat template's rendering
of a call), which the parse stage then reads back. xgrammar comes with vLLM (``make
vllm``): those tests are skipped without it and fail under CI=true.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from frontend.postprocess.parsers import make_parser
from frontend.preprocess.deepseek_v4 import _render_tool_calls
from frontend.preprocess.structured import (
    TOOL_CALL_FORMATS,
    ConstraintError,
    structured_output,
)
from frontend.request import Constraint
from headwater.wire import StructuredKind

from vllm_fixture import require_vllm

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
REQUIRED = Constraint("tool_calls", "tool_choice", tools=("get_weather", "get_time"))
NAMED = Constraint("tool_call", "tool_choice", tools=("get_weather",))
#: The parse stage's formats, by xgrammar's name for the same model's structural tag.
XGRAMMAR_MODELS = {
    "deepseek_v4": "deepseek_v4",
    "deepseek_v32": "deepseek_v3_2",
    "deepseek_v31": "deepseek_v3_1",
}


def tag(
    constraint: Constraint,
    parser: str = "deepseek_v4",
    *,
    forced: bool = False,
    parallel: bool = True,
) -> Any:
    out = structured_output(
        constraint,
        tools=TOOLS,
        tool_call_parser=parser,
        reasoning_forced=forced,
        parallel_tool_calls=parallel,
    )
    assert out.kind is StructuredKind.STRUCTURAL_TAG
    return json.loads(out.spec)


# ---- without xgrammar -------------------------------------------------------------------


def test_response_format_is_vllms_json_or_json_object() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    out = structured_output(
        Constraint("json_schema", "response_format", schema),
        tools=None,
        tool_call_parser="none",
        reasoning_forced=False,
    )
    assert (out.kind, json.loads(out.spec)) == (StructuredKind.JSON, schema)
    out = structured_output(
        Constraint("json_object", "response_format"),
        tools=None,
        tool_call_parser="none",
        reasoning_forced=False,
    )
    assert (out.kind, out.spec) == (StructuredKind.JSON_OBJECT, "")


def test_after_forced_reasoning_the_constraint_starts_at_think_end() -> None:
    doc = tag(Constraint("json_object", "response_format"), forced=True)
    reasoning, answer = doc["format"]["elements"]
    assert (reasoning["begin"], reasoning["end"]) == ("", "</think>")
    assert reasoning["content"]["type"] == "any_text"
    assert answer == {"type": "json_schema", "json_schema": {"type": "object"}}


def test_a_forced_call_is_in_the_models_own_format() -> None:
    doc = tag(NAMED)["format"]
    opener, call, closer = doc["elements"]
    assert opener["value"] == "\n\n<｜DSML｜tool_calls>\n"
    assert call["begin"] == '<｜DSML｜invoke name="get_weather">\n'
    assert call["content"]["json_schema"] == WEATHER["function"]["parameters"]
    assert closer["value"] == "</｜DSML｜tool_calls>"
    calls = tag(REQUIRED)["format"]["elements"][1]
    assert [t["begin"] for t in calls["tags"]] == [
        '<｜DSML｜invoke name="get_weather">\n',
        '<｜DSML｜invoke name="get_time">\n',
    ]
    assert calls["tags"][1]["content"]["json_schema"] is True  # no parameters: any
    assert (calls["at_least_one"], calls["stop_after_first"]) == (True, False)
    assert tag(REQUIRED, parallel=False)["format"]["elements"][1]["stop_after_first"]


def test_a_forced_call_needs_a_format_to_hold_the_answer_to() -> None:
    with pytest.raises(ConstraintError, match="tool-call parser"):
        structured_output(REQUIRED, tools=TOOLS, tool_call_parser="none", reasoning_forced=False)


# ---- against xgrammar ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar() -> Any:
    require_vllm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import xgrammar

    return xgrammar


@pytest.mark.parametrize("parser", list(XGRAMMAR_MODELS))
@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.slow
def test_the_tags_are_xgrammars_own(
    xgrammar: Any, parser: str, forced: bool, parallel: bool
) -> None:
    for constraint, choice in (
        (REQUIRED, "required"),
        (NAMED, {"type": "function", "function": {"name": "get_weather"}}),
    ):
        theirs = xgrammar.get_model_structural_tag(
            XGRAMMAR_MODELS[parser],
            tools=TOOLS,
            tool_choice=choice,
            reasoning=forced,
            force_reasoning=forced,
            parallel_tool_calls=parallel,
        )
        ours = xgrammar.StructuralTag.model_validate(
            tag(constraint, parser, forced=forced, parallel=parallel)
        )
        assert ours.model_dump() == theirs.model_dump(), (parser, choice)


def accepts(xgrammar: Any, doc: Any, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(doc))
    return bool(_is_grammar_accept_string(grammar, text))


def test_the_grammar_takes_the_models_call_and_the_parser_reads_it(xgrammar: Any) -> None:
    call = _render_tool_calls(
        [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]
    )
    assert accepts(xgrammar, tag(NAMED), call)
    assert accepts(xgrammar, tag(REQUIRED), call)
    assert not accepts(xgrammar, tag(NAMED), call.replace("get_weather", "get_time"))
    assert not accepts(xgrammar, tag(NAMED), call.replace(">3<", ">soon<"))  # not an integer
    assert not accepts(xgrammar, tag(NAMED), "Sure! " + call)  # nothing but the call
    two = _render_tool_calls(
        [
            {"function": {"name": "get_time", "arguments": {}}},
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]
    )
    assert accepts(xgrammar, tag(REQUIRED), two)
    assert not accepts(xgrammar, tag(REQUIRED, parallel=False), two)
    assert accepts(xgrammar, tag(NAMED, forced=True), "The user wants Paris.</think>" + call)

    parser = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
    out = parser.feed("The user wants Paris.</think>" + call)
    end = parser.finish()
    steps = out.tool_calls + end.tool_calls
    assert (out.reasoning + end.reasoning, out.content + end.content) == (
        "The user wants Paris.",
        "",
    )
    assert steps[0].name == "get_weather"
    assert json.loads("".join(s.arguments for s in steps)) == {"city": "Paris", "days": 3}


def test_the_other_formats_take_their_calls(xgrammar: Any) -> None:
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(xgrammar, tag(NAMED, "hermes"), hermes)
    assert accepts(xgrammar, tag(REQUIRED, "hermes"), hermes.replace("\n", ""))
    assert not accepts(
        xgrammar, tag(NAMED, "hermes"), hermes.replace("Paris", "3").replace('"3"', "3")
    )
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert accepts(xgrammar, tag(NAMED, "deepseek_v31"), v31)
    assert set(TOOL_CALL_FORMATS) == {"deepseek_v4", "deepseek_v32", "deepseek_v31", "hermes"}


def test_json_after_reasoning(xgrammar: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    doc = tag(Constraint("json_schema", "response_format", schema), forced=True)
    assert accepts(xgrammar, doc, 'Easy.</think>{"ok": true}')
    assert not accepts(xgrammar, doc, 'Easy.</think>{"ok": 1}')
    assert not accepts(xgrammar, doc, '{"ok": true}')  # the reasoning ends first
