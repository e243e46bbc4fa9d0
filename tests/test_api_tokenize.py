"""``/tokenize`` and ``/detokenize``: vLLM's shapes, the ids a generation request sends,
the same limits and keys as the other routes, the tokenizer off the loop.

Policy: every test runs its own frontend on 127.0.0.1:0 (frontend_fixture) with
in-process simulated workers; the HF tokenizer is the oracle.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import tokenizers
import trio
from tokenizers.processors import TemplateProcessing

from frontend.http.tokenize import INLINE_TOKEN_STRS, special_affixes
from frontend.limits import RequestLimits
from frontend.preprocess.pool import INLINE_DECODE_TOKENS

from frontend_fixture import assert_error, eventually, idle, serve_frontend, shared_tokenizer

MODEL = "deepseek-v4"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Write a haiku about rivers."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def hf_ids(text: str) -> list[int]:
    return list(shared_tokenizer().hf.encode(text, add_special_tokens=False).ids)


async def test_a_prompt_tokenizes_to_the_hf_ids_in_vllms_shape() -> None:
    text = "The river flows — ünïcödé 🌊 and <｜end▁of▁sentence｜> too"
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/tokenize", json={"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
        assert body["tokens"] == hf_ids(text)
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == fe.config.context_length
        assert body["token_strs"] is None
        # model may be left out, as vLLM allows
        r = await c.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        strs = r.json()["token_strs"]
        hf = shared_tokenizer().hf
        assert strs == [hf.id_to_token(i) for i in body["tokens"]]
        # And back: /detokenize keeps special tokens, so the text round-trips.
        r = await c.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": text}
        empty = await c.post("/tokenize", json={"prompt": ""})
        assert empty.json()["tokens"] == []
        assert empty.json()["count"] == 0


async def test_messages_tokenize_to_exactly_what_a_chat_request_sends() -> None:
    """The chat template with tools and template kwargs, as the chat route renders it:
    the count equals the chat response's prompt_tokens, for several switches."""
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        extras: list[dict[str, Any]] = [
            {},
            {"tools": TOOLS},
            {"chat_template_kwargs": {"thinking": True}},
        ]
        for extra in extras:
            r = await c.post("/tokenize", json={"model": MODEL, "messages": CHAT, **extra})
            assert r.status_code == 200, r.text
            tokens = r.json()["tokens"]
            rendered = fe.template.render(
                CHAT,
                tools=extra.get("tools"),
                chat_template_kwargs=extra.get("chat_template_kwargs"),
            )
            assert tokens == hf_ids(rendered)
            chat = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": CHAT, "max_tokens": 1, **extra},
            )
            assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
        # add_generation_prompt false leaves the assistant's opener out.
        r = await c.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
        assert r.json()["tokens"] == hf_ids(fe.template.render(CHAT, add_generation_prompt=False))
        # add_special_tokens on a conversation adds the post-processor's (none here).
        r = await c.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
        assert r.json()["tokens"] == hf_ids(fe.template.render(CHAT))


@pytest.mark.slow
def test_special_tokens_are_the_post_processors_wherever_it_puts_them() -> None:
    """``add_special_tokens`` adds what HF's post-processor adds around a text; for a
    tokenizer that adds a BOS and an EOS, both, at their places."""
    hf = tokenizers.Tokenizer.from_str(shared_tokenizer().hf.to_str())
    assert special_affixes(hf) == ([], [])  # DeepSeek-V4's adds none
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    ids = (hf.token_to_id(bos), hf.token_to_id(eos))
    hf.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=list(zip((bos, eos), ids, strict=True))
    )
    prefix, suffix = special_affixes(hf)
    assert (prefix, suffix) == ([ids[0]], [ids[1]])
    text = "a longer text, to check the affixes against"
    assert (
        prefix + hf.encode(text, add_special_tokens=False).ids + suffix
        == hf.encode(text, add_special_tokens=True).ids
    )


async def test_long_inputs_are_encoded_and_decoded_off_the_loop() -> None:
    """A prompt past the pool's inline threshold is encoded in a pool thread, and so is a
    decode past INLINE_DECODE_TOKENS and a token-string lookup past INLINE_TOKEN_STRS:
    the thread count of the pool's limiter shows each."""
    text = "rivers and mountains " * 4000
    async with serve_frontend() as (fe, url), httpx.AsyncClient(base_url=url) as c:
        calls: list[str] = []
        real = trio.to_thread.run_sync

        async def spy(fn: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(getattr(fn, "__name__", type(fn).__name__))
            return await real(fn, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trio.to_thread, "run_sync", spy)
            r = await c.post("/tokenize", json={"prompt": text, "return_token_strs": True})
            tokens = r.json()["tokens"]
            assert len(tokens) > max(INLINE_DECODE_TOKENS, INLINE_TOKEN_STRS)
            assert tokens == hf_ids(text)
            back = await c.post("/detokenize", json={"tokens": tokens})
            assert back.json()["prompt"] == text
        assert calls == ["encode_in_thread", "look_up", "partial"], calls
        assert fe.pool.statistics().encoded_total >= 1


async def test_bad_requests_are_refused_with_the_field_named() -> None:
    async with (
        serve_frontend(limits=RequestLimits(max_messages=2, max_prompt_chars=100)) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        cases: list[tuple[dict[str, Any], int, str | None]] = [
            ({}, 400, "prompt"),
            ({"prompt": "a", "messages": CHAT}, 400, "messages"),
            ({"prompt": 5}, 400, "prompt"),
            ({"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
            ({"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template"),
            ({"messages": CHAT * 2}, 400, "messages"),
            ({"prompt": "x" * 101}, 400, "prompt"),
            ({"messages": [{"role": "user", "content": "x" * 101}]}, 400, "messages"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
            ({"prompt": "hi", "model": "other"}, 404, "model"),
        ]
        for body, status, param in cases:
            assert_error(await c.post("/tokenize", json=body), status, param)
        vocab = shared_tokenizer().vocab_size
        detokenize_cases: list[tuple[dict[str, Any], int, str | None]] = [
            ({"tokens": [1, vocab]}, 400, "tokens"),
            ({"tokens": [-1]}, 400, "tokens"),
            ({"tokens": "1 2"}, 400, "tokens"),
            ({"tokens": [1], "model": "other"}, 404, "model"),
        ]
        for body, status, param in detokenize_cases:
            assert_error(await c.post("/detokenize", json=body), status, param)
        r = await c.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
        assert_error(r, 400)
        assert_error(await c.post("/tokenize", content=b"hi"), 415)
        counted = fe.metrics.requests_total.labels("tokenize", "unary", "rejected", "")._value.get()
        assert counted == len(cases) + 2


async def test_keys_and_admission_apply_as_on_the_other_routes() -> None:
    async with (
        serve_frontend(api_keys=("k1",), max_inflight=1) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        assert_error(await c.post("/tokenize", json={"prompt": "hi"}), 401)
        assert_error(await c.post("/detokenize", json={"tokens": [1]}), 401)
        ok = await c.post(
            "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer k1"}
        )
        assert ok.status_code == 200
        ok = await c.post("/tokenize", json={"prompt": "hi"}, headers={"x-api-key": "k1"})
        assert ok.status_code == 200
        # At --max-inflight, a tokenize request is turned away like a generation one.
        await eventually(idle(fe))
        assert fe.admission.admit() is None  # one slot taken, as by a request in flight
        try:
            r = await c.post(
                "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer k1"}
            )
            assert_error(r, 429)
        finally:
            fe.admission.release()
