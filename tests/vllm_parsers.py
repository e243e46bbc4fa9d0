"""vLLM's DeepSeek-V4 parsers over a batch of answers, in a process of their own.

tests/test_parsers_vllm.py runs this as a child, so that importing vLLM (and torch, with
its import-time warnings and a heap of millions of objects) stays out of the test
process. The parsers are composed as vLLM's server composes them for
``--tool-call-parser deepseek_v4 --reasoning-parser deepseek_v4
--enable-auto-tool-choice`` and parse each answer unary.

    python tests/vllm_parsers.py IN.json OUT.json

IN: a list of ``{"text", "thinking", "tools"}``; OUT: for each, ``{"reasoning",
"content", "calls": [[name, arguments JSON], ...]}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar


class _Tokenizer:
    """What vLLM's DeepSeek-V4 parsers ask of a tokenizer: a vocabulary and the special
    tokens, only to match markers by token id; with none, they match them as text."""

    all_special_tokens: ClassVar[list[str]] = []
    all_special_ids: ClassVar[list[int]] = []

    def get_vocab(self) -> dict[str, int]:
        return {}


def main(src: str, dst: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    parser_cls = ParserManager.get_parser(
        tool_parser_name="deepseek_v4", reasoning_parser_name="deepseek_v4", enable_auto_tools=True
    )
    assert parser_cls is not None
    with open(src, encoding="utf-8") as f:
        answers = json.load(f)
    results: list[dict[str, Any]] = []
    for answer in answers:
        kwargs = {"thinking": answer["thinking"]}
        request = ChatCompletionRequest(
            model="deepseek-v4",
            messages=[{"role": "user", "content": "hi"}],
            tools=answer["tools"],
            chat_template_kwargs=kwargs,
        )
        parser = parser_cls(_Tokenizer(), request.tools, chat_template_kwargs=kwargs)
        reasoning, content, calls = parser.parse(answer["text"], request, enable_auto_tools=True)
        results.append({
            "reasoning": reasoning or "",
            "content": content or "",
            "calls": [[c.name, c.arguments] for c in calls or ()],
        })  # fmt: skip
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(results, f, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
