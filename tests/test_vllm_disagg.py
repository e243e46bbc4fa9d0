"""The vLLM engine, disaggregated: a prefill and a decode vLLM moving KV over NIXL.

Test policy: the session's prefill + decode workers, vLLM in-process in each
(tests/vllm_fixture.py; the decode vLLM runs without prefix caching, so a prompt token it
did not compute can only have come over NIXL, which its worker's metrics port shows)
against the session's aggregated vLLM's API server as the reference: the same
weights, greedy, token for token. Prompts shorter and longer than one KV block (64
tokens, ``--vllm-block-size``); small ``max_tokens``; 600 s per test (the first waits
for the servers).
"""

from __future__ import annotations

import httpx
import pytest
import trio

from headwater.plane.base import WorkerError
from headwater.wire import ErrorCode, FinishReason, KvHandle, Role

from frontend_fixture import serve_frontend, shared_tokenizer
from vllm_fixture import VllmCluster
from vllm_helpers import (
    Metrics,
    connect,
    generate,
    metric,
    prompt,
    request,
    sse_events,
    tokens,
    vllm_generate,
    vllm_metrics,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0.0}
LENGTHS = (40, 300)  # below and above one 64-token block (--vllm-block-size)


def by_source(values: Metrics, source: str) -> float:
    return metric(values, "vllm:prompt_tokens_by_source_total", source=source)


async def test_prefill_then_decode_equals_one_server_and_the_kv_came_over_nixl(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    prefill = vllm_cluster.workers[Role.PREFILL]
    decode = vllm_cluster.workers[Role.DECODE]
    to_prefill = await connect(prefill.instance, nursery)
    to_decode = await connect(decode.instance, nursery)
    before = await vllm_metrics(decode.metrics_url)
    for n in LENGTHS:
        ids = prompt(n, 100 + n)
        want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 10})
        (handoff,) = await generate(to_prefill, request(f"pd-{n}", ids, 10))
        handle = handoff.kv_handle
        assert handle is not None
        assert handle.worker_id == prefill.worker_id
        assert handle.params["do_remote_prefill"] is True
        assert handle.num_tokens == n
        assert handoff.token_ids == want.token_ids[:1]  # the prefill's first token
        chunks = await generate(to_decode, request(f"pd-{n}", ids, 10, handle=handle))
        assert tokens(chunks) == want.token_ids
        assert chunks[-1].finish_reason is FinishReason.LENGTH
    after = await vllm_metrics(decode.metrics_url)

    def grew(source: str) -> float:
        return by_source(after, source) - by_source(before, source)

    transferred, computed = grew("external_kv_transfer"), grew("local_compute")
    print(f"decode prompt tokens: {transferred:.0f} over NIXL, {computed:.0f} computed")
    assert transferred == sum(LENGTHS)
    assert computed == 0
    xfers = metric(after, "vllm:nixl_xfer_time_seconds_count") - metric(
        before, "vllm:nixl_xfer_time_seconds_count"
    )
    assert xfers >= len(LENGTHS)


async def test_disaggregated_through_the_frontend_unary_and_streaming(
    vllm_cluster: VllmCluster,
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    prefill = vllm_cluster.workers[Role.PREFILL]
    decode = vllm_cluster.workers[Role.DECODE]
    tokenizer = shared_tokenizer()
    workers = f"{prefill.address}?role=prefill,{decode.address}?role=decode"
    async with (
        serve_frontend(workers=workers, context_length=8192) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        with trio.fail_after(30):
            while (await http.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        for n in LENGTHS:
            for stream in (False, True):
                ids = prompt(n, 200 + n + stream)
                want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 8})
                body = {
                    "model": "deepseek-v4",
                    "prompt": ids,
                    "max_tokens": 8,
                    "temperature": 0,
                    "stream": stream,
                }
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if stream:
                    text = "".join(c["text"] for e in sse_events(r.content) for c in e["choices"])
                else:
                    text = r.json()["choices"][0]["text"]
                    assert r.json()["usage"]["completion_tokens"] == 8
                assert text == tokenizer.decode(want.token_ids), (n, stream)


async def test_a_failed_kv_transfer_is_a_retryable_error_not_a_hang(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    prefill = vllm_cluster.workers[Role.PREFILL]
    decode = vllm_cluster.workers[Role.DECODE]
    to_prefill = await connect(prefill.instance, nursery)
    to_decode = await connect(decode.instance, nursery)
    ids = prompt(150, 300)
    (handoff,) = await generate(to_prefill, request("bad-kv", ids, 4))
    assert handoff.kv_handle is not None
    params = {**handoff.kv_handle.params, "remote_engine_id": "no-such-engine"}
    bad = KvHandle(prefill.worker_id, prefill.address, "bad", len(ids), params=params)
    started = trio.current_time()
    with trio.fail_after(90), pytest.raises(WorkerError) as failed:
        await generate(to_decode, request("bad-kv", ids, 4, handle=bad))
    print(f"failed transfer reported in {trio.current_time() - started:.1f} s")
    assert failed.value.code is ErrorCode.KV_TRANSFER_FAILED
    # The decode's vLLM stays up (its engine core the same) and serves the next request.
    pids = list(decode.vllm_pids)
    assert len(tokens(await generate(to_decode, request("after-bad-kv", ids, 4)))) == 4
    decode.refresh()
    assert decode.vllm_pids == pids
