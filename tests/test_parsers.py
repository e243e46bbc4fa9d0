"""The parse stage's parsers (frontend/postprocess/parsers): reasoning and tool calls out
of an answer, unary and streamed with any split, with no markup ever in the content."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.postprocess.parsers import AnswerDelta, make_parser
from frontend.postprocess.parsers.arguments import param_types, type_value
from frontend.postprocess.parsers.scan import Markers, partial_tail

from parser_corpus import (
    BLOCK,
    BLOCK_END,
    CODE,
    TOOLS,
    Case,
    D,
    block,
    corpus,
    hand_written,
    invoke,
    param,
)

CORPUS = corpus()
MARKUP = ("<think>", "</think>", D, "<tool_call>", "</tool_call>")


def run(case: Case, pieces: list[str], parser: str = "deepseek_v4") -> dict[str, Any]:
    """Feed *pieces* to a fresh parser; the answer put together from its deltas."""
    p = make_parser(parser, "deepseek_v4", tools=TOOLS, reasoning_forced=case.forced)
    deltas = [p.feed(piece) for piece in pieces]
    deltas.append(p.finish(truncated=case.truncated))
    return assemble(deltas) | {"made": p.tool_calls_made}


def assemble(deltas: list[AnswerDelta]) -> dict[str, Any]:
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for step in d.tool_calls:
            call = calls.setdefault(step.index, {"name": None, "id": None, "arguments": ""})
            if step.id is not None:
                assert call["id"] is None, "a call's id comes once, on its first step"
                call["id"], call["name"] = step.id, step.name
            else:
                assert call["id"] is not None, "a call's first step names it"
            call["arguments"] += step.arguments
    return {
        "content": "".join(d.content for d in deltas),
        "reasoning": "".join(d.reasoning for d in deltas),
        "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
        "deltas": deltas,
    }


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("case", hand_written(), ids=lambda c: c.name)
def test_each_hand_written_case_parses_as_stated(case: Case) -> None:
    got = run(case, [case.text])
    assert (got["reasoning"], got["content"], got["calls"]) == (
        case.reasoning,
        case.content,
        case.calls,
    )
    assert got["made"] == len(case.calls)


def test_the_generated_corpus_parses_as_generated() -> None:
    assert len(CORPUS) >= 300
    for case in CORPUS:
        got = run(case, [case.text])
        assert (got["reasoning"], got["content"], got["calls"]) == (
            case.reasoning,
            case.content,
            case.calls,
        ), case.name


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CORPUS), st.lists(st.integers(min_value=0), max_size=40))
@pytest.mark.slow
def test_any_split_streams_to_the_unary_answer_with_no_markup(case: Case, cuts: list[int]) -> None:
    unary = run(case, [case.text])
    streamed = run(case, split(case.text, cuts))
    for key in ("content", "reasoning", "calls", "made"):
        assert streamed[key] == unary[key], key
    if not case.truncated:  # a cut marker is text (the model wrote no more of it)
        for d in streamed["deltas"]:
            assert not any(m in d.content or m in d.reasoning for m in MARKUP), d


def test_one_character_at_a_time_is_a_split_too() -> None:
    for case in CORPUS[:60]:
        assert run(case, list(case.text))["calls"] == case.calls, case.name


def test_plain_text_is_held_back_by_no_more_than_a_marker() -> None:
    p = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS)
    longest = len(f"<{D}tool_calls>")
    sent = ""
    text = "Some plain text, with < and <｜ and <th in it, " * 20
    for i, ch in enumerate(text):
        sent += p.feed(ch).content
        assert len(text[: i + 1]) - len(sent) < longest
    assert sent + p.finish().content == text


def test_a_call_is_sent_whole_when_it_ends_and_never_when_it_is_cut() -> None:
    p = make_parser("deepseek_v4", "none", tools=TOOLS)
    head = f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    assert not p.feed(head).tool_calls
    assert not p.feed(f'<{D}parameter name="city" string="true">Pa').tool_calls
    done = p.feed(f"ris</{D}parameter>\n</{D}invoke>")
    assert [(s.index, s.name) for s in done.tool_calls] == [(0, "get_weather"), (0, None)]
    assert done.tool_calls[0].id
    assert done.tool_calls[0].id.startswith("call_")
    assert json.loads(done.tool_calls[1].arguments) == {"city": "Paris"}
    p.feed(f'\n<{D}invoke name="noop">\n')
    assert not p.finish(truncated=True)  # the open call is dropped
    assert p.tool_calls_made == 1


def test_arguments_are_typed_by_the_tools_schema_when_the_attribute_is_missing() -> None:
    p = make_parser("deepseek_v4", "none", tools=TOOLS)
    text = (
        f'<{D}tool_calls><{D}invoke name="get_weather">'
        f'<{D}parameter name="city">123</{D}parameter>'
        f'<{D}parameter name="days">123</{D}parameter></{D}invoke></{D}tool_calls>'
    )
    args = json.loads(p.feed(text).tool_calls[1].arguments)
    assert args == {"city": "123", "days": 123}  # city is a string in the schema


def test_without_a_reasoning_parser_think_tags_stay_text() -> None:
    p = make_parser("none", "none")
    assert p.feed("<think>a</think>b").content + p.finish().content == "<think>a</think>b"


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            [("get_weather", {"city": "Paris"})],
            "",
        ),
        (
            'Sure.\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"days\\": 2}"}</tool_call>',
            [("noop", {}), ("get_weather", {"days": 2})],
            "Sure.\n",
        ),
        # Not JSON: not a call; the model's text is kept, not lost (the tags are markup).
        ("<tool_call>{oops</tool_call>", [], "{oops"),
    ],
)
def test_hermes(text: str, calls: list[Any], content: str) -> None:
    case = Case("hermes", text)
    for pieces in ([text], list(text)):
        got = run(case, pieces, parser="hermes")
        assert (got["calls"], got["content"]) == (calls, content)


def test_deepseek_v31_and_v32() -> None:
    v31 = (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    got = run(Case("v31", v31), list(v31), parser="deepseek_v31")
    assert (got["content"], got["calls"]) == ("Checking.", [("get_weather", {"city": "Paris"})])
    v32 = (
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="days" string="false">5</{D}parameter>\n'
        f"</{D}invoke>\n</{D}function_calls>"
    )
    got = run(Case("v32", v32), list(v32), parser="deepseek_v32")
    assert (got["content"], got["calls"]) == ("", [("get_weather", {"days": 5})])


def test_unknown_parser_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        make_parser("deepseek_v5", "none")
    with pytest.raises(ValueError, match="deepseek_r1"):
        make_parser("none", "o1")


def test_the_work_per_piece_does_not_grow_with_the_text_so_far() -> None:
    """partial_tail and first_marker see the piece and the held tail only; a long
    answer fed a token at a time keeps the held tail below a marker's length."""
    p = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
    longest = len(f"</{D}tool_calls>")
    for i in range(20_000):
        p.feed("word < " if i % 3 else "<｜")
        assert len(p._held) < longest  # type: ignore[attr-defined]
    assert partial_tail("abc<thi", ["<think>"]) == 4
    assert partial_tail("abc<think", ["</think>"]) == 0


def test_markup_never_reaches_the_content_even_malformed() -> None:
    """Stray closers outside a call, and a call that is none (an invoke without a name),
    are markup: dropped, never content."""
    strays = f"a</{D}invoke>b</{D}parameter>c</{D}tool_calls>d</tool_call>e"
    got = run(Case("strays", strays), list(strays))
    assert (got["content"], got["calls"]) == ("abcd</tool_call>e", [])
    nameless = f"{BLOCK}\n<{D}invoke>\n{param('city', 'Oslo')}\n</{D}invoke>\n{BLOCK_END}ok"
    for pieces in ([nameless], list(nameless)):
        got = run(Case("nameless", nameless), pieces)
        assert (got["content"], got["calls"]) == ("ok", [])
    v31 = "<｜tool▁sep｜>x<｜tool▁call▁end｜><｜tool▁calls▁end｜>y"
    assert run(Case("v31 strays", v31), [v31], parser="deepseek_v31")["content"] == "xy"
    hermes = "a</tool_call>b"
    assert run(Case("hermes stray", hermes), [hermes], parser="hermes")["content"] == "ab"


def test_an_invoke_tag_spaced_differently_is_still_a_call() -> None:
    text = f'{BLOCK}\n<{D}invoke  name = "get_weather" >\n{param("days", 2)}\n</{D}invoke>'
    for pieces in ([text], list(text)):
        got = run(Case("spaced", text), pieces)
        assert got["calls"] == [("get_weather", {"days": 2})]


def test_deepseek_v31_arguments_that_are_not_json_are_passed_on_as_written() -> None:
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city: Paris}"
    text += "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    p = make_parser("deepseek_v31", "none")
    steps = p.feed(text).tool_calls
    assert [(s.name, s.arguments) for s in steps] == [("get_weather", ""), (None, "{city: Paris}")]


@pytest.mark.parametrize(
    ("text", "string", "types", "value"),
    [
        ("Paris", True, {"string"}, "Paris"),
        ("123", True, {"string"}, "123"),  # a string stays a string, JSON-like or not
        ("123", False, {"string"}, "123"),  # the schema wants a string: the text
        ('"quoted"', False, {"string"}, "quoted"),  # a JSON string is a string
        ("7", True, {"integer"}, 7),  # the hint the wrong way round: the schema
        ("seven", True, {"integer"}, "seven"),  # fits nothing: never invented
        ("3", None, {"integer"}, 3),  # no hint: JSON
        ("[1, 2]", None, None, [1, 2]),  # no schema: the hint decides
        ("[1, 2]", True, None, "[1, 2]"),
        ("not json", False, None, "not json"),
        ("NaN", False, None, "NaN"),  # not JSON
        ("1e999", None, {"number"}, "1e999"),  # not representable in JSON
        ("null", False, {"string", "null"}, None),
        ('{"a": 1}', False, {"integer"}, {"a": 1}),  # meets no schema: the model's JSON
    ],
)
def test_a_dsml_value_is_typed_by_its_hint_and_the_schema(
    text: str, string: bool | None, types: set[str] | None, value: Any
) -> None:
    typed = type_value(text, string, frozenset(types) if types is not None else None)
    assert (typed, type(typed)) == (value, type(value))


def test_schema_types_from_type_lists_enums_and_unions() -> None:
    assert param_types({"type": ["integer", "null"]}) == frozenset({"integer", "null"})
    assert param_types({"enum": [1, "x"]}) == frozenset({"integer", "number", "string"})
    assert param_types({"anyOf": [{"type": "boolean"}, {"type": "array"}]}) == frozenset(
        {"boolean", "array"}
    )
    assert param_types({"description": "?"}) is None
    assert param_types(None) is None


def _long_answer(reasoning_chars: int) -> list[str]:
    """A long answer, reasoning and three calls, in token-sized pieces."""
    words = "think about the <code> and its 'tests', 1 < 2; "
    reasoning = (words * (reasoning_chars // len(words) + 1))[:reasoning_chars]
    calls = block([invoke("write_file", [param("path", "a.py"), param("content", CODE * 20)])] * 3)
    text = f"{reasoning}</think>Writing the files.\n\n{calls}"
    return [text[i : i + 4] for i in range(0, len(text), 4)]


@contextmanager
def _counting_bytecodes() -> Iterator[list[int]]:
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


@pytest.mark.slow
def test_the_parse_cost_per_piece_stays_flat_as_the_answer_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted, not timed: the Python bytecodes per piece, for an answer 4x as long, stay
    the same (a rescan of the text so far would make them grow 4x), and every marker
    search looks at the piece and the held tail only (the C-level half of the work)."""
    per_piece = []
    for chars in (5_000, 20_000):
        pieces = _long_answer(chars)
        p = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
        with _counting_bytecodes() as count:
            for piece in pieces:
                p.feed(piece)
            p.finish()
        assert p.tool_calls_made == 3
        per_piece.append(count[0] / len(pieces))
    assert per_piece[1] / per_piece[0] < 1.3

    seen: list[int] = []
    for name in ("may_start_in", "first", "partial_tail"):
        method = getattr(Markers, name)

        def counting(self: Markers, text: str, _method: Any = method) -> Any:
            seen.append(len(text))
            return _method(self, text)

        monkeypatch.setattr(Markers, name, counting)
    p = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
    longest = len(f"</{D}tool_calls>")
    for piece in _long_answer(40_000):
        seen.clear()
        p.feed(piece)
        assert max(seen, default=0) <= len(piece) + longest
