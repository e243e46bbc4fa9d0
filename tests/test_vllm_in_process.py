"""vLLM in the worker's process (``--vllm-client in-process``) against vLLM's own server.

Test policy: the session's decode worker runs vLLM in-process (tests/vllm_fixture.py)
and serves a request without a KV handle as an aggregated worker would; the session's
aggregated worker runs vLLM behind its API server, whose token-in API is the reference.
Same weights, the same request: the same tokens (greedy, and seeded with every
sampling field), the same logprobs and prompt logprobs through headwater's engine;
a stream closed early leaves nothing running in vLLM (its own gauge, on the worker's
metrics port); an engine core killed mid-stream fails its request as retryable and
comes back. The last test kills the decode's engine core: it runs after the disagg
tests, and waits for the restart. 600 s per test (the first waits for the servers).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest
import trio

from headwater.plane.base import WorkerError
from headwater.wire import ErrorCode, FinishReason, Role, TokenLogprobs

from vllm_fixture import VllmCluster, VllmWorker
from vllm_helpers import (
    connect,
    generate,
    metric,
    prompt,
    request,
    tokens,
    vllm_generate,
    vllm_metrics,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

SEEDED: dict[str, Any] = {"temperature": 0.9, "seed": 11}
EVERY: dict[str, Any] = {
    "top_k": 3,
    "min_p": 0.2,
    "presence_penalty": 1.5,
    "frequency_penalty": -1.5,
    "repetition_penalty": 1.8,
}


async def test_in_process_answers_equal_vllms_own_server(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    decode = vllm_cluster.workers[Role.DECODE]
    client = await connect(decode.instance, nursery)
    for n, salt in ((20, 1), (150, 2), (700, 3)):
        ids = prompt(n, 400 + salt)
        want = await vllm_generate(agg.vllm_url, ids, {"temperature": 0.0, "max_tokens": 12})
        chunks = await generate(client, request(f"in-process-{n}", ids, 12))
        assert tokens(chunks) == want.token_ids, n
        assert chunks[-1].finish_reason is FinishReason(want.finish_reason)
    # Sampling, with every field at once, seeded: the same draw.
    ids = prompt(40, 101)
    want = await vllm_generate(agg.vllm_url, ids, {**SEEDED, "max_tokens": 12, **EVERY})
    got = await generate(client, request("in-process-every", ids, 12, **SEEDED, **EVERY))
    assert tokens(got) == want.token_ids
    # logit_bias, keyed by id: a bias of 100 on one id makes greedy decoding say it.
    favourite = next(t for t in range(1000, 2000) if t not in want.token_ids)
    chunks = await generate(
        client,
        request("in-process-bias", ids, 4, ignore_eos=True, logit_bias=((favourite, 100.0),)),
    )
    assert tokens(chunks) == [favourite] * 4


def _same(mine: tuple[TokenLogprobs, ...], theirs: tuple[TokenLogprobs, ...]) -> None:
    """Equal entries: the same ids and ranks, the same numbers to float noise (two
    vLLM instances, each computing alone)."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.rank == b.rank
        assert a.top_ids == b.top_ids
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-5)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, rel=1e-4, abs=1e-5)


async def test_logprobs_and_prompt_logprobs_equal_the_api_servers(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = await connect(vllm_cluster.workers[Role.AGG].instance, nursery)
    decode = await connect(vllm_cluster.workers[Role.DECODE].instance, nursery)
    ids = prompt(40, 70)
    asked: dict[str, Any] = {"logprobs": 5, "prompt_logprobs": 3, "ignore_eos": True}
    theirs = await generate(agg, request("lp-api-server", ids, 6, **asked))
    mine = await generate(decode, request("lp-in-process", ids, 6, **asked))
    assert tokens(mine) == tokens(theirs)
    # Prompt logprobs on the first chunk only (in-process from the stream's first
    # output; through the API server from a request of their own).
    assert mine[0].prompt_logprobs is not None
    assert theirs[0].prompt_logprobs is not None
    assert len(mine[0].prompt_logprobs) == len(ids) - 1
    _same(mine[0].prompt_logprobs, theirs[0].prompt_logprobs)
    assert all(c.prompt_logprobs is None for c in mine[1:])
    token_lps = [lp for c in mine for lp in c.logprobs or ()]
    assert len(token_lps) == 6
    assert all(len(lp.top_ids) == 5 for lp in token_lps)
    _same(tuple(token_lps), tuple(lp for c in theirs for lp in c.logprobs or ()))


async def running(worker: VllmWorker) -> float:
    return metric(await vllm_metrics(worker.metrics_url), "vllm:num_requests_running")


async def test_a_closed_stream_is_aborted_in_the_engine(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    decode = vllm_cluster.workers[Role.DECODE]
    client = await connect(decode.instance, nursery)
    # vLLM's own series, from the worker's metrics port: vLLM runs in the worker.
    assert metric(await vllm_metrics(decode.metrics_url), "vllm:num_requests_waiting") == 0
    with trio.fail_after(60):  # what earlier tests left running ends first
        while await running(decode):
            await trio.sleep(0.2)
    req = request("in-process-abort", prompt(30, 500), 2000, ignore_eos=True)
    async with client.stream(req) as replies:
        async for _ in replies:
            break  # one chunk, then the stream closes
    with trio.fail_after(15):
        while await running(decode):
            await trio.sleep(0.1)


async def test_a_killed_engine_core_fails_its_request_retryably_and_comes_back(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    decode = vllm_cluster.workers[Role.DECODE]
    client = await connect(decode.instance, nursery)
    killed = decode.vllm_pid
    ids = prompt(30, 600)
    req = request("in-process-kill", ids, 2000, ignore_eos=True)

    async def kill_mid_stream() -> None:
        async with client.stream(req) as replies:
            async for _ in replies:
                with contextlib.suppress(ProcessLookupError):  # reaped after the first
                    os.kill(killed, signal.SIGKILL)

    with pytest.raises(WorkerError) as failed:
        await kill_mid_stream()
    assert failed.value.code is ErrorCode.SHUTTING_DOWN  # retryable: the frontend migrates
    with trio.fail_after(300):  # a vLLM start on two shared cores
        while decode.vllm_pid == killed:
            await trio.sleep(0.5)
    want = await vllm_generate(agg.vllm_url, ids, {"temperature": 0.0, "max_tokens": 6})
    chunks = await generate(client, request("in-process-after", ids, 6))
    assert tokens(chunks) == want.token_ids
    print(f"engine core {killed} killed; {decode.vllm_pid} serves")
