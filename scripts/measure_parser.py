"""CPU the parse stage costs a request: a long DeepSeek-V4 answer with thinking and tools.

The answer: ~2,000 tokens of reasoning, a line of content and three ``write_file`` calls
in DSML (each with a code file as its argument), as DeepSeek-V4 writes them in thinking
mode. It is tokenized with the real DeepSeek-V4 tokenizer and turned back into the
pieces the detokenizer hands the parse stage (one per token), so the parser sees what it
sees in production. One round builds the request's parser (``deepseek_v4`` for both,
with the tools) and feeds it every piece, then finishes; the CPU time of the round
(``thread_time``) is the figure, median over the rounds. The passthrough (``none``
parsers) is timed beside it, so the parse's own share shows.

    python -m scripts.measure_parser [--rounds 300]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from frontend.postprocess.detokenizer import IncrementalDetokenizer
from frontend.postprocess.parsers import make_parser
from frontend.preprocess.tokenizer import Tokenizer

D = "｜DSML｜"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"},
            "overwrite": {"type": "boolean"}}}}},
]  # fmt: skip
_REASONING = (
    "The user wants the parser split into modules. Let me look at what <AnswerStream> "
    "needs: the markers, the held tail (at most a marker's length), and the formats. "
    "If the piece is 'x < y' the '<' may start a marker, so it waits; 1 < 2 is text. "
)
_CODE = (
    "def feed(self, text: str) -> AnswerDelta:\n"
    '    """Take the next piece; return what can be emitted now."""\n'
    "    buf = self._held + text if self._held else text\n"
    "    if len(buf) > 0 and buf[0] == '<':\n"
    "        return self._scan(buf)  # a marker may start here\n"
)


def answer(tokenizer: Tokenizer, target_tokens: int = 2_000) -> str:
    """Reasoning up to about ``target_tokens`` with the content and the calls."""
    invokes = "\n".join(
        f'<{D}invoke name="write_file">\n'
        f'<{D}parameter name="path" string="true">src/parse_{i}.py</{D}parameter>\n'
        f'<{D}parameter name="content" string="true">{_CODE * 4}</{D}parameter>\n'
        f'<{D}parameter name="overwrite" string="false">true</{D}parameter>\n'
        f"</{D}invoke>"
        for i in range(3)
    )
    tail = f"</think>Writing the three files now.\n\n<{D}tool_calls>\n{invokes}\n</{D}tool_calls>"
    budget = target_tokens - len(tokenizer.encode_ids(tail))
    reasoning = ""
    while len(tokenizer.encode_ids(reasoning)) < budget:
        reasoning += _REASONING
    return reasoning + tail


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """``text`` as the detokenizer emits it, token by token."""
    detok = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    out = [detok.add([token]) for token in tokenizer.encode_ids(text)]
    out.append(detok.flush())
    assert "".join(out) == text
    return [p for p in out if p]


def round_cpu(feed_pieces: list[str], tool_parser: str, reasoning_parser: str) -> float:
    """CPU seconds of one request's parse: build the parser, feed, finish."""
    t0 = time.thread_time()
    parser = make_parser(tool_parser, reasoning_parser, tools=TOOLS, reasoning_forced=True)
    for piece in feed_pieces:
        parser.feed(piece)
    parser.finish()
    return time.thread_time() - t0


def median_cpu(feed_pieces: list[str], names: tuple[str, str], rounds: int) -> float:
    for _ in range(min(rounds, 20)):  # warm-up
        round_cpu(feed_pieces, *names)
    gc.disable()  # the collector's pauses are not the parser's
    try:
        return statistics.median(round_cpu(feed_pieces, *names) for _ in range(rounds))
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    tokenizer = Tokenizer.load(None)
    text = answer(tokenizer)
    feed = pieces(tokenizer, text)
    check = make_parser("deepseek_v4", "deepseek_v4", tools=TOOLS, reasoning_forced=True)
    for piece in feed:
        check.feed(piece)
    check.finish()
    assert check.tool_calls_made == 3
    parse = median_cpu(feed, ("deepseek_v4", "deepseek_v4"), args.rounds)
    passthrough = median_cpu(feed, ("none", "none"), args.rounds)
    record = {
        "tokens": len(tokenizer.encode_ids(text)),
        "pieces": len(feed),
        "chars": len(text),
        "tool_calls": 3,
        "rounds": args.rounds,
        "cpu_ms_per_request": round(parse * 1e3, 3),
        "cpu_us_per_piece": round(parse / len(feed) * 1e6, 3),
        "passthrough_cpu_ms_per_request": round(passthrough * 1e3, 3),
    }
    print(
        f"deepseek_v4 parse of a {record['tokens']:,}-token answer (reasoning + 3 calls), "
        f"{record['pieces']:,} pieces: {record['cpu_ms_per_request']} ms CPU per request "
        f"({record['cpu_us_per_piece']} us per piece; passthrough "
        f"{record['passthrough_cpu_ms_per_request']} ms), median of {args.rounds}"
    )
    print(json.dumps(record))


if __name__ == "__main__":
    main()
