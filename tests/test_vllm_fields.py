"""The sampling fields and constrained decoding on a real vLLM: each reaches vLLM and gives
vLLM's own answer.

Two proofs per field. *Received*: the session's aggregated vLLM logs every request's
``SamplingParams`` (``--enable-log-requests``, tests/vllm_fixture.py), and the line of a
request headwater sent holds the value asked. *Answered*: the tokens through headwater
equal vLLM's own answer to the same token-in request (``/inference/v1/generate`` on the
same server), and differ from the answer without the field where the field must change it.

Policy: the session's vLLM workers (tests/vllm_fixture.py: loopback, free ports, the
tiny model), each test with prompts of its own (salted), small ``max_tokens``, 600 s
(the first waits for the servers).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import trio

from frontend.preprocess.structured import structured_output
from frontend.request import Constraint
from headwater.wire import FinishReason, Role, StructuredKind, StructuredOutput

from frontend_fixture import serve_frontend, shared_tokenizer
from vllm_fixture import MODEL_NAME, VllmCluster
from vllm_helpers import (
    connect,
    generate,
    prompt,
    request,
    sse_events,
    tokens,
    vllm_generate,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

SEEDED: dict[str, Any] = {"temperature": 0.9, "seed": 11}
#: Each field, a value asking for it, and how vLLM's log prints it.
FIELDS: list[tuple[str, Any, str]] = [
    ("top_k", 3, "top_k=3"),
    ("min_p", 0.2, "min_p=0.2"),
    ("presence_penalty", 1.5, "presence_penalty=1.5"),
    ("frequency_penalty", -1.5, "frequency_penalty=-1.5"),
    ("repetition_penalty", 1.8, "repetition_penalty=1.8"),
]


def received(cluster: VllmCluster, rid: str) -> str:
    """The SamplingParams vLLM logged for headwater's request *rid*."""
    log = cluster.workers[Role.AGG].vllm_log()
    match = re.search(
        rf"Received request generate-tokens-{re.escape(rid)}: params: "
        r"(SamplingParams\(.*\)), lora_request",
        log,
    )
    assert match is not None, f"vLLM logged no request {rid}"
    return match.group(1)


async def test_every_sampling_field_reaches_vllm_and_gives_its_answer(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    ids = prompt(40, 101)
    for name, value, printed in FIELDS:
        rid = f"field-{name}"
        got = tokens(await generate(client, request(rid, ids, 12, **SEEDED, **{name: value})))
        assert printed in received(vllm_cluster, rid)
        want = await vllm_generate(agg.vllm_url, ids, {**SEEDED, "max_tokens": 12, name: value})
        assert got == want.token_ids, name
    # They act on vLLM's sampling, not only on its log: the one most likely token (top_k
    # 1, or min_p 1) samples greedily even at a temperature of 2. (The penalties act on
    # tokens already generated, which the tiny model's greedy answers do not repeat.)
    greedy = await vllm_generate(agg.vllm_url, ids, {"temperature": 0.0, "max_tokens": 12})
    hot: dict[str, Any] = {"temperature": 2.0, "seed": 11}
    assert tokens(await generate(client, request("hot", ids, 12, **hot))) != greedy.token_ids
    greedy_fields: list[tuple[str, Any]] = [("top_k", 1), ("min_p", 1.0)]
    for name, value in greedy_fields:
        chunks = await generate(client, request(f"hot-{name}", ids, 12, **hot, **{name: value}))
        assert tokens(chunks) == greedy.token_ids, name
    # All at once, as one request carries them.
    every = {name: value for name, value, _ in FIELDS}
    got = tokens(await generate(client, request("field-every", ids, 12, **SEEDED, **every)))
    line = received(vllm_cluster, "field-every")
    assert all(printed in line for _, _, printed in FIELDS)
    assert "seed=11" in line
    want = await vllm_generate(agg.vllm_url, ids, {**SEEDED, "max_tokens": 12, **every})
    assert got == want.token_ids


async def test_logit_bias_reaches_vllm(vllm_cluster: VllmCluster, nursery: trio.Nursery) -> None:
    # vLLM does not print logit_bias; a bias of 100 on one id makes greedy decoding say it.
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    ids = prompt(30, 102)
    greedy = await vllm_generate(agg.vllm_url, ids, {"temperature": 0.0, "max_tokens": 4})
    favourite = next(t for t in range(1000, 2000) if t not in greedy.token_ids)
    chunks = await generate(
        client, request("bias", ids, 4, ignore_eos=True, logit_bias=((favourite, 100.0),))
    )
    assert tokens(chunks) == [favourite] * 4
    assert "ignore_eos=True" in received(vllm_cluster, "bias")


async def test_a_choice_constrains_vllms_answer(
    vllm_cluster: VllmCluster, nursery: trio.Nursery
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    client = await connect(agg.instance, nursery)
    tokenizer = shared_tokenizer()
    ids = prompt(20, 103)
    choice = StructuredOutput(StructuredKind.CHOICE, json.dumps(["rivers", "mountains"]))
    chunks = await generate(client, request("choice", ids, 16, structured=choice))
    assert tokenizer.decode(tokens(chunks)) in ("rivers", "mountains")
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert "structured_outputs=StructuredOutputsParams(" in received(vllm_cluster, "choice")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["unit", "live"],
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "live": {"type": "boolean"},
            },
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def no_whitespace() -> dict[str, float]:
    """A logit_bias that keeps the tiny model from whitespace: its random weights prefer
    it, and a grammar allows it between any two JSON or DSML tokens, so unbiased it never
    closes a call (a real model does). The grammar's own newlines still come: a masked
    choice of one is taken whatever its bias."""
    tokenizer = shared_tokenizer()
    return {
        str(i): -100.0
        for i in range(tokenizer.vocab_size)
        if not tokenizer.decode([i], skip_special_tokens=False).strip()
    }


async def test_tool_choice_and_response_format_through_the_api(
    vllm_cluster: VllmCluster,
) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    tokenizer = shared_tokenizer()
    bias = no_whitespace()
    async with (
        serve_frontend(workers=f"{agg.address}?role=agg", context_length=8192) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        with trio.fail_after(60):
            while (await http.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        chat_ids = list(tokenizer.encode_ids(fe.template.render(MESSAGES, tools=[WEATHER])))
        base = {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "tools": [WEATHER],
            "max_tokens": 160,
            "temperature": 0,
            "logit_bias": bias,
        }
        named = {"type": "function", "function": {"name": "get_weather"}}
        for kind, ask in (
            ("tool_call", {"tool_choice": named}),
            ("tool_calls", {"tool_choice": "required", "parallel_tool_calls": False}),
        ):
            r = await http.post("/v1/chat/completions", json={**base, **ask})
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]
            # vLLM's own answer under the same constraint, from the same tokens.
            tag = structured_output(
                Constraint(kind, "tool_choice", tools=("get_weather",)),
                tools=[WEATHER],
                tool_call_parser="deepseek_v4",
                reasoning_forced=False,
                parallel_tool_calls=False,
            )
            want = await vllm_generate(
                agg.vllm_url,
                chat_ids,
                {
                    "temperature": 0,
                    "max_tokens": 160,
                    "stop_token_ids": [1],
                    "logit_bias": bias,
                    "structured_outputs": {"structural_tag": tag.spec},
                },
            )
            assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)
            assert want.finish_reason == "stop", tokenizer.decode(want.token_ids)
            text = tokenizer.decode(want.token_ids, skip_special_tokens=False)
            assert text.startswith('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">')
            # ... and parsed: one call, its arguments of the tool's schema, nothing else.
            assert answer["finish_reason"] == "tool_calls"
            assert not answer["message"]["content"]
            (call,) = answer["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            args = json.loads(call["function"]["arguments"])
            assert set(args) == {"unit", "live"}
            assert args["unit"] in ("celsius", "fahrenheit")
            assert isinstance(args["live"], bool)
            # Streamed, the same call.
            r = await http.post("/v1/chat/completions", json={**base, **ask, "stream": True})
            deltas = [c["delta"] for e in sse_events(r.content) for c in e["choices"]]
            steps = [t for d in deltas for t in d.get("tool_calls", ())]
            assert steps[0]["function"]["name"] == "get_weather"
            assert json.loads("".join(t["function"].get("arguments", "") for t in steps)) == args
            assert not "".join(d.get("content") or "" for d in deltas)

        schema = {
            "type": "object",
            "additionalProperties": False,
            "required": ["ok"],
            "properties": {"ok": {"type": "boolean"}},
        }
        body = {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "max_tokens": 60,
            "temperature": 0,
            "logit_bias": bias,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        }
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]
        plain_ids = list(tokenizer.encode_ids(fe.template.render(MESSAGES)))
        want = await vllm_generate(
            agg.vllm_url,
            plain_ids,
            {
                "temperature": 0,
                "max_tokens": 60,
                "stop_token_ids": [1],
                "logit_bias": bias,
                "structured_outputs": {"json": schema},
            },
        )
        assert answer["message"]["content"] == tokenizer.decode(want.token_ids)
        assert answer["finish_reason"] == "stop"
        assert isinstance(json.loads(answer["message"]["content"])["ok"], bool)
