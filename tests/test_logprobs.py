"""Logprobs and echo, end to end: from the mocker's distribution to OpenAI's and vLLM's
shapes, unary and streamed, with stop strings, held-back characters and the parse stage.

Policy: the postprocessing tests are pure functions over the real DeepSeek-V4 tokenizer;
the HTTP tests run a frontend on 127.0.0.1:0 with in-process mocker workers
(frontend_fixture) and check every logprob against the one the mocker's distribution
gives (workers/engines/mocker/sampling.py), computed here independently.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from frontend.postprocess import TextPostprocessor
from frontend.postprocess.choice import ChoiceStream, echo
from frontend.postprocess.logprobs import FLOOR, TokenTexts, clamp
from frontend.postprocess.parsers import make_parser
from headwater.wire import TokenLogprobs
from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.sampling import logprobs_at, prompt_logprobs, seed_key, token_at

from frontend_fixture import assert_error, serve_frontend, shared_tokenizer, sse_events

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]
_CONFIG = MockerConfig()
LOW, SPAN = _CONFIG.output_token_low, _CONFIG.output_token_high - _CONFIG.output_token_low
#: Text whose tokens split characters (CJK, an emoji) and hold a stop string.
TEXT = "Rivers 你好 flow 🎉 to the sea. END of the story; more words follow here."


def texts() -> TokenTexts:
    return TokenTexts(shared_tokenizer().hf)


def mocker_ids(seed: int, prompt_tokens: int, n: int) -> list[int]:
    """The ids the mocker generates for *seed* after a prompt of that length."""
    key = seed_key(seed, "")
    return [token_at(key, prompt_tokens + k + 1, LOW, SPAN) for k in range(n)]


def mocker_logprobs(seed: int, prompt_tokens: int, ids: list[int], top: int) -> list[TokenLogprobs]:
    key = seed_key(seed, "")
    return [logprobs_at(key, prompt_tokens + k + 1, t, LOW, SPAN, top) for k, t in enumerate(ids)]


def whole_chars(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def fake_logprobs(ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(-0.01 * (i + 1), i + 1, (t,), (-0.5,)) for i, t in enumerate(ids)]


# -- which text a token's logprobs go with -------------------------------------------------


def run_choice(
    ids: list[int], splits: list[int], stops: tuple[str, ...] = ()
) -> list[tuple[str, list[Any]]]:
    """Feed *ids* to a ChoiceStream in chunks cut at *splits*; each output's text and
    logprob entries (the last one's finish included)."""
    tok = shared_tokenizer()
    post = TextPostprocessor(
        tok.decode, stops=stops, special_ids=tok.special_ids, track_tokens=True
    )
    choice = ChoiceStream(0, post, texts=texts())
    lps = fake_logprobs(ids)
    cuts = [0, *sorted(set(splits)), len(ids)]
    out = []
    for a, b in itertools.pairwise(cuts):
        last = b == len(ids)
        step = choice.step(ids[a:b], lps[a:b], "length" if last else None)
        out.append((step.text, list(step.logprobs)))
        if step.finish_reason is not None:
            break
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_chunk_carries_the_logprobs_of_the_tokens_whose_text_it_carries(seed: int) -> None:
    tok = shared_tokenizer()
    ids = list(tok.encode_ids(TEXT))
    rng = random.Random(seed)
    splits = rng.sample(range(1, len(ids)), rng.randrange(0, len(ids) - 1))
    outputs = run_choice(ids, splits)
    for text, entries in outputs:
        # Byte-level tokens: a chunk's tokens are exactly its text, bytes for bytes,
        # however the ids were split and wherever a character was held back.
        assert b"".join(e.bytes for e in entries) == text.encode()
    entries = [e for _, es in outputs for e in es]
    assert [e.token_id for e in entries] == ids  # each token once, in order
    whole = "".join(text for text, _ in outputs)
    assert whole == TEXT
    offsets = [e.offset for e in entries]
    assert offsets == sorted(offsets)
    for e in entries:  # text_offset: where the token's text begins (in characters, so
        # the tokens of one character's bytes share its offset)
        if whole_chars(e.bytes):
            assert whole.encode()[len(whole[: e.offset].encode()) :].startswith(e.bytes)
    assert [e.logprob for e in entries] == [lp.logprob for lp in fake_logprobs(ids)]


@pytest.mark.parametrize("seed", range(10))
def test_tokens_cut_by_a_stop_string_are_not_reported(seed: int) -> None:
    tok = shared_tokenizer()
    ids = list(tok.encode_ids(TEXT))
    rng = random.Random(seed)
    outputs = run_choice(ids, rng.sample(range(1, len(ids)), 6), stops=("END",))
    text = "".join(t for t, _ in outputs)
    assert text == TEXT[: TEXT.index("END")]
    entries = [e for _, es in outputs for e in es]
    # Reported: the tokens whose text begins before the stop string (" END" begins with
    # the space before it, so it is there); none from within or after it.
    assert b"".join(e.bytes for e in entries) == TEXT[: TEXT.index("END") + 3].encode()
    assert entries[-1].token == " END"


@pytest.mark.parametrize("seed", range(10))
def test_with_the_parse_stage_logprobs_wait_with_the_text_it_holds(seed: int) -> None:
    tok = shared_tokenizer()
    answer = "<think>Let me see 你好.</think>The sea. <thin and done"
    ids = list(tok.encode_ids(answer))
    post = TextPostprocessor(tok.decode, special_ids=tok.special_ids, track_tokens=True)
    choice = ChoiceStream(0, post, texts=texts(), parser=make_parser("none", "deepseek_v4"))
    lps = fake_logprobs(ids)
    rng = random.Random(seed)
    cuts = [0, *sorted(rng.sample(range(1, len(ids)), 5)), len(ids)]
    steps = [
        choice.step(ids[a:b], lps[a:b], "length" if b == len(ids) else None)
        for a, b in itertools.pairwise(cuts)
    ]
    reported = b""
    for step in steps:
        reported += b"".join(e.bytes for e in step.logprobs)
        # Never ahead of the text let out: what came so far is a prefix of the answer.
        sent = "".join(s.reasoning + s.text for s in steps[: steps.index(step) + 1])
        assert answer.replace("<think>", "").replace("</think>", "").startswith(sent)
    assert reported == answer.encode()  # every token once, markers' too
    assert "".join(s.reasoning for s in steps) == "Let me see 你好."
    assert "".join(s.text for s in steps) == "The sea. <thin and done"


def test_special_tokens_without_text_are_not_reported() -> None:
    tok = shared_tokenizer()
    eos = tok.eos_token_id
    assert eos is not None
    ids = [*tok.encode_ids("Hello there"), eos]
    outputs = run_choice(ids, [1, 2])
    entries = [e for _, es in outputs for e in es]
    assert [e.token_id for e in entries] == ids[:-1]


def test_token_texts_are_the_tokens_own_bytes() -> None:
    t = texts()
    tok = shared_tokenizer()
    pieces = [t(i) for i in tok.encode_ids("🎉 café")]
    assert b"".join(raw for _, raw in pieces) == "🎉 café".encode()
    # A token holding part of a character shows its bytes escaped, as OpenAI does.
    assert any(text.startswith("\\x") for text, _ in pieces)
    assert t(tok.eos_token_id or 1)[0] == "<｜end▁of▁sentence｜>"
    assert clamp(-math.inf) == clamp(math.nan) == FLOOR
    assert clamp(-1.5) == -1.5


def test_echo_places_every_prompt_token_in_the_prompt_text() -> None:
    tok = shared_tokenizer()
    ids = list(tok.encode_ids(TEXT))
    decode = partial(tok.decode, skip_special_tokens=False)
    got = echo(TEXT, ids, decode, texts(), prompt_logprobs(ids, 2, LOW, SPAN))
    assert got.text == TEXT
    assert [e.token_id for e in got.entries] == ids
    assert (got.entries[0].logprob, got.entries[0].top) == (None, None)
    for e in got.entries:
        if whole_chars(e.bytes):
            assert TEXT.encode()[len(TEXT[: e.offset].encode()) :].startswith(e.bytes)
    assert echo(None, ids, decode).text == TEXT  # ids in: the decoded prompt
    assert echo("as sent", ids, decode).entries == ()  # no logprobs asked


# -- over HTTP -----------------------------------------------------------------------------


async def chat(c: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **fields})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_chat_logprobs_are_the_mockers_distribution_in_openais_shape() -> None:
    t = texts()
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {
            "max_tokens": 12,
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
        }
        data = await chat(c, **body)
        prompt_tokens = data["usage"]["prompt_tokens"]
        choice = data["choices"][0]
        ids = mocker_ids(5, prompt_tokens, 12)
        want = mocker_logprobs(5, prompt_tokens, ids, 3)
        content = choice["logprobs"]["content"]
        assert len(content) == 12
        for entry, token, lp in zip(content, ids, want, strict=True):
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert (entry["token"], bytes(entry["bytes"])) == t(token)
            assert entry["logprob"] == lp.logprob
            assert [(e["token"], e["logprob"]) for e in entry["top_logprobs"]] == [
                (t(i)[0], v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            assert all(set(e) == {"token", "logprob", "bytes"} for e in entry["top_logprobs"])
        text = choice["message"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()

        # Streamed: the same entries, each chunk with the tokens of its own text.
        async with c.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, **body, "stream": True},
        ) as r:
            events = [e for e in await sse_events(r) if e != "DONE"]
        streamed = []
        for event in events[1:]:  # after the role's
            (part,) = event["choices"]
            got = part["logprobs"]["content"]
            piece = part["delta"].get("content", "")
            assert b"".join(bytes(e["bytes"]) for e in got) == piece.encode()
            streamed += got
        assert streamed == content
        assert events[0]["choices"][0]["logprobs"] is None  # the role's opening

        # Not asked: null, as before; logprobs without top_logprobs: none listed.
        plain = await chat(c, max_tokens=3, seed=5)
        assert plain["choices"][0]["logprobs"] is None
        bare = await chat(c, max_tokens=3, seed=5, logprobs=True)
        assert all(e["top_logprobs"] == [] for e in bare["choices"][0]["logprobs"]["content"])


async def test_a_stop_string_cuts_the_logprobs_with_the_text() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        full = await chat(c, max_tokens=16, seed=9, logprobs=True, ignore_eos=True)
        content = full["choices"][0]["logprobs"]["content"]
        # A stop string made of a token in the middle: the answer ends before it.
        stop = content[8]["token"].strip() or content[9]["token"].strip()
        assert stop
        text = full["choices"][0]["message"]["content"]
        before = text[: text.index(stop)]
        for stream in (False, True):
            body = {
                "model": MODEL,
                "messages": CHAT,
                "max_tokens": 16,
                "seed": 9,
                "logprobs": True,
                "ignore_eos": True,
                "stop": [stop],
                "stream": stream,
            }
            if stream:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    events = [e for e in await sse_events(r) if e != "DONE"]
                got = [
                    e
                    for ev in events
                    for ch in ev["choices"]
                    for e in (ch["logprobs"] or {}).get("content", [])
                ]
                answer = "".join(
                    ch["delta"].get("content", "") for ev in events for ch in ev["choices"]
                )
            else:
                data = await chat(
                    c, **{k: v for k, v in body.items() if k not in ("model", "messages")}
                )
                got = data["choices"][0]["logprobs"]["content"]
                answer = data["choices"][0]["message"]["content"]
            assert answer == before
            # The tokens reported are the answer's, and the one the stop string began
            # in (its text runs into the stop string); nothing after it.
            assert got == content[: len(got)]
            joined = b"".join(bytes(e["bytes"]) for e in got).decode(errors="replace")
            assert joined.startswith(before)
            assert len(joined) < len(before) + len(got[-1]["token"]) + 1


async def test_completions_logprobs_and_echo_in_openais_columns() -> None:
    t = texts()
    tok = shared_tokenizer()
    prompt = "The river flows to the sea"
    prompt_ids = list(tok.encode_ids(prompt))
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 6,
            "seed": 3,
            "logprobs": 2,
            "ignore_eos": True,
        }
        data = (await c.post("/v1/completions", json=body)).json()
        choice = data["choices"][0]
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        ids = mocker_ids(3, len(prompt_ids), 6)
        want = mocker_logprobs(3, len(prompt_ids), ids, 2)
        assert lp["tokens"] == [t(i)[0] for i in ids]
        assert lp["token_logprobs"] == [w.logprob for w in want]
        for top, token, w in zip(lp["top_logprobs"], ids, want, strict=True):
            # OpenAI's: the 2 most likely and the token itself (3 at most), it first.
            expected = {t(token)[0]: w.logprob}
            for i, v in zip(w.top_ids, w.top_logprobs, strict=True):
                expected.setdefault(t(i)[0], v)
            assert top == expected
            assert next(iter(top)) == t(token)[0]
        text = choice["text"]
        for offset, token in zip(lp["text_offset"], ids, strict=True):
            if whole_chars(t(token)[1]):
                assert text.encode()[len(text[:offset].encode()) :].startswith(t(token)[1])

        # Echo: the prompt first, its tokens' logprobs too (the first has none).
        echoed = (await c.post("/v1/completions", json={**body, "echo": True})).json()
        e = echoed["choices"][0]
        assert e["text"] == prompt + text
        elp = e["logprobs"]
        n = len(prompt_ids)
        assert elp["tokens"] == [t(i)[0] for i in prompt_ids] + lp["tokens"]
        assert elp["token_logprobs"][0] is None
        assert elp["top_logprobs"][0] is None
        assert elp["token_logprobs"][1:n] == [
            p.logprob for p in prompt_logprobs(prompt_ids, 2, LOW, SPAN)
        ]
        assert elp["token_logprobs"][n:] == lp["token_logprobs"]
        assert elp["text_offset"][n:] == [len(prompt) + o for o in lp["text_offset"]]
        assert elp["text_offset"][:2] == [0, len(t(prompt_ids[0])[0])]

        # Echo alone, and streamed: the prompt's text opens the first chunk.
        plain = (
            await c.post("/v1/completions", json={**body, "echo": True, "logprobs": None})
        ).json()
        assert plain["choices"][0]["text"] == prompt + text
        assert plain["choices"][0]["logprobs"] is None
        async with c.stream(
            "POST", "/v1/completions", json={**body, "echo": True, "stream": True}
        ) as r:
            events = [x for x in await sse_events(r) if x != "DONE"]
        first = events[0]["choices"][0]
        assert first["text"].startswith(prompt)
        assert first["logprobs"]["tokens"][:n] == elp["tokens"][:n]
        assert "".join(x["choices"][0]["text"] for x in events) == prompt + text
        streamed = [v for x in events for v in x["choices"][0]["logprobs"]["text_offset"]]
        assert streamed == elp["text_offset"]

        # Echo of a prompt sent as token ids: the decoded prompt.
        by_ids = (
            await c.post("/v1/completions", json={**body, "prompt": prompt_ids, "echo": True})
        ).json()
        assert by_ids["choices"][0]["text"] == prompt + text


async def test_the_token_in_api_answers_in_vllms_shape() -> None:
    prompt = [5, 900, 17, 42]
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(
            "/inference/v1/generate",
            json={
                "token_ids": prompt,
                "sampling_params": {
                    "max_tokens": 4,
                    "seed": 2,
                    "logprobs": 2,
                    "prompt_logprobs": 1,
                    "ignore_eos": True,
                },
            },
        )
        assert r.status_code == 200, r.text
        data = r.json()
        (choice,) = data["choices"]
        ids = choice["token_ids"]
        assert ids == mocker_ids(2, len(prompt), 4)
        want = mocker_logprobs(2, len(prompt), ids, 2)
        for entry, token, w in zip(choice["logprobs"]["content"], ids, want, strict=True):
            own = (entry["token_id"], entry["logprob"], entry["rank"])
            assert own == (token, w.logprob, w.rank)
            # vLLM's order: the token first, then the most likely others, 2 in all.
            listed = [(token, w.logprob, w.rank)] + [
                (i, v, r)
                for r, (i, v) in enumerate(zip(w.top_ids, w.top_logprobs, strict=True), 1)
                if i != token
            ]
            assert [
                (e["token_id"], e["logprob"], e["rank"]) for e in entry["top_logprobs"]
            ] == listed[:2]
        # Prompt logprobs: null first, then per token its own and the top one, by id.
        plp = data["prompt_logprobs"]
        assert plp[0] is None
        for position, token, w in zip(
            plp[1:], prompt[1:], prompt_logprobs(prompt, 1, LOW, SPAN), strict=True
        ):
            assert next(iter(position)) == str(token)
            assert position[str(token)] == {
                "logprob": w.logprob,
                "rank": w.rank,
                "decoded_token": None,
            }
            assert position[str(w.top_ids[0])]["rank"] == 1
        # Streamed: each event's logprobs are its ids'.
        async with c.stream(
            "POST",
            "/inference/v1/generate",
            json={
                "token_ids": prompt,
                "stream": True,
                "sampling_params": {"max_tokens": 4, "seed": 2, "logprobs": 2, "ignore_eos": True},
            },
        ) as s:
            events = [e for e in await sse_events(s) if e != "DONE"]
        streamed = [x for e in events for ch in e["choices"] for x in ch["logprobs"]["content"]]
        assert streamed == choice["logprobs"]["content"]


async def test_logprob_bounds_and_dependencies_are_400s() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        for body, param in [
            ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"messages": CHAT, "top_logprobs": 5}, "top_logprobs"),
            ({"messages": CHAT, "logprobs": 3}, "logprobs"),
        ]:
            r = await c.post("/v1/chat/completions", json={"model": MODEL, **body})
            assert_error(r, 400, param)
        completions: list[tuple[dict[str, object], str]] = [
            ({"prompt": "x", "logprobs": 21}, "logprobs"),
            ({"prompt": "x", "logprobs": True}, "logprobs"),
            ({"prompt": "x", "echo": "yes"}, "echo"),
        ]
        for body, param in completions:
            assert_error(await c.post("/v1/completions", json={"model": MODEL, **body}), 400, param)


async def test_an_engine_without_logprobs_never_answers_without_them(tmp_path: Path) -> None:
    from workers.engines.scripted import ScriptedConfig

    script = tmp_path / "script.jsonl"
    script.write_text(json.dumps({"default": True, "text": "The sea."}) + "\n")
    config = ScriptedConfig(script=str(script), token_delay=0)
    async with (
        serve_frontend(engine="scripted", engine_config=config, mode="agg") as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        assert (await chat(c, max_tokens=4))["choices"][0]["message"]["content"] == "The sea."
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True},
        )
        assert r.status_code in (400, 502), r.text
        assert "logprobs" in r.json()["error"]["message"]
