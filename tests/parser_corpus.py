"""A corpus of DeepSeek-V4 answers for the parse stage's tests: hand-written edge cases
and generated ones (seeded: the same corpus every run).

Each :class:`Case` is the answer's text as the model wrote it, whether the prompt forced
reasoning, whether it was cut (``max_tokens``), the request's tools, and what a correct
parse gives: ``reasoning``, ``content`` and ``calls`` as (name, arguments as an object).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

D = "｜DSML｜"
BLOCK = f"<{D}tool_calls>"
BLOCK_END = f"</{D}tool_calls>"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "options": {"type": "object"},
                    "overwrite": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
    },
]
TYPES = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in TOOLS}


@dataclass
class Case:
    name: str
    text: str
    forced: bool = False
    truncated: bool = False
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def param(name: str, value: Any, string: str | None = "auto") -> str:
    """One DSML parameter; *string* "auto": the attribute as the renderer writes it;
    None: the attribute left out (as models sometimes do)."""
    if string == "auto":
        string = "true" if isinstance(value, str) else "false"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    attr = "" if string is None else f' string="{string}"'
    return f'<{D}parameter name="{name}"{attr}>{text}</{D}parameter>'


def invoke(name: str, params: list[str]) -> str:
    return f'<{D}invoke name="{name}">\n' + "\n".join(params) + f"\n</{D}invoke>"


def block(invokes: list[str], start: str = BLOCK) -> str:
    return f"{start}\n" + "\n".join(invokes) + f"\n{BLOCK_END}"


CODE = 'if a < b and "q" > \'r\':\n    print("<tag>")\n'


def hand_written() -> list[Case]:
    w = {"city": "Paris", "days": 3}
    w_call = invoke("get_weather", [param("city", "Paris"), param("days", 3)])
    return [
        Case("plain", "Hello, world.", content="Hello, world."),
        Case(
            "reasoning only, forced",
            "Let me think about it.",
            forced=True,
            reasoning="Let me think about it.",
        ),
        Case(
            "reasoning then answer, forced",
            "Hmm.</think>The answer is 4.",
            forced=True,
            reasoning="Hmm.",
            content="The answer is 4.",
        ),
        Case(
            "reasoning tags in the answer",
            "<think>Hmm.</think>Four.",
            reasoning="Hmm.",
            content="Four.",
        ),
        Case("one call", block([w_call]), calls=[("get_weather", w)]),
        Case(
            "content before a call",
            "Let me check.\n\n" + block([w_call]),
            content="Let me check.\n\n",
            calls=[("get_weather", w)],
        ),
        Case(
            "reasoning, content, two calls",
            "I need the weather.</think>Checking." + block([w_call, invoke("noop", [])]),
            forced=True,
            reasoning="I need the weather.",
            content="Checking.",
            calls=[("get_weather", w), ("noop", {})],
        ),
        Case(
            "unicode and markup in a string",
            block(
                [
                    invoke(
                        "write_file",
                        [
                            param("path", "/tmp/ünï 文件.txt"),
                            param("content", CODE),
                        ],
                    )
                ]
            ),
            calls=[("write_file", {"path": "/tmp/ünï 文件.txt", "content": CODE})],
        ),
        Case(
            "nested JSON argument",
            block(
                [
                    invoke(
                        "write_file",
                        [
                            param("path", "a"),
                            param("options", {"mode": [1, {"x": None}], "é": True}),
                            param("overwrite", False),
                        ],
                    )
                ]
            ),
            calls=[
                (
                    "write_file",
                    {
                        "path": "a",
                        "options": {"mode": [1, {"x": None}], "é": True},
                        "overwrite": False,
                    },
                )
            ],
        ),
        Case(
            "missing string attribute",
            block(
                [
                    invoke(
                        "get_weather",
                        [param("city", "Paris", string=None), param("days", 3, string=None)],
                    )
                ]
            ),
            calls=[("get_weather", w)],
        ),
        Case(
            "spelling variant toolcalls",
            block([w_call], start=f"<{D}toolcalls>"),
            calls=[("get_weather", w)],
        ),
        Case(
            "spelling variant tool", block([w_call], start=f"<{D}tool>"), calls=[("get_weather", w)]
        ),
        Case(
            "a call inside the reasoning",
            "Calling now." + block([w_call]),
            forced=True,
            reasoning="Calling now.",
            calls=[("get_weather", w)],
        ),
        Case(
            "cut inside the second call",
            block([w_call, invoke("write_file", [param("path", "a")])])[:-40],
            truncated=True,
            calls=[("get_weather", w)],
        ),
        Case("cut inside the first call", block([w_call])[:60], truncated=True),
        Case(
            "cut inside a marker",
            "Let me check." + BLOCK[:5],
            truncated=True,
            content="Let me check." + BLOCK[:5],
        ),
        Case(
            "a lone less-than",
            "a < b, and <thinking> is not a tag",
            content="a < b, and <thinking> is not a tag",
        ),
        # The string attribute the wrong way round: the tool's schema decides.
        Case(
            "string attribute the wrong way round",
            block(
                [
                    invoke(
                        "get_weather",
                        [param("city", "123", string="false"), param("days", "7", string="true")],
                    )
                ]
            ),
            calls=[("get_weather", {"city": "123", "days": 7})],
        ),
        Case(
            "a call without its block",
            "Let me check.\n\n" + w_call,
            content="Let me check.\n\n",
            calls=[("get_weather", w)],
        ),
    ]


_WORDS = [
    "the",
    "weather",
    "is",
    "Paris",
    "文件",
    "naïve",
    "<",
    ">",
    '"',
    "'",
    "&",
    "\\",
    "{",
    "}",
    "[",
    "]",
    ":",
    "\n",
    "  ",
    "é",
    "😀",
    "<b>",
    "</",
    "=",
    "DSML",
    "｜",
]


def _words(rng: random.Random, low: int, high: int) -> str:
    count = rng.randint(low, high)
    return "".join(rng.choice(_WORDS) + rng.choice(["", " "]) for _ in range(count))


def _value(rng: random.Random, kind: str) -> Any:
    if kind == "string":
        return _words(rng, 1, 12).strip() or "x"
    if kind == "integer":
        return rng.randint(-1000, 10**6)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_words(rng, 1, 3).strip() or "y" for _ in range(rng.randint(0, 3))]
    return {"k": rng.randint(0, 9), "nested": {"list": [1.5, None, "z"], "s": _words(rng, 0, 3)}}


def _call(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    tool = rng.choice(list(TYPES))
    args: dict[str, Any] = {}
    params = []
    for name, spec in TYPES[tool].items():
        if rng.random() < 0.3:
            continue
        value = _value(rng, spec.get("type", "object"))
        args[name] = value
        # A missing attribute now and then: the schema types it.
        params.append(param(name, value, string=None if rng.random() < 0.15 else "auto"))
    return tool, args, invoke(tool, params)


def generated(n: int, seed: int = 20261203) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        forced = rng.random() < 0.5
        reasoning = _words(rng, 0, 20) if forced else ""
        reasoning = reasoning.replace("<", "(")  # reasoning text without markers
        content = _words(rng, 0, 15).replace("<", "(") if rng.random() < 0.6 else ""
        calls = [_call(rng) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))]
        text = (reasoning + "</think>" if forced else "") + content
        if calls:
            start = rng.choice([BLOCK, BLOCK, BLOCK, f"<{D}toolcalls>", f"<{D}tool>"])
            text += "\n\n" + block([c[2] for c in calls], start=start)
        # What a parse gives: the reasoning without its trailing whitespace (as vLLM's),
        # the content with the blank line before the calls, unless it is only whitespace.
        said = content + "\n\n" if calls else content
        case = Case(
            f"generated {i}",
            text,
            forced=forced,
            reasoning=reasoning.rstrip(),
            content="" if calls and not said.strip() else said,
            calls=[(c[0], c[1]) for c in calls],
        )
        if calls and rng.random() < 0.2:  # cut by max_tokens inside the last call
            last = text.rindex(f'<{D}invoke name="')
            cut = rng.randint(last + 1, len(text) - len(BLOCK_END) - len(f"</{D}invoke>") - 2)
            case.text, case.truncated, case.calls = text[:cut], True, case.calls[:-1]
        cases.append(case)
    return cases


def corpus() -> list[Case]:
    return hand_written() + generated(320)
