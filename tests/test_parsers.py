"""The parse stage's parsers: reasoning and tool calls out of the answer text.

Hand-written DeepSeek-V4 edge cases and generated answers (tests/parser_corpus.py) are
parsed and compared with what they were built from; each, streamed with random splits,
must give what the unary parse gives, with no markup in any content or reasoning delta.
The other formats (deepseek_v32, deepseek_v31, hermes), the registry, the hold-back bound
and the cost per piece have their own tests. The comparison with vLLM's own
parsers is tests/test_parsers_vllm.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.postprocess.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    AnswerParser,
    default_parsers,
    make_parser,
    prompt_ends_in_reasoning,
)
from frontend.postprocess.parsers.arguments import ToolSchemas, type_value
from frontend.postprocess.parsers.markers import Markers
from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate
from frontend.preprocess.jinja import JinjaChatTemplate

from parser_corpus import (
    HAND,
    MARKUP,
    TOOLS,
    Case,
    D,
    Parsed,
    block,
    dsv4_answers,
    param,
    parse,
    splits,
    unary,
)

#: The longest marker of the deepseek_v4 parsers: the opener with its separator.
LONGEST_MARKER = len("\n\n<|DSML|tool_calls>")
PROPERTY = settings(max_examples=300, deadline=None, derandomize=os.environ.get("CI") == "true")


def assert_expected(case: Case, got: Parsed) -> None:
    assert got.call_objects() == [(n, a) for n, a in case.calls]
    if case.text_known:
        assert got.reasoning == case.reasoning
        assert got.content == case.content


def assert_no_markup(got: Parsed, markup: tuple[str, ...] = MARKUP) -> None:
    for text in [*(d.content for d in got.deltas), *(d.reasoning for d in got.deltas),
                 got.content, got.reasoning]:  # fmt: skip
        assert not any(m in text for m in markup), text


def assert_same(streamed: Parsed, whole: Parsed) -> None:
    assert (streamed.content, streamed.reasoning, streamed.calls) == (
        whole.content, whole.reasoning, whole.calls)  # fmt: skip


# -- DeepSeek-V4: the corpus ------------------------------------------------------------------


@pytest.mark.parametrize("case", HAND, ids=[c.name for c in HAND])
def test_hand_written_case(case: Case) -> None:
    got = unary(case)
    assert_expected(case, got)
    assert_no_markup(got)
    # One character at a time: every marker arrives split at every place.
    assert_same(parse(case.parser(), list(case.text), truncated=case.truncated), got)


@PROPERTY
@given(case=st.one_of(st.sampled_from(HAND), dsv4_answers()),
       cuts=st.lists(st.integers(0, 10**6), max_size=40))  # fmt: skip
def test_any_split_gives_the_unary_result_as_built_without_markup(
    case: Case, cuts: list[int]
) -> None:
    whole = unary(case)
    assert_expected(case, whole)
    streamed = parse(case.parser(), splits(case.text, cuts), truncated=case.truncated)
    assert_same(streamed, whole)
    assert_no_markup(streamed)


def test_call_ids_are_openai_shaped_and_distinct() -> None:
    case = next(c for c in HAND if c.name == "several calls in one block")
    ids = unary(case).ids + unary(case).ids
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_call_is_emitted_when_it_closes_with_id_name_then_arguments() -> None:
    parser = make_parser("deepseek_v4", "none", tools=TOOLS)
    text = block([("get_weather", [param("city", "Oslo", "true")])])
    close = text.index(f"</{D}invoke>")
    early = parser.feed(text[:close])
    assert not early.tool_calls  # open: nothing shown yet, so a cut call never is
    steps = parser.feed(text[close:]).tool_calls
    assert [(s.index, s.name, s.arguments) for s in steps] == [
        (0, "get_weather", ""), (0, None, '{"city": "Oslo"}')]  # fmt: skip
    assert parser.tool_calls_made == 1
    assert not parser.finish()


def test_an_open_call_at_a_normal_end_is_completed_and_at_a_cut_one_dropped() -> None:
    text = "</think>" + block([("get_weather", [param("city", "Oslo", "true")])])
    open_call = text[: text.index(f"</{D}parameter>")]
    for truncated, calls in ((False, [("get_weather", '{"city": "Oslo"}')]), (True, [])):
        got = parse(make_parser("deepseek_v4", "deepseek_v4", reasoning_forced=True),
                    [open_call], truncated=truncated)  # fmt: skip
        assert got.calls == calls


# -- streaming guarantees ---------------------------------------------------------------------


def test_a_partial_marker_is_released_the_moment_it_cannot_be_one() -> None:
    parser = make_parser("deepseek_v4", "deepseek_v4")
    assert parser.feed("a <thi").content == "a "
    assert parser.feed("s").content == "<this"
    assert parser.feed(f"\n\n<{D}tool").content == ""
    assert parser.feed("box>").content == f"\n\n<{D}toolbox>"
    assert parser.feed("<").content == ""
    assert parser.finish().content == "<"  # a normal end: it never became a marker


@pytest.mark.parametrize(("tool_parser", "reasoning_parser"), [
    ("deepseek_v4", "deepseek_v4"), ("deepseek_v32", "none"), ("deepseek_v31", "deepseek_r1"),
    ("hermes", "deepseek_v4"),
])  # fmt: skip
def test_plain_text_is_never_held_longer_than_a_marker(
    tool_parser: str, reasoning_parser: str
) -> None:
    # Near-misses of every format's markers, fed one character at a time.
    text = (
        "x <thi <think <｜DSML｜to <｜DSML｜tool_calls <|DSML|invok \n\n<｜DSML｜ \n<tool_cal "
        "<tool_call <｜tool▁calls▁begi <｜tool▁call▁beg <｜tool▁se </thin </｜DSML｜invoke ok\n\n"
    )
    parser = make_parser(tool_parser, reasoning_parser)
    shown = 0
    for fed, char in enumerate(text, 1):
        delta = parser.feed(char)
        shown += len(delta.content) + len(delta.reasoning)
        assert fed - shown < LONGEST_MARKER
    finished = parser.finish()
    assert shown + len(finished.content) + len(finished.reasoning) == len(text)


def _answer(reasoning_chars: int) -> str:
    """A long DeepSeek-V4 answer: reasoning, content and three calls."""
    words = "think about the <code> and its 'tests', 1 < 2 ≠ 3; "
    reasoning = (words * (reasoning_chars // len(words) + 1))[:reasoning_chars]
    calls = block([("write_file", [param("path", "a.py", "true"),
                                   param("content", "x = 1 < 2\n" * 50, "true")])] * 3)  # fmt: skip
    return f"{reasoning}</think>Done, writing the files.\n\n{calls}"


def _pieces(text: str) -> list[str]:
    return [text[i : i + 4] for i in range(0, len(text), 4)]  # about a token each


def test_scan_per_piece_does_not_grow_with_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting: the text every scan for markers looks at, per piece, is the piece plus
    the held tail, however long the answer already is."""
    spans: list[int] = []
    absent_from, search, held_from = Markers.absent_from, Markers.search, Markers.held_from

    def counting_absent_from(self: Markers, text: str) -> bool:
        spans.append(len(text))
        return absent_from(self, text)

    def counting_search(self: Markers, text: str, pos: int) -> Any:
        spans.append(len(text) - pos)
        return search(self, text, pos)

    def counting_held_from(self: Markers, text: str, pos: int) -> int:
        spans.append(len(text) - pos)
        return held_from(self, text, pos)

    monkeypatch.setattr(Markers, "absent_from", counting_absent_from)
    monkeypatch.setattr(Markers, "search", counting_search)
    monkeypatch.setattr(Markers, "held_from", counting_held_from)
    parser = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
    for piece in _pieces(_answer(40_000)):
        spans.clear()
        parser.feed(piece)
        assert max(spans) <= len(piece) + LONGEST_MARKER
    assert parser.tool_calls_made == 3


@contextmanager
def _counting_opcodes() -> Iterator[list[int]]:
    count = [0]

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(previous)


def test_parse_cost_is_linear_in_the_answer() -> None:
    """Scaling: Python bytecodes executed to stream an answer 4x as long are about 4x
    (a rescan of the text so far per piece would make them ~16x)."""
    costs = []
    for chars in (5_000, 20_000):
        pieces = _pieces(_answer(chars))
        parser = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
        with _counting_opcodes() as count:
            for piece in pieces:
                parser.feed(piece)
            parser.finish()
        costs.append(count[0] / len(pieces))
    assert costs[1] / costs[0] < 1.3  # per piece: flat


# -- schema typing ----------------------------------------------------------------------------

_INT = frozenset({"integer"})
_STR = frozenset({"string"})


@pytest.mark.parametrize(("text", "string", "types", "value"), [
    ("Paris", True, _STR, "Paris"),
    ("123", True, _STR, "123"),          # a string stays a string, even when it looks like JSON
    ("123", False, _STR, "123"),         # the schema wants a string: the text as written
    ('"quoted"', False, _STR, "quoted"),  # a JSON string is a string
    ("7", True, _INT, 7),                # wrong hint: the schema decides
    ("seven", True, _INT, "seven"),      # fits nothing: never invented
    ("3", None, _INT, 3),                # no hint: JSON
    ("3.0", False, _INT, 3.0),
    ("[1, 2]", None, None, [1, 2]),      # no schema: the hint decides
    ("[1, 2]", True, None, "[1, 2]"),
    ("not json", False, None, "not json"),
    ("NaN", False, None, "NaN"),          # not JSON: stays text
    ("1e999", None, frozenset({"number"}), "1e999"),
    ("null", False, frozenset({"string", "null"}), None),
    ("true", None, frozenset({"boolean"}), True),
    ('{"a": 1}', False, frozenset({"string"}), '{"a": 1}'),
    ('{"a": 1}', False, frozenset({"integer"}), {"a": 1}),  # meets no schema: the model's JSON
])  # fmt: skip
def test_type_value(
    text: str, string: bool | None, types: frozenset[str] | None, value: Any
) -> None:
    assert type_value(text, string, types) == value
    assert type(type_value(text, string, types)) is type(value)


def test_schema_types_from_type_lists_enums_and_unions() -> None:
    schemas = ToolSchemas([
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {
            "a": {"type": ["integer", "null"]}, "b": {"enum": [1, "x"]},
            "c": {"anyOf": [{"type": "boolean"}, {"type": "array"}]}, "d": {"description": "?"}}}}},
        {"type": "function"},  # malformed entries are skipped
    ])  # fmt: skip
    assert schemas.types("f", "a") == {"integer", "null"}
    assert schemas.types("f", "b") == {"integer", "number", "string"}
    assert schemas.types("f", "c") == {"boolean", "array"}
    assert schemas.types("f", "d") is None
    assert schemas.types("g", "a") is None


def test_a_wrapped_arguments_object_is_unwrapped_when_the_tool_has_no_such_parameter() -> None:
    wrapped = param("arguments", '{"city": "Rome", "days": 2}', "false")
    got = unary(Case("wrapped", block([("get_weather", [wrapped])]), forced=False))
    assert got.call_objects() == [("get_weather", {"city": "Rome", "days": 2})]
    # A tool that has an "arguments" parameter keeps it.
    tools = [{"type": "function", "function": {"name": "t", "parameters": {
        "properties": {"arguments": {"type": "object"}}}}}]  # fmt: skip
    got = unary(Case("kept", block([("t", [wrapped])]), forced=False, tools=tools))
    assert got.call_objects() == [("t", {"arguments": {"city": "Rome", "days": 2}})]


def test_dsml_spelled_with_ascii_bars_and_missing_closers() -> None:
    text = (
        '<|DSML|tool_calls>\n<|DSML|invoke name="get_weather">\n'
        # No </parameter>: the next parameter closes it.
        '<|DSML|parameter name="city" string="true">Lima\n'
        '<|DSML|parameter name="days" string="false">4</|DSML|parameter>\n'
        "</|DSML|tool_calls>after"  # no </invoke>: the wrapper's end closes it
    )
    got = unary(Case("ascii", text, forced=False))
    assert got.call_objects() == [("get_weather", {"city": "Lima\n", "days": 4})]
    assert got.content == "after"


def test_stray_dsml_markup_outside_a_call_is_dropped() -> None:
    text = f"a</{D}invoke>b</{D}parameter>c</{D}tool_calls>d"
    got = unary(Case("stray", text, forced=False))
    assert (got.content, got.calls) == ("abcd", [])


def test_an_invoke_without_a_name_is_dropped() -> None:
    text = block([("get_weather", [])]).replace('name="get_weather"', "") + "x"
    got = unary(Case("nameless", text, forced=False))
    assert (got.calls, got.content) == ([], "x")


# -- the other formats ------------------------------------------------------------------------


def _both(parser: Callable[[], AnswerParser], text: str, *, truncated: bool = False) -> Parsed:
    """Unary, checked against a one-character-at-a-time stream."""
    whole = parse(parser(), [text], truncated=truncated)
    assert_same(parse(parser(), list(text), truncated=truncated), whole)
    return whole


def test_deepseek_v32_function_calls() -> None:
    text = "Let me check.\n\n" + block([("get_weather", [param("city", "Oslo", "true")]),
                                       ("search", [param("limit", "2", "false")])],
                                      wrapper="function_calls")  # fmt: skip
    got = _both(lambda: make_parser("deepseek_v32", "none", tools=TOOLS), text)
    assert got.call_objects() == [("get_weather", {"city": "Oslo"}), ("search", {"limit": 2})]
    assert got.content == "Let me check."
    # V4's wrapper is not V3.2's: only a bare invoke inside it is a call, the wrapper's
    # tags are text.
    v4 = _both(lambda: make_parser("deepseek_v32", "none"), block([], wrapper="tool_calls"))
    assert v4.calls == []


V31_CALL = "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def _v31(*calls: tuple[str, str]) -> str:
    body = "".join(V31_CALL.format(name=n, args=a) for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def test_deepseek_v31() -> None:
    def make() -> AnswerParser:
        return make_parser("deepseek_v31", "deepseek_r1")

    text = "why</think>On it." + _v31(("get_weather", '{"city": "東京", "days": 1}'),
                                     ("search", '{"q": "<b>", "n": [1, {"x": null}]}'))  # fmt: skip
    got = _both(make, text)
    assert got.call_objects() == [
        ("get_weather", {"city": "東京", "days": 1}),
        ("search", {"q": "<b>", "n": [1, {"x": None}]}),
    ]
    assert (got.reasoning, got.content) == ("why", "On it.")
    # Arguments that are not JSON are passed on as written (OpenAI's are not guaranteed
    # JSON either); a cut call is dropped.
    bad = _both(make, "</think>" + _v31(("f", "{not json")))
    assert bad.calls == [("f", "{not json")]
    cut = _both(make, "</think>" + _v31(("f", "{}"), ("g", '{"a": 1}'))[:-30], truncated=True)
    assert cut.calls == [("f", "{}")]
    assert_no_markup(got, ("<｜tool",))


def test_hermes() -> None:
    def make() -> AnswerParser:
        return make_parser("hermes", "deepseek_v4")

    text = (
        '<think>plan</think>Calling.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Kyiv", "days": 2}}\n</tool_call>\n<tool_call>{"name": "search", '
        '"arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    )
    got = _both(make, text)
    assert got.call_objects() == [("get_weather", {"city": "Kyiv", "days": 2}),
                                  ("search", {"query": "x"})]  # fmt: skip
    assert (got.reasoning, got.content) == ("plan", "Calling.")  # the separators belong to the tags
    assert_no_markup(got, ("<tool_call>", "</tool_call>", "<think>", "</think>"))


def test_hermes_bad_json_stays_content_without_the_tags() -> None:
    def make() -> AnswerParser:
        return make_parser("hermes", "none")

    got = _both(make, 'Try:\n<tool_call>{"name": "f", "arguments": {oops}</tool_call> end')
    assert (got.calls, got.content) == ([], 'Try:\n{"name": "f", "arguments": {oops} end')
    nameless = _both(make, '<tool_call>{"arguments": {}}</tool_call>')
    assert (nameless.calls, nameless.content) == ([], '{"arguments": {}}')
    # At EOS without the closing tag the body may still be complete; cut, it is dropped.
    body = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    assert _both(make, body).calls == [("f", '{"a": 1}')]
    assert _both(make, body, truncated=True).calls == []


def test_no_parsers_pass_the_text_through() -> None:
    text = f"<think>x</think>{block([('get_weather', [])])}"
    got = _both(lambda: make_parser("none", "none"), text)
    assert (got.content, got.calls) == (text, [])
    # Reasoning only: the tool markup is the model's text.
    assert _both(lambda: make_parser("none", "deepseek_v4"), text).content == text[16:]


def test_deepseek_r1_always_starts_in_reasoning() -> None:
    got = _both(lambda: make_parser("none", "deepseek_r1"), "a</think>b")
    assert (got.reasoning, got.content) == ("a", "b")
    got = _both(lambda: make_parser("none", "deepseek_v4"), "a</think>b")
    assert (got.reasoning, got.content) == ("", "ab")  # not forced: a stray </think>


# -- the registry -----------------------------------------------------------------------------


def test_parser_names() -> None:
    assert set(TOOL_PARSERS) == {"deepseek_v4", "deepseek_v31", "deepseek_v32", "hermes", "none"}
    assert set(REASONING_PARSERS) == {"deepseek_v4", "deepseek_r1", "none"}
    with pytest.raises(
        ValueError, match="valid: deepseek_v4, deepseek_v32, deepseek_v31, hermes, none"
    ):
        make_parser("qwen3", "none")
    with pytest.raises(
        ValueError, match="reasoning parser 'r1'; valid: deepseek_v4, deepseek_r1, none"
    ):
        make_parser("none", "r1")


def test_default_parsers_follow_the_chat_renderer() -> None:
    assert default_parsers(DeepSeekV4ChatTemplate()) == ("deepseek_v4", "deepseek_v4")
    assert default_parsers(JinjaChatTemplate("{{ messages }}")) == ("none", "none")


def test_prompt_ends_in_reasoning_as_deepseek_v4_renders_thinking_mode() -> None:
    template = DeepSeekV4ChatTemplate()
    messages = [{"role": "user", "content": "hi"}]
    tools = TOOLS[:1]
    for kwargs, tools_, forced in (
        ({"thinking": True}, None, True), ({"thinking": True}, tools, True),
        ({"thinking": False}, tools, False), ({}, None, False),
    ):  # fmt: skip
        prompt = template.render(messages, chat_template_kwargs=kwargs, tools=tools_)
        assert prompt_ends_in_reasoning(prompt) is forced
    assert prompt_ends_in_reasoning("<｜User｜>x<｜Assistant｜><think>\n")  # R1's
    assert not prompt_ends_in_reasoning("<think>a</think>")


def test_markers_refuse_a_marker_inside_another() -> None:
    Markers({"<x>", "\n\n<x>"})  # as a suffix: the longer one is found first
    with pytest.raises(ValueError, match="inside"):
        Markers({"<a", "<ab>"})  # "<a" would complete before "<ab>" could
    with pytest.raises(ValueError, match="empty"):
        Markers({""})


def test_arguments_are_json_objects_in_openai_form() -> None:
    case = next(c for c in HAND if c.name == "unicode and nested JSON arguments")
    ((_, arguments),) = unary(case).calls
    assert arguments.startswith('{"query": "天气')  # non-ASCII kept, OpenAI's separators
    assert json.loads(arguments)["tags"] == ["a", "日本"]
