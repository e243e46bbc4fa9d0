"""The stall detector inside a real frontend, under the load that broke Dynamo.

Eight concurrent chat requests with ~40k-token prompts. With ``thread-gil``
tokenization (HF ``encode`` in a thread, which holds the GIL) the detector records a
GIL stall; with the default (fastokens off the loop) it records none. Real time and
real threads, so no virtual clock here; the threshold is 50 ms rather than the
default 20 ms so that the OS preempting the loop on a busy 2-core machine is not
counted, while the GIL stall (100 ms and more) still is.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio

from frontend_fixture import serve_frontend

# A collection of the session's heap mid-test is a stall these tests did not make.
pytestmark = pytest.mark.usefixtures("frozen_heap")

CONCURRENT = 8
THRESHOLD_MS = 50


def _prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    return [" ".join(rng.choices(vocab, k=30_000)) for _ in range(CONCURRENT)]


async def _stall_records_under_long_prompts(**config: object) -> list[dict[str, Any]]:
    # The test's own blocking work comes first: httpx loads CA certificates when the
    # client is created (~0.1 s), which the detector would rightly report as a stall.
    prompts = _prompts(seed=len(config))  # built before the frontend watches its loop
    async with (
        httpx.AsyncClient(timeout=120) as client,
        serve_frontend(stall_threshold_ms=THRESHOLD_MS, **config) as (_, url),
    ):

        async def one(text: str) -> None:
            body = {
                "model": "deepseek-v4",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": text}],
            }
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 30_000

        async with trio.open_nursery() as nursery:
            for text in prompts:
                nursery.start_soon(one, text)
        records: list[dict[str, Any]] = (await client.get(f"{url}/debug/stalls")).json()
        return records


def _tokenization_stalls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records caused by tokenization: a GIL stall, or a loop stall in the preprocess code.

    A busy CI box can also preempt the loop thread for a while; such records name
    whatever code happened to run (the detector is right to report them) and are
    not what this test is about.
    """
    return [
        r
        for r in records
        if r["cause"] == "gil"
        or any("preprocess" in frame or "tokeniz" in frame for frame in r["stack"])
    ]


@pytest.mark.slow
async def test_gil_holding_tokenization_is_recorded_as_a_gil_stall() -> None:
    records = await _stall_records_under_long_prompts(
        tokenizer_backend="hf", tokenize_mode="thread-gil"
    )
    gil = [r for r in records if r["cause"] == "gil" and r["duration_s"] > THRESHOLD_MS / 1000]
    assert gil, records


async def test_default_tokenization_records_no_stall_under_the_same_load() -> None:
    records = await _stall_records_under_long_prompts()
    assert _tokenization_stalls(records) == []
    assert all(r["duration_s"] < 0.5 for r in records), records


@pytest.mark.slow
async def test_inline_tokenization_is_recorded_in_the_preprocess_stage() -> None:
    records = await _stall_records_under_long_prompts(
        tokenizer_backend="hf", tokenize_mode="inline"
    )
    caught = _tokenization_stalls(records)
    assert caught, records
    assert all(r["cause"] == "loop" for r in caught), caught
