"""``n`` > 1: one request, n choices, each its own stream, merged by index.

Policy: every test runs its own frontend on 127.0.0.1:0 (frontend_fixture) with
in-process mocker workers; the slow ones (a client that leaves mid-stream) run the
mocker at real speed, the others fast. The dispatcher's affinity is checked on its own
in tests/test_dispatch.py.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import trio

from frontend_fixture import assert_error, engines, eventually, idle, serve_frontend, sse_events

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

MODEL = "deepseek-v4"
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a haiku about rivers."}
]


async def chat(c: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **fields})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def stream(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    async with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [e for e in await sse_events(r) if e != "DONE"]


async def test_n_choices_each_with_the_seed_vllm_derives_and_usage_as_openai_counts() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        body = {"max_tokens": 7, "seed": 11, "ignore_eos": True}
        data = await chat(c, **body, n=3)
        choices = data["choices"]
        assert [ch["index"] for ch in choices] == [0, 1, 2]
        assert all(ch["finish_reason"] == "length" for ch in choices)
        # Choice i is what one request with seed + i answers (vLLM's children's seeds).
        for i, ch in enumerate(choices):
            alone = await chat(c, **{**body, "seed": 11 + i})
            assert ch["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert len({ch["message"]["content"] for ch in choices}) == 3
        usage = data["usage"]
        prompt = alone["usage"]["prompt_tokens"]
        # The prompt once, the completions summed.
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 21)
        assert usage["total_tokens"] == prompt + 21
        # Without a seed the choices differ too (each its own request id).
        unseeded = await chat(c, max_tokens=7, ignore_eos=True, n=2)
        texts = [ch["message"]["content"] for ch in unseeded["choices"]]
        assert texts[0] != texts[1]
        # Time to first token: the request's, once.
        ttft = fe.metrics.time_to_first_token_seconds.histogram
        before = sum(b.get() for b in ttft._buckets)
        await chat(c, max_tokens=2, n=4)
        assert sum(b.get() for b in ttft._buckets) == before + 1
        await eventually(idle(fe))


async def test_streamed_choices_come_by_index_and_add_up_to_the_unary_answer() -> None:
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        body = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 9,
            "seed": 4,
            "n": 3,
            "ignore_eos": True,
            "logprobs": True,
        }
        unary = await chat(c, **{k: v for k, v in body.items() if k not in ("model", "messages")})
        events = await stream(
            c,
            "/v1/chat/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        # The assistant's role opens each choice, as OpenAI's streams do.
        assert [e["choices"][0]["index"] for e in events[:3]] == [0, 1, 2]
        assert all(
            e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:3]
        )
        text: dict[int, str] = defaultdict(str)
        logprobs: dict[int, list[Any]] = defaultdict(list)
        finishes: dict[int, list[str]] = defaultdict(list)
        for e in events[3:-1]:
            (ch,) = e["choices"]  # one choice per event
            text[ch["index"]] += ch["delta"].get("content", "")
            logprobs[ch["index"]] += ch["logprobs"]["content"]
            if ch["finish_reason"] is not None:
                finishes[ch["index"]].append(ch["finish_reason"])
        for ch in unary["choices"]:
            i = ch["index"]
            assert text[i] == ch["message"]["content"]
            assert logprobs[i] == ch["logprobs"]["content"]
            assert finishes[i] == ["length"]  # once per choice
        assert events[-1]["choices"] == []
        assert events[-1]["usage"] == unary["usage"]
        assert unary["usage"]["completion_tokens"] == 27

        # Completions and the token-in API alike.
        completions = await stream(
            c,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "Rivers",
                "max_tokens": 4,
                "n": 2,
                "seed": 4,
                "stream": True,
                "echo": True,
                "stream_options": {"include_usage": True},
            },
        )
        firsts: dict[int, Any] = {}
        for e in completions[:-1]:
            (ch,) = e["choices"]
            firsts.setdefault(ch["index"], ch["text"])
        assert sorted(firsts) == [0, 1]
        assert all(t.startswith("Rivers") for t in firsts.values())  # echo per choice
        assert completions[-1]["usage"]["completion_tokens"] == 8
        tokens = await stream(
            c,
            "/inference/v1/generate",
            {
                "token_ids": [5, 6, 7],
                "stream": True,
                "stream_options": {"include_usage": True},
                "sampling_params": {"max_tokens": 3, "n": 2, "ignore_eos": True},
            },
        )
        ids: dict[int, list[int]] = defaultdict(list)
        for e in tokens[:-1]:
            for ch in e["choices"]:
                ids[ch["index"]] += ch["token_ids"]
        assert sorted(ids) == [0, 1]
        assert all(len(v) == 3 for v in ids.values())
        assert tokens[-1]["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 6,
            "total_tokens": 9,
        }
        await eventually(idle(fe))


async def test_each_choice_has_its_own_stop_strings() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {"max_tokens": 12, "seed": 20, "ignore_eos": True}
        a, b = [
            (await chat(c, **{**body, "seed": s}))["choices"][0]["message"]["content"]
            for s in (20, 21)
        ]
        # A piece of choice 1's text that choice 0's does not hold.
        stop = next(b[i : i + 3] for i in range(1, len(b) - 3) if b[i : i + 3] not in a)
        data = await chat(c, **body, n=2, stop=[stop])
        first, second = data["choices"]
        assert (first["message"]["content"], first["finish_reason"]) == (a, "length")
        assert second["message"]["content"] == b[: b.index(stop)]
        assert second["finish_reason"] == "stop"


async def test_the_choices_share_the_prompts_kv_on_one_worker() -> None:
    prompt = list(range(1000, 1700))  # 10 full blocks of 64, and 60 tokens
    async with serve_frontend(mode="agg") as (fe, url), httpx.AsyncClient(base_url=url) as c:
        (engine,) = engines(fe)
        r = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": 3}
        )
        assert r.status_code == 200, r.text
        # Choice 0 computed the prompt; the others found its blocks in the cache.
        assert engine.counters.prefill_tokens_cached == 2 * 640
        assert engine.counters.prefill_tokens_computed == 700 + 2 * 60
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # choice 0's


async def test_a_client_that_leaves_cancels_every_choice() -> None:
    # Slow engine (speedup 1): every choice is still generating when the client leaves.
    async with (
        serve_frontend(speedup_ratio=1.0, mode="agg") as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        (engine,) = engines(fe)
        body = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 5000,
            "stream": True,
            "ignore_eos": True,
            "n": 3,
        }
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            seen: set[int] = set()
            async for line in r.aiter_lines():
                event = orjson.loads(line[6:]) if line.startswith("data: {") else None
                if event and event["choices"] and event["choices"][0]["delta"].get("content"):
                    seen.add(event["choices"][0]["index"])
                    if seen == {0, 1, 2}:
                        break
            assert engine.statistics().active_requests == 3
        # The response is closed: every choice's stream is cancelled, its KV freed.
        with trio.fail_after(5):
            while engine.statistics().kv_blocks_used or engine.statistics().active_requests:
                await trio.sleep(0.01)
        assert engine.counters.requests_cancelled == 3
        assert engine.counters.requests_finished == 0
        await eventually(idle(fe))
        assert fe.metrics.disconnected_clients._value.get() == 1


async def test_bounds_of_n_and_best_of() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        for fields, param in [
            ({"n": 129}, "n"),
            ({"n": 0}, "n"),
            ({"n": 2, "best_of": 3}, "best_of"),
            ({"best_of": 2}, "best_of"),
        ]:
            r = await c.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **fields}
            )
            assert_error(r, 400, param)
        ok = await chat(c, max_tokens=2, n=2, best_of=2)  # best_of = n: the n returned
        assert len(ok["choices"]) == 2


async def test_the_openai_sdk_reads_choices_and_logprobs() -> None:
    import openai

    async with (
        serve_frontend() as (_, url),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        unary = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=5,
            n=2,
            seed=3,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in unary.choices] == [0, 1]
        for choice in unary.choices:
            assert choice.logprobs is not None
            content = choice.logprobs.content
            assert content is not None
            assert len(content) == 5
            assert all(len(t.top_logprobs) == 2 for t in content)
            assert (
                b"".join(bytes(t.bytes or ()) for t in content)
                == (choice.message.content or "").encode()
            )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=5,
            n=2,
            seed=3,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text: dict[int, str] = defaultdict(str)
        async with stream:
            async for chunk in stream:
                for ch in chunk.choices:
                    text[ch.index] += ch.delta.content or ""
        assert [text[i] for i in (0, 1)] == [c.message.content for c in unary.choices]
        echoed = await client.completions.create(
            model=MODEL,
            prompt="Rivers run",
            max_tokens=3,
            logprobs=1,
            echo=True,
            seed=3,
        )
        lp = echoed.choices[0].logprobs
        assert lp is not None
        assert lp.token_logprobs is not None
        first: float | None = lp.token_logprobs[0]  # typed float; echo's first is null
        assert first is None
        assert echoed.choices[0].text.startswith("Rivers run")
