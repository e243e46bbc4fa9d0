"""headwater's DeepSeek-V4 parsers against vLLM's own, unary.

vLLM's ``--tool-call-parser deepseek_v4 --reasoning-parser deepseek_v4``, composed as its
server composes them (``ParserManager.get_parser``), parses every answer of the corpus
(tests/parser_corpus.py: the hand-written cases and 300 generated ones, the same on
every run);
headwater's parsers must give the same tool calls (names and parsed arguments) and the
same reasoning, and the same content where vLLM keeps it.

Where vLLM is wrong, a test below names the case and states what headwater does
instead (docs/api.md, "Parsers"):

- a call cut by ``max_tokens``: vLLM returns it, with the arguments it had so far (or
  none); headwater drops it (the complete calls before it are returned);
- text after the call block: vLLM drops it; headwater returns it as content;
- ``|DSML|`` spelled with ASCII bars: vLLM leaves the markup in ``content``;
  headwater parses the calls;
- ``<think>…</think>`` inside an argument's value: vLLM takes it for reasoning and cuts
  it out of the value; headwater keeps the value as written (inside a call only the
  call's markers are live);
- an answer cut inside a marker (``…</thi``): vLLM keeps the partial marker as text;
  headwater drops it (it is the start of markup max_tokens cut, not text);
- vLLM trims the trailing whitespace of the reasoning and keeps the template's
  ``\\n\\n`` before a call block in ``content``; headwater keeps the reasoning exact and
  drops the separator, so both render back to the tokens the model produced. The
  comparison below ignores that whitespace.

vLLM runs in a child process (tests/vllm_parsers.py), so its import stays out of the
test process. Without vLLM the tests skip, except under CI (``CI=true``), where a
missing vLLM is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from parser_corpus import HAND, Case, D, block, generated, param, unary

CHILD = Path(__file__).with_name("vllm_parsers.py")

_CALL = block([("get_weather", [param("city", "Oslo", "true")])])
#: The cases where vLLM is wrong (tests at the end of the module).
CUT_CALL = Case("cut call", "</think>" + _CALL[: _CALL.index("Oslo") + 2], True, truncated=True)
AFTER_BLOCK = Case("after", f"Sure.\n\n{_CALL}\nAnything else?", forced=False)
ASCII_BARS = Case("ascii bars", _CALL.replace(D, "|DSML|"), forced=False)


@dataclass
class VllmParse:
    reasoning: str
    content: str
    calls: list[tuple[str, Any]]  # (name, arguments object)


@pytest.fixture(scope="module")
def corpus() -> list[Case]:
    return [*HAND, *generated(300)]


@pytest.fixture(scope="module")
def vllm_parse(corpus: list[Case]) -> Callable[[Case], VllmParse]:
    """vLLM's parse of any case of the module, all parsed at once in a child process
    (tests/vllm_parsers.py)."""
    if importlib.util.find_spec("vllm") is None:
        why = "vLLM is not installed (run `make vllm`): its parsers are the reference"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI must provide it")
        pytest.skip(why)
    cases = [*corpus, CUT_CALL, AFTER_BLOCK, ASCII_BARS]
    with tempfile.TemporaryDirectory(prefix="headwater-parsers-") as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        answers = [{"text": c.text, "thinking": c.forced, "tools": c.tools} for c in cases]
        src.write_text(json.dumps(answers, ensure_ascii=False), encoding="utf-8")
        done = subprocess.run(
            [sys.executable, "-W", "ignore", str(CHILD), str(src), str(dst)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(dst.read_text(encoding="utf-8"))
    by_answer = {
        (c.text, c.forced): VllmParse(
            r["reasoning"], r["content"], [(name, json.loads(args)) for name, args in r["calls"]]
        )
        for c, r in zip(cases, results, strict=True)
    }
    return lambda case: by_answer[(case.text, case.forced)]


def assert_agree(case: Case, vllm: VllmParse) -> None:
    """headwater's parse of ``case`` is vLLM's, but where vLLM is wrong (see the module
    docstring): a cut call, a cut marker, text after the block, whitespace."""
    ours = unary(case)
    calls = ours.call_objects()
    reasoning, vllm_reasoning = ours.reasoning.rstrip(), vllm.reasoning.rstrip()
    if case.truncated:
        # vLLM returns the cut call too; the complete ones before it must agree.
        assert vllm.calls[: len(calls)] == calls
        assert len(vllm.calls) - len(calls) <= 1
        # vLLM keeps the start of a marker the cut left; headwater drops it.
        assert vllm_reasoning.startswith(reasoning)
        assert _partial_marker(vllm_reasoning[len(reasoning) :])
    else:
        assert calls == vllm.calls
        assert reasoning == vllm_reasoning
        content = ours.content.removesuffix(case.trailing)
        assert content.strip() == vllm.content.strip()


def _partial_marker(text: str) -> bool:
    text = text.lstrip()
    return not text or any(m.startswith(text) for m in ("</think>", f"<{D}tool_calls>"))


@pytest.mark.parametrize("case", HAND, ids=[c.name for c in HAND])
def test_hand_written_case_agrees_with_vllm(
    case: Case, vllm_parse: Callable[[Case], VllmParse]
) -> None:
    if not case.vllm_wrong:
        assert_agree(case, vllm_parse(case))
        return
    # Where vLLM is wrong, the case says how (and headwater's parse is the one the case
    # was built from: tests/test_parsers.py).
    with pytest.raises(AssertionError):
        assert_agree(case, vllm_parse(case))


def test_300_generated_answers_agree_with_vllm(
    corpus: list[Case], vllm_parse: Callable[[Case], VllmParse]
) -> None:
    cases = corpus[len(HAND) :]
    assert len(cases) == 300
    failures = []
    for case in cases:
        try:
            assert_agree(case, vllm_parse(case))
        except AssertionError as exc:
            failures.append(f"{case.text!r} (thinking={case.forced}): {exc}")
    assert not failures, f"{len(failures)} disagree:\n" + "\n\n".join(failures[:5])


# -- where vLLM is wrong: the case, and headwater's behaviour --------------------------------


def test_vllm_returns_a_call_cut_by_max_tokens_headwater_drops_it(
    vllm_parse: Callable[[Case], VllmParse],
) -> None:
    assert vllm_parse(CUT_CALL).calls == [("get_weather", {})]  # invented: never made
    assert unary(CUT_CALL).calls == []


def test_vllm_drops_text_after_the_call_block_headwater_keeps_it(
    vllm_parse: Callable[[Case], VllmParse],
) -> None:
    assert vllm_parse(AFTER_BLOCK).content.strip() == "Sure."
    assert unary(AFTER_BLOCK).content == "Sure.\nAnything else?"


def test_vllm_leaks_ascii_bar_dsml_into_content_headwater_parses_it(
    vllm_parse: Callable[[Case], VllmParse],
) -> None:
    assert "<|DSML|tool_calls>" in vllm_parse(ASCII_BARS).content
    ours = unary(ASCII_BARS)
    assert (ours.content, ours.call_objects()) == ("", [("get_weather", {"city": "Oslo"})])
