"""What the parse stage costs the event loop: a long agentic answer (reasoning, content,
three DSML tool calls) taken token by token through the postprocess stage (detokenizer,
stop strings) alone, then through postprocess + parse, as the pipeline does per chunk.

Reports, per answer, the median over rounds of the CPU time on the loop, and the longest
single step (what one chunk can delay the loop by). Run it on two checkouts to compare
(docs/performance.md has the figures):

    python -m scripts.measure.answer_parse [--rounds 30] [--reasoning-tokens 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from frontend.postprocess import TextPostprocessor
from frontend.postprocess.parsers import make_parser
from frontend.preprocess.tokenizer import Tokenizer
from scripts.bench.prompts import WORDS

D = "｜DSML｜"
PROPERTIES = {"path": {"type": "string"}, "content": {"type": "string"}, "lines": {"type": "array"}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "parameters": {"type": "object", "properties": PROPERTIES}},
    }
    for n in ("read", "write", "grep")
]


def answer(rng: random.Random, reasoning_words: int) -> str:
    """Reasoning (the prompt opened it), a sentence, then three calls."""

    def words(n: int) -> str:
        return " ".join(rng.choices(WORDS, k=n))

    calls = "\n".join(
        f'<{D}invoke name="{name}">\n'
        f'<{D}parameter name="path" string="true">src/{words(1)}.py</{D}parameter>\n'
        f'<{D}parameter name="content" string="true">{words(150)}</{D}parameter>\n'
        f'<{D}parameter name="lines" string="false">{json.dumps(list(range(20)))}</{D}parameter>\n'
        f"</{D}invoke>"
        for name in ("read", "write", "grep")
    )
    return (
        f"{words(reasoning_words)}</think>{words(60)}\n\n<{D}tool_calls>\n{calls}\n</{D}tool_calls>"
    )


def one(tokenizer: Tokenizer, ids: list[int], parse: bool) -> tuple[float, float]:
    """(CPU seconds for the answer, the longest step) through postprocess [+ parse]."""
    post = TextPostprocessor(tokenizer.decode, special_ids=tokenizer.special_ids)
    parser = (
        make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
        if parse
        else None
    )
    longest = 0.0
    start = time.perf_counter()
    for token in ids:
        t0 = time.perf_counter()
        step = post.step((token,))
        if parser is not None and step.text:
            parser.feed(step.text)
        longest = max(longest, time.perf_counter() - t0)
    tail = post.finish()
    if parser is not None:
        parser.feed(tail)
        parser.finish()
    return time.perf_counter() - start, longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reasoning-tokens", type=int, default=2000)
    args = ap.parse_args()
    tokenizer = Tokenizer.load(None, "fastokens")
    text = answer(random.Random(7), args.reasoning_tokens)
    ids = list(tokenizer.encode_ids(text))
    print(f"answer: {len(ids)} tokens, {len(text)} characters")
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    gc.disable()
    for _ in range(args.rounds):  # alternated, so drift hits both alike
        for parse in (False, True):
            results[parse].append(one(tokenizer, ids, parse))
    gc.enable()
    for parse, runs in results.items():
        total = statistics.median(r[0] for r in runs)
        longest = statistics.median(r[1] for r in runs)
        label = "postprocess + parse" if parse else "postprocess only   "
        print(
            f"{label}: {total * 1e3:7.2f} ms per answer ({total / len(ids) * 1e6:5.2f} µs "
            f"per token), longest step {longest * 1e6:6.1f} µs"
        )
    extra = statistics.median(r[0] for r in results[True]) - statistics.median(
        r[0] for r in results[False]
    )
    print(
        f"the parse stage adds {extra * 1e3:.2f} ms per answer "
        f"({extra / len(ids) * 1e6:.2f} µs per token)"
    )


if __name__ == "__main__":
    main()
