"""The trace replay of docs/routing.md's benchmark (scripts/trace_replay.py): the trace
turned into prompts as documented, and a short replay against a frontend on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts.trace_replay import TRACE, load

from frontend_fixture import frontend_in_thread


def test_shared_trace_blocks_are_shared_prompt_tokens() -> None:
    reqs = load(
        TRACE,
        skip=0,
        requests=3,
        time_scale=2,
        block_tokens=64,
        max_prompt_blocks=64,
        max_tokens=64,
        vocab=(1000, 100_000),
    )
    # The trace's first three requests share their first 512-token block (hash id 0)
    # and nothing after it; they arrive together; 6,758 tokens scale to 845.
    a, b, c = reqs
    assert a.prompt[:64] == b.prompt[:64] == c.prompt[:64]
    assert a.prompt[64:128] != b.prompt[64:128]
    assert len(a.prompt) == 845
    assert a.at == b.at == 0.0
    assert a.max_tokens == 63  # 500 answer tokens scaled, under the cap of 64
    assert all(1000 <= t < 100_000 for t in a.prompt)


@pytest.mark.slow
def test_a_short_replay_reports_every_request() -> None:
    with frontend_in_thread(mode="agg") as url:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "scripts.trace_replay",
                "--url",
                url,
                "--requests",
                "6",
                "--time-scale",
                "50",
                "--block-tokens",
                "16",
                "--max-tokens",
                "4",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    summary = json.loads(out.stdout)
    assert (summary["requests"], summary["failed"]) == (6, 0), summary
    assert summary["ttft_p50"] > 0
    assert summary["prompt_tokens"] > 0
