"""The vLLM engine, aggregated: headwater's output is vLLM's own, token for token.

Test policy: the session's vLLM workers (tests/vllm_fixture.py: loopback, free ports,
``--enforce-eager``, the tiny model) are shared; each test uses prompts of its own
(salted) so prefix caching between tests cannot change what it measures, keeps
``max_tokens`` small, and gets 300 s (the first waits for the servers). vLLM's own
``/inference/v1/generate`` on the same server is the reference.
"""

from __future__ import annotations

import pytest
import trio

from headwater.plane.client import connect_worker
from headwater.wire import FinishReason, Role

from vllm_fixture import VllmCluster
from vllm_helpers import generate, prompt, request, tokens, vllm_generate

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0.0}


async def test_greedy_output_equals_vllms_own(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect_worker(agg.instance, nursery)
    for n, salt in ((5, 1), (130, 2), (1000, 3)):
        ids = prompt(n, salt)
        want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 12})
        chunks = await generate(client, request(f"exact-{n}", ids, 12))
        assert tokens(chunks) == want.token_ids
        assert len(set(want.token_ids)) > 3  # the tiny model's output varies
        assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_concurrent_requests_batched_together_stay_exact(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect_worker(agg.instance, nursery)
    prompts = [prompt(40 + 30 * i, 10 + i) for i in range(6)]
    wanted = [await vllm_generate(agg.vllm_url, p, {**GREEDY, "max_tokens": 16}) for p in prompts]
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = tokens(await generate(client, request(f"batch-{i}", prompts[i], 16)))

    async with trio.open_nursery() as inner:
        for i in range(len(prompts)):
            inner.start_soon(one, i)
    assert [got[i] for i in range(len(prompts))] == [w.token_ids for w in wanted]
