"""DeepSeek-V4 answers for the parser tests: hand-written edge cases and a generator.

Each :class:`Case` carries what a correct parse gives (the calls, reasoning and content
the answer was built from), so the generated corpus checks headwater's parser against
its own construction and, in tests/test_parsers_vllm.py, against vLLM's parsers.
Answers are laid out as DeepSeek-V4's chat template teaches (frontend/preprocess/deepseek_v4.py):
``{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke ...``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from frontend.postprocess.parsers import AnswerDelta, AnswerParser, make_parser

D = "｜DSML｜"

#: The tools every case is parsed with (their schemas type DSML values).
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "units": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"},
            "append": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"}, "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "threshold": {"type": "number"}, "limit": {"type": "integer"}}}}},
]  # fmt: skip
_TYPES = {
    t["function"]["name"]: {
        k: v["type"] for k, v in t["function"]["parameters"]["properties"].items()
    }
    for t in TOOLS
}
UNLISTED = "run_shell"  # a tool the request did not declare: no schema types its values

#: Every marker of the deepseek_v4 parsers, any spelling: none may reach content/reasoning.
MARKUP = (
    "<think>", "</think>", f"<{D}", f"</{D}", "<|DSML|", "</|DSML|",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A model answer and what parsing it must give."""

    name: str
    text: str
    forced: bool  # the prompt ended in <think>
    calls: tuple[tuple[str, Any], ...] = ()  # (name, arguments object), in order
    reasoning: str = ""
    content: str = ""
    truncated: bool = False  # cut by max_tokens
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)
    #: Text after the call block: headwater returns it as content, vLLM drops it.
    trailing: str = ""
    #: Why vLLM's parse of this case is wrong ("": it is right).
    vllm_wrong: str = ""
    #: Whether ``reasoning`` and ``content`` are known (not for a generated cut answer,
    #: where only the complete calls are).
    text_known: bool = True

    def parser(self) -> AnswerParser:
        return make_parser(
            "deepseek_v4", "deepseek_v4", tools=self.tools, reasoning_forced=self.forced
        )


@dataclass
class Parsed:
    """Everything a stream of deltas said, joined, plus the deltas themselves."""

    content: str
    reasoning: str
    calls: list[tuple[str, str]]  # (name, arguments JSON)
    ids: list[str]
    deltas: list[AnswerDelta]

    def call_objects(self) -> list[tuple[str, Any]]:
        return [(name, json.loads(args)) for name, args in self.calls]


def parse(parser: AnswerParser, pieces: list[str], *, truncated: bool = False) -> Parsed:
    """Feed ``pieces``, finish, and join the deltas, checking OpenAI's incremental shape:
    a call's first delta has its index (0, 1, ... in order), id and name; the later
    ones only argument fragments."""
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish(truncated=truncated))
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    ids: list[str] = []
    for delta in deltas:
        for step in delta.tool_calls:
            if step.index not in names:
                assert step.index == len(names), "call indexes go 0, 1, ... in order"
                assert step.id is not None, "a call's first delta has its id"
                assert step.name, "a call's first delta names it"
                names[step.index] = step.name
                ids.append(step.id)
                args[step.index] = [step.arguments]
            else:
                assert step.id is None, "only the first delta has the id"
                assert step.name is None, "only the first delta names"
                args[step.index].append(step.arguments)
    assert len(names) == parser.tool_calls_made
    return Parsed(
        content="".join(d.content for d in deltas),
        reasoning="".join(d.reasoning for d in deltas),
        calls=[(names[i], "".join(args[i])) for i in range(len(names))],
        ids=ids,
        deltas=deltas,
    )


def unary(case: Case) -> Parsed:
    return parse(case.parser(), [case.text], truncated=case.truncated)


# -- rendering ----------------------------------------------------------------------------


def param(name: str, raw: str, string: str | None) -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{D}parameter name="{name}"{attr}>{raw}</{D}parameter>'


def block(
    invokes: list[tuple[str, list[str]]], *, wrapper: str = "tool_calls", nl: str = "\n"
) -> str:
    """A DSML call block as the template lays it out (``nl=""``: all on one line)."""
    body = nl.join(
        f'<{D}invoke name="{name}">{nl}' + nl.join(params) + f"{nl}</{D}invoke>"
        for name, params in invokes
    )
    return f"<{D}{wrapper}>{nl}{body}{nl}</{D}{wrapper}>"


# -- hand-written cases ---------------------------------------------------------------------

_W = [param("city", "Paris", "true"), param("days", "3", "false")]
HTML = "<html lang=\"en\">\n  <p class='x'>1 < 2 && 3 > 2</p>\n</html>\n"


def _hand() -> list[Case]:
    nested = {"a": [1, {"b": None, "c": "ü"}], "d": {"e": True}}
    return [
        Case(
            "one call, content before",
            f"Sure.\n\n{block([('get_weather', _W)])}",
            forced=False,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            content="Sure.",
        ),
        Case(
            "reasoning then one call",
            f"Need weather.\n</think>\n\n{block([('get_weather', _W)])}",
            forced=True,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            reasoning="Need weather.\n",
        ),
        Case(
            "several calls in one block",
            "</think>"
            + block(
                [
                    ("get_weather", _W),
                    (
                        "write_file",
                        [param("path", "/tmp/a b.txt", "true"), param("append", "true", "false")],
                    ),
                    ("search", [param("query", "x", "true"), param("limit", "10", "false")]),
                ]
            ),
            forced=True,
            calls=(
                ("get_weather", {"city": "Paris", "days": 3}),
                ("write_file", {"path": "/tmp/a b.txt", "append": True}),
                ("search", {"query": "x", "limit": 10}),
            ),
        ),
        Case(
            "unicode and nested JSON arguments",
            block(
                [
                    (
                        "search",
                        [
                            param("query", "天气 ☀️ in Zürich — “quoted”", "true"),
                            param("filters", json.dumps(nested, ensure_ascii=False), "false"),
                            param("tags", '["a", "日本"]', "false"),
                        ],
                    )
                ]
            ),
            forced=False,
            calls=(
                (
                    "search",
                    {
                        "query": "天气 ☀️ in Zürich — “quoted”",
                        "filters": nested,
                        "tags": ["a", "日本"],
                    },
                ),
            ),
        ),
        Case(
            "< > and quotes in values",
            block(
                [
                    (
                        "write_file",
                        [
                            param("path", 'a"b<c>.html', "true"),
                            param("content", HTML, "true"),
                        ],
                    )
                ]
            ),
            forced=False,
            calls=(
                (
                    "write_file",
                    {
                        "path": 'a"b<c>.html',
                        "content": HTML,
                    },
                ),
            ),
        ),
        Case(
            "a value holding <think> and a DSML-like prefix",
            block(
                [
                    (
                        "write_file",
                        [param("content", "<think>not reasoning</think> <｜DSM <|DS", "true")],
                    )
                ]
            ),
            forced=False,
            calls=(("write_file", {"content": "<think>not reasoning</think> <｜DSM <|DS"}),),
            vllm_wrong="vLLM takes <think>…</think> inside an argument for reasoning and cuts "
            "it out of the value; headwater keeps a value as written",
        ),
        Case(
            "content before and after the block",
            f"Checking.\n\n{block([('get_weather', _W)])}\nDone.",
            forced=False,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            content="Checking.\nDone.",
            trailing="\nDone.",
        ),
        Case(
            "reasoning only (cut by max_tokens)",
            "Let me think about <this> and 1 < 2",
            forced=True,
            reasoning="Let me think about <this> and 1 < 2",
            truncated=True,
        ),
        Case(
            "reasoning and answer, no tools",
            "Hmm.</think>The answer is 42.",
            forced=True,
            reasoning="Hmm.",
            content="The answer is 42.",
        ),
        Case(
            "no thinking mode, plain answer with < and a stray </think>",
            "a < b </think>and <thin c",
            forced=False,
            content="a < b and <thin c",
        ),
        Case(
            "thinking opened by the model itself",
            "<think>hm</think>ok",
            forced=False,
            reasoning="hm",
            content="ok",
        ),
        Case(
            "cut by max_tokens inside the second call",
            "</think>"
            + block([("get_weather", _W), ("search", [param("query", "x", "true")])])[:-60],
            forced=True,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            truncated=True,
        ),
        Case(
            "cut by max_tokens inside the opener",
            f"Sure.\n\n<{D}tool_ca",
            forced=False,
            content="Sure.",
            truncated=True,
        ),
        Case(
            "cut by max_tokens right after a complete invoke",
            "</think>" + block([("get_weather", _W)]).removesuffix(f"\n</{D}tool_calls>"),
            forced=True,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            truncated=True,
        ),
        Case(
            "spelling variant <｜DSML｜toolcalls>",
            block([("get_weather", _W)], wrapper="toolcalls"),
            forced=False,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
        ),
        Case(
            "spelling variant <｜DSML｜tool>",
            block([("get_weather", _W)], wrapper="tool"),
            forced=False,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
        ),
        Case(
            "missing string attribute",
            block(
                [
                    (
                        "search",
                        [
                            param("query", "plain words", None),
                            param("limit", "5", None),
                            param("filters", '{"k": [1, 2]}', None),
                            param("threshold", "0.5", None),
                        ],
                    )
                ]
            ),
            forced=False,
            calls=(
                (
                    "search",
                    {
                        "query": "plain words",
                        "limit": 5,
                        "filters": {"k": [1, 2]},
                        "threshold": 0.5,
                    },
                ),
            ),
        ),
        Case(
            "string hint wrong way round, schema decides",
            block([("get_weather", [param("city", "123", "false"), param("days", "7", "true")])]),
            forced=False,
            calls=(("get_weather", {"city": "123", "days": 7}),),
        ),
        Case(
            "an undeclared tool: the string hint decides",
            block(
                [
                    (
                        UNLISTED,
                        [
                            param("cmd", "ls -la", "true"),
                            param("timeout", "30", "false"),
                            param("raw", "[1]", "true"),
                        ],
                    )
                ]
            ),
            forced=False,
            calls=((UNLISTED, {"cmd": "ls -la", "timeout": 30, "raw": "[1]"}),),
        ),
        Case(
            "call without </think>: the block ends the reasoning",
            f"I will call it.\n\n{block([('get_weather', _W)])}",
            forced=True,
            calls=(("get_weather", {"city": "Paris", "days": 3}),),
            reasoning="I will call it.",
        ),
        Case(
            "one-line layout",
            "</think>" + block([("get_weather", _W), ("get_weather", _W)], nl=""),
            forced=True,
            calls=(("get_weather", {"city": "Paris", "days": 3}),) * 2,
        ),
        Case(
            "empty parameters",
            block([("get_weather", [])]),
            forced=False,
            calls=(("get_weather", {}),),
        ),
        Case("empty answer", "", forced=True),
    ]


HAND = _hand()


# -- generated cases ------------------------------------------------------------------------

_ALPHABET = st.sampled_from(
    list("abcxyz XYZ019.,;:!?-_()[]{}\\/'\"&%$#@*+=~`|^<>\n\t") + list("éü中文日本語☀️🙂—“”｜")
)
_TEXT = st.text(_ALPHABET, max_size=40).filter(lambda s: not any(m in s for m in MARKUP))
_JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32), _TEXT,
)  # fmt: skip
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)),
    max_leaves=6,
)
_VALUES = {
    "string": _TEXT,
    "integer": st.integers(-10**9, 10**9),
    "number": st.floats(allow_nan=False, allow_infinity=False),
    "boolean": st.booleans(),
    "object": st.dictionaries(_TEXT, _JSON, max_size=3),
    "array": st.lists(_TEXT, max_size=3),
}  # fmt: skip


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@st.composite
def _invoke(draw: st.DrawFn) -> tuple[str, list[str], dict[str, Any]]:
    """One invoke: (tool name, rendered parameters, the arguments they mean)."""
    name = draw(st.sampled_from([*_TYPES, UNLISTED]))
    schema = _TYPES.get(name) or {"cmd": "string", "count": "integer", "opts": "object"}
    keys = draw(st.lists(st.sampled_from(sorted(schema)), unique=True, max_size=len(schema)))
    params, args = [], {}
    for key in keys:
        kind = schema[key]
        value = draw(_VALUES[kind])
        if kind == "string":
            raw, hint = value, "true"
            # Leaving the hint out keeps a string only where the text is no JSON.
            if name in _TYPES and not _is_json(raw) and draw(st.booleans()):
                hint = None
        else:
            raw = json.dumps(value, ensure_ascii=draw(st.booleans()))
            hint = draw(st.sampled_from(["false", "false", None]))
        params.append(param(key, raw, hint))
        args[key] = value
    return name, params, args


@st.composite
def dsv4_answers(draw: st.DrawFn, *, truncation: bool = True) -> Case:
    """A DeepSeek-V4 answer: maybe reasoning, maybe content, maybe a call block, maybe
    cut short; the template's layout or a compact one, the wrapper's spelling variants."""
    forced = draw(st.booleans())
    reasoning = draw(_TEXT) if forced else ""
    content = draw(_TEXT)
    invokes = draw(st.lists(_invoke(), max_size=3))
    text = ""
    if invokes:
        sep = draw(st.sampled_from(["\n\n", "\n\n", "", "\n"]))
        wrapper = draw(
            st.sampled_from(["tool_calls", "tool_calls", "tool_calls", "toolcalls", "tool"])
        )
        nl = draw(st.sampled_from(["\n", "\n", ""]))
        calls_text = block([(n, p) for n, p, _ in invokes], wrapper=wrapper, nl=nl)
        omit_think_end = forced and draw(st.integers(0, 4)) == 0
        if omit_think_end:  # everything before the block is reasoning
            reasoning, content = reasoning + content, ""
            text = reasoning + sep + calls_text
            reasoning = _cut_separator(reasoning + sep)
        else:
            text = (reasoning + "</think>" if forced else "") + content + sep + calls_text
            content = _cut_separator(content + sep)
    else:
        text = (reasoning + "</think>" if forced else "") + content
    calls = tuple((n, a) for n, _, a in invokes)
    case = Case("generated", text, forced, calls=calls, reasoning=reasoning, content=content)
    if truncation and text and draw(st.sampled_from([False] * 4 + [True])):
        # Cut near the end as often as near the start: inside the last call, after the
        # complete ones, is the case that matters.
        back = draw(st.integers(1, len(text)))
        cut = len(text) - back if draw(st.booleans()) else back - 1
        # The calls whose invoke closed before the cut are complete.
        ends, at = [], 0
        for _ in calls:
            at = text.index(f"</{D}invoke>", at) + len(f"</{D}invoke>")
            ends.append(at)
        complete = tuple(c for c, end in zip(calls, ends, strict=True) if end <= cut)
        case = Case(
            "generated, cut", text[:cut], forced, calls=complete, truncated=True, text_known=False
        )
    return case


def _cut_separator(text: str) -> str:
    """Content before a call block loses the template's separator (it is the opener's)."""
    return text.removesuffix("\n\n")


def splits(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the given offsets (any order, repeats allowed)."""
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)] or [""]


def generated(n: int = 300) -> list[Case]:
    """``n`` generated answers, the same on every run (hypothesis, derandomized)."""
    cases: list[Case] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(dsv4_answers())
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    return cases
