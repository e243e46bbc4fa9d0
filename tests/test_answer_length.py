"""Where the simulated engine's answers end, seen through the API: a model's EOS.

Policy: a frontend on 127.0.0.1:0 (see frontend_fixture) whose in-process mockers keep
their default answer lengths (the fixture's other tests run every answer to
``max_tokens``); requests are seeded, so each length is known from the draw.
"""

from __future__ import annotations

import httpx
import pytest

from workers.engines.mocker import MockerConfig
from workers.engines.mocker.sampling import output_length, seed_key

from frontend_fixture import serve_frontend, shared_tokenizer, sse_events

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Tell me about rivers."}]
DEFAULT = MockerConfig(speedup_ratio=1000)


def drawn(seed: int) -> int:
    """The length, EOS included, of a seeded answer under the default config."""
    return output_length(
        seed_key(seed, ""), DEFAULT.mean_output_tokens, DEFAULT.output_length_sigma
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.slow
async def test_a_request_without_max_tokens_stops_at_its_drawn_length(path: str) -> None:
    async with (
        serve_frontend(engine_config=DEFAULT) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        tokenizer = shared_tokenizer()
        assert tokenizer.eos_token_id is not None
        eos_text = tokenizer.hf.id_to_token(tokenizer.eos_token_id)
        lengths = []
        for seed in range(6):
            body = {
                "model": MODEL,
                "seed": seed,
                **({"messages": CHAT} if "chat" in path else {"prompt": "Rivers"}),
            }
            r = await c.post(path, json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            choice = data["choices"][0]
            assert choice["finish_reason"] == "stop"
            # EOS counts as a generated token (as vLLM counts it) but is not text.
            assert data["usage"]["completion_tokens"] == drawn(seed)
            text = choice["message"]["content"] if "chat" in path else choice["text"]
            assert eos_text not in text
            lengths.append(drawn(seed))
        # Well short of the context length the request was allowed.
        assert max(lengths) < fe.config.context_length // 100


async def test_ignore_eos_and_min_tokens_give_exact_lengths() -> None:
    async with (
        serve_frontend(engine_config=DEFAULT) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        seed = next(s for s in range(100) if drawn(s) < 50)
        exact = {"model": MODEL, "messages": CHAT, "seed": seed, "max_tokens": 300}
        for extra in ({"ignore_eos": True}, {"min_tokens": 300}):
            r = await c.post("/v1/chat/completions", json={**exact, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 300
            assert r.json()["choices"][0]["finish_reason"] == "length"
        # The same request without them ends at its draw, streamed too.
        body = {**exact, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = await sse_events(r)
        assert events[-1] == "DONE"
        assert events[-2]["usage"]["completion_tokens"] == drawn(seed)
        assert events[-3]["choices"][0]["finish_reason"] == "stop"
