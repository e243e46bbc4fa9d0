"""The vLLM engine, aggregated: headwater's output is vLLM's own, token for token.

Test policy: the session's vLLM workers (tests/vllm_fixture.py: loopback, free ports,
``--enforce-eager``, the tiny model) are shared; each test uses prompts of its own
(salted) so prefix caching between tests cannot change what it measures, keeps
``max_tokens`` small, and gets 300 s (the first waits for the servers). vLLM's own
``/inference/v1/generate`` on the same server is the reference.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import trio

from headwater.plane.base import WorkerInstance
from headwater.wire import FinishReason, Role
from workers.engines.vllm import VllmConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

from frontend_fixture import serve_frontend, shared_tokenizer
from vllm_fixture import TINY_MODEL, VllmCluster
from vllm_helpers import connect, generate, prompt, request, sse_events, tokens, vllm_generate

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0.0}


async def wait_healthy(http: httpx.AsyncClient) -> None:
    """Until the frontend has connected to its workers."""
    with trio.fail_after(30):
        while (await http.get("/health")).status_code != 200:
            await trio.sleep(0.05)


def worker_instance(worker: RunningWorker) -> WorkerInstance:
    return WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)


async def test_greedy_output_equals_vllms_own(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
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
    client = await connect(agg.instance, nursery)
    prompts = [prompt(40 + 30 * i, 10 + i) for i in range(6)]
    wanted = [await vllm_generate(agg.vllm_url, p, {**GREEDY, "max_tokens": 16}) for p in prompts]
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = tokens(await generate(client, request(f"batch-{i}", prompts[i], 16)))

    async with trio.open_nursery() as inner:
        for i in range(len(prompts)):
            inner.start_soon(one, i)
    assert [got[i] for i in range(len(prompts))] == [w.token_ids for w in wanted]


async def test_sampling_parameters_map_exactly(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    ids = prompt(60, 20)
    greedy = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 8})
    stop = greedy.token_ids[3]
    assert stop not in greedy.token_ids[:3]

    # Seeded sampling: the same draws as vLLM's own.
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 8}
    want = await vllm_generate(agg.vllm_url, ids, seeded)
    got = await generate(client, request("seeded", ids, 8, temperature=0.8, top_p=0.9, seed=7))
    assert tokens(got) == want.token_ids != greedy.token_ids

    # A stop token id ends the stream with it, finish "stop".
    got = await generate(client, request("stop-id", ids, 8, stop_token_ids=(stop,)))
    assert tokens(got) == greedy.token_ids[:4]
    assert got[-1].finish_reason is FinishReason.STOP

    # The request's EOS ids stop it too, unless ignore_eos.
    got = await generate(client, request("eos", ids, 8, eos=(stop,)))
    assert (tokens(got), got[-1].finish_reason) == (greedy.token_ids[:4], FinishReason.STOP)
    got = await generate(client, request("ignore-eos", ids, 8, eos=(stop,), ignore_eos=True))
    assert (tokens(got), got[-1].finish_reason) == (greedy.token_ids, FinishReason.LENGTH)

    # min_tokens holds the stop ids back, as in vLLM.
    want = await vllm_generate(
        agg.vllm_url, ids, {**GREEDY, "max_tokens": 8, "min_tokens": 6, "stop_token_ids": [stop]}
    )
    got = await generate(client, request("min", ids, 8, min_tokens=6, stop_token_ids=(stop,)))
    assert tokens(got) == want.token_ids
    assert len(tokens(got)) >= 6


async def test_cached_prompt_tokens_are_reported_as_vllm_counts_them(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    ids = prompt(300, 30)  # four full blocks of 64 tokens (--vllm-block-size), then 44
    first = await generate(client, request("cache-1", ids, 2))
    second = await generate(client, request("cache-2", ids, 2))
    reference = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 2})
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == reference.cached_tokens == 256


async def test_streaming_through_the_openai_routes_is_exact_with_exact_usage(
    vllm_cluster: VllmCluster,
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    tokenizer = shared_tokenizer()
    async with (
        serve_frontend(workers=f"{agg.address}?role=agg", context_length=8192) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        await wait_healthy(http)
        # Completions with a token-id prompt: the text is the detokenized reference.
        ids = prompt(50, 40)
        want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 10})
        r = await http.post(
            "/v1/completions",
            json={
                "model": "deepseek-v4",
                "prompt": ids,
                "max_tokens": 10,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200
        events = sse_events(r.content)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert text == tokenizer.decode(want.token_ids)
        usage = events[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (50, 10)

        # Chat: templated and tokenized by the frontend, generated by vLLM.
        messages = [{"role": "user", "content": "Tell me about rivers and their sources."}]
        chat_ids = tokenizer.encode_ids(fe.template.render(messages))
        want = await vllm_generate(
            agg.vllm_url, chat_ids, {**GREEDY, "max_tokens": 12, "ignore_eos": True}
        )
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": "deepseek-v4",
                "messages": messages,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200
        events = sse_events(r.content)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert text == tokenizer.decode(want.token_ids)
        usage = events[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(chat_ids), 12)


async def test_a_worker_attached_to_a_running_vllm(vllm_cluster: VllmCluster) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    ids = prompt(20, 50)
    want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 6})
    config = WorkerConfig(
        engine="vllm",
        worker_id="attached",
        engine_config=VllmConfig(vllm_url=agg.vllm_url, model=str(TINY_MODEL)),
    )
    async with trio.open_nursery() as nursery:
        worker = await nursery.start(serve_worker, config)
        client = await connect(worker_instance(worker), nursery)
        assert tokens(await generate(client, request("attached", ids, 6))) == want.token_ids
        nursery.cancel_scope.cancel()


async def test_in_process_workers_of_headwater_serve(vllm_cluster: VllmCluster) -> None:
    # `headwater serve --engine vllm --mode agg` with its in-process worker, attached to
    # the session's vLLM (starting another would make four instances).
    agg = vllm_cluster.workers[Role.AGG]
    ids = prompt(33, 60)
    want = await vllm_generate(agg.vllm_url, ids, {**GREEDY, "max_tokens": 7})
    engine = VllmConfig(vllm_url=agg.vllm_url, model=str(TINY_MODEL))
    async with (
        serve_frontend(engine="vllm", engine_config=engine, mode="agg", context_length=8192) as (
            _,
            url,
        ),
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        await wait_healthy(http)
        r = await http.post(
            "/v1/completions",
            json={
                "model": "deepseek-v4",
                "prompt": ids,
                "max_tokens": 7,
                "temperature": 0,
            },
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == shared_tokenizer().decode(want.token_ids)


async def test_vllms_spans_join_the_requests_trace(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    """The aggregated worker traces (``--otlp-endpoint``) and starts its vLLM with
    ``--otlp-traces-endpoint``; a request that carries a traceparent gets the worker's
    ``worker.request`` span and vLLM's own span in the same trace."""
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traced = replace(
        request("traced-1", prompt(20, 77), 4), traceparent=f"00-{trace_id}-00f067aa0ba902b7-01"
    )
    await generate(client, traced)
    with trio.fail_after(60):  # both export in batches (about every second or five)
        while True:
            spans = vllm_cluster.traces.in_trace(trace_id)
            services = {service for service, *_ in spans}
            if "vllm" in services and "headwater-worker" in services:
                break
            await trio.sleep(0.5)
    worker_span = next(s for s in spans if s[1] == "worker.request")
    assert worker_span[3] == "00f067aa0ba902b7"  # the frame's traceparent is its parent
    assert any(s[0] == "vllm" and s[3] for s in spans)  # vLLM's span has a parent in it


async def test_greedy_logprobs_through_headwater_equal_vllms_own(
    vllm_cluster: VllmCluster,
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    ids = prompt(40, 70)
    # Ids only, as headwater's engine asks vLLM (a vLLM with its tokenizer loaded would
    # otherwise name each prompt logprob's token); headwater ignores the field.
    body = {
        "token_ids": ids,
        "sampling_params": {
            **GREEDY,
            "max_tokens": 6,
            "logprobs": 5,
            "prompt_logprobs": 3,
            "ignore_eos": True,
            "detokenize": False,
        },
    }
    async with httpx.AsyncClient(timeout=120) as direct:
        r = await direct.post(agg.vllm_url + "/inference/v1/generate", json=body)
    r.raise_for_status()
    want = r.json()
    async with (
        serve_frontend(workers=f"{agg.address}?role=agg", context_length=8192) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        await wait_healthy(http)
        # The token-in API answers in vLLM's own shape: the same JSON, number for number.
        got = (await http.post("/inference/v1/generate", json=body)).json()
        (mine,), (theirs,) = got["choices"], want["choices"]
        assert mine["token_ids"] == theirs["token_ids"]
        assert mine["logprobs"] == theirs["logprobs"]
        assert len(mine["logprobs"]["content"][0]["top_logprobs"]) == 5
        assert got["prompt_logprobs"] == want["prompt_logprobs"]
        assert len(got["prompt_logprobs"]) == len(ids)

        # OpenAI's shapes carry the same numbers, by token text.
        r = await http.post(
            "/v1/completions",
            json={
                "model": "deepseek-v4",
                "prompt": ids,
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": 5,
                "ignore_eos": True,
                "echo": True,
            },
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == [
            position[str(t)]["logprob"]
            for position, t in zip(want["prompt_logprobs"][1:], ids[1:], strict=True)
        ]
        # The answer's tokens, less the special ones its text does not show (the tiny
        # model emits some), which OpenAI's shapes do not report.
        special = shared_tokenizer().special_ids
        assert lp["token_logprobs"][len(ids) :] == [
            e["logprob"]
            for e, t in zip(theirs["logprobs"]["content"], theirs["token_ids"], strict=True)
            if t not in special
        ]
