"""headwater.testing's in-process server: the real app stack, virtual time, its options.

Policy: servers run in the test's own trio run, without a socket; under
``autojump_clock`` unless the test is about the real clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import httpx
import pytest
import trio
import trio.testing

from headwater.testing import open_server
from workers.engines.scripted import ScriptError

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

TEXT = "A short answer from the script."
SCRIPT = [{"default": True, "text": TEXT}]


class Chat(TypedDict):
    """A chat completion's body, as the OpenAI SDK's ``create`` takes it too."""

    model: str
    messages: list[ChatCompletionMessageParam]


CHAT: Chat = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "Hello."}]}
#: Over every bound past which a request's work goes to a thread on the real clock: the
#: tokenizer pool's (8,192 characters), the scripted engine's (256 tokens), the KV
#: router's hashing (4,096 tokens), an echo's (1,024 tokens), token strings' (4,096).
WORDS = "lorem ipsum dolor " * 2000
LONG = {"model": "deepseek-v4", "messages": [{"role": "user", "content": WORDS}]}


async def long_prompt_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Serve one long prompt; the functions the request sent to threads."""
    calls: list[str] = []
    run_sync = trio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(getattr(fn, "__qualname__", repr(fn)))
        return await run_sync(fn, *args, **kwargs)

    async with open_server(script=SCRIPT, token_delay=0.5, router="kv") as server:
        monkeypatch.setattr(trio.to_thread, "run_sync", counted)  # start-up aside
        client = server.client(timeout=None)
        start = trio.current_time()
        r = await client.post("/v1/chat/completions", json=LONG)
        assert r.json()["choices"][0]["message"]["content"] == TEXT
        if server.virtual_time:  # exact: nothing ran behind the clock's back
            assert trio.current_time() - start == server.requests[0].tokens * 0.5
        ids = list(server.frontend.tokenizer.encode_ids(WORDS))  # echoed: decoded
        r = await client.post(
            "/v1/completions",
            json={"model": "deepseek-v4", "prompt": ids, "echo": True, "max_tokens": 2},
        )
        assert r.json()["choices"][0]["text"].startswith(WORDS)
        r = await client.post(
            "/tokenize", json={"model": "deepseek-v4", "prompt": WORDS, "return_token_strs": True}
        )
        assert len(r.json()["token_strs"]) > 4096
        monkeypatch.undo()
    return calls


async def test_under_a_mock_clock_no_request_work_runs_in_a_thread(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    # A MockClock cannot see a thread's work and would jump past it.
    assert await long_prompt_threads(monkeypatch) == []


@pytest.mark.slow
async def test_on_the_real_clock_a_long_prompt_goes_to_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the test above would see without the virtual-time settings.
    calls = await long_prompt_threads(monkeypatch)
    # The chat prompt's encode, with its block hashes for the KV router beside it.
    assert "TokenizerPool._encode.<locals>.encode_in_thread" in calls
    assert "_match" in calls  # the scripted engine reading the prompt
    assert "prompt_hashes" in calls  # the KV router's, for the prompt given as ids
    assert len(calls) >= 5  # and the echo's, the token strings'


async def test_the_stack_is_the_servers_api_keys_and_admission(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_server(
        script=SCRIPT, token_delay=0.1, api_keys=("k1",), max_inflight=1
    ) as server:
        assert (
            await server.client(headers={"Authorization": "Bearer nope"}).post(
                "/v1/chat/completions", json=CHAT
            )
        ).status_code == 401
        client = server.client()  # sends the server's first key
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                r = await client.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200

            nursery.start_soon(first)
            await trio.sleep(0.05)  # the first is in flight: max_inflight is reached
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
        assert [x.faults for x in server.requests] == [[], [], []]  # no fault: the real limit
        assert server.metric("rejected_requests_total", reason="max_inflight") == 1
        assert (await client.get("/health")).json()["status"] == "healthy"


async def test_asked_to_listen_it_serves_a_socket_too_and_records_both() -> None:
    # The real clock: a client outside the trio run is not on trio's.
    async with open_server(script=SCRIPT, listen=True) as server:
        assert server.url is not None
        assert server.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=server.url) as outside:
            r = await outside.post("/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"]["content"] == TEXT
        r = await server.client().post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        await server.settled()
        assert [(x.status, x.finish_reason) for x in server.requests] == [(200, "stop")] * 2
        assert server.requests[0].headers["host"] == server.url.removeprefix("http://")
    async with open_server(script=SCRIPT) as unasked:
        assert unasked.url is None


async def test_every_api_of_the_server_is_there(autojump_clock: trio.testing.MockClock) -> None:
    async with open_server(script=SCRIPT) as server:
        client = server.openai_client()
        assert (await client.responses.create(model="deepseek-v4", input="Hi")).output_text == TEXT
        completion = await client.completions.create(model="deepseek-v4", prompt="Hi")
        assert completion.choices[0].text == TEXT
        http = server.client()
        tokenized = await http.post("/tokenize", json={"model": "deepseek-v4", "prompt": TEXT})
        body = {"token_ids": tokenized.json()["tokens"], "sampling_params": {"max_tokens": 5}}
        generated = await http.post("/inference/v1/generate", json=body)
        assert generated.status_code == 200, generated.text
        assert [r.path for r in server.requests] == [
            "/v1/responses",
            "/v1/completions",
            "/tokenize",
            "/inference/v1/generate",
        ]


async def test_the_mocker_by_default_and_the_same_answer_for_a_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def answer() -> tuple[str, float]:
        async with open_server(workers="agg") as server:
            assert server.frontend.config.engine == "mocker"
            start = trio.current_time()
            r = await server.client().post(
                "/v1/chat/completions", json={**CHAT, "seed": 7, "max_tokens": 20}
            )
            assert r.json()["usage"]["completion_tokens"] == 20
            # Rounded: the two runs start at different virtual times.
            return (
                r.json()["choices"][0]["message"]["content"],
                round(trio.current_time() - start, 9),
            )

    first = await answer()
    assert first[1] > 0  # the mocker's simulated step times, on trio's clock
    assert await answer() == first


async def test_a_script_file_serves_as_well(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(rule) for rule in SCRIPT))
    async with open_server(script=path) as server:
        r = await server.openai_client().chat.completions.create(**CHAT)
        assert r.choices[0].message.content == TEXT


async def test_the_frontends_tokenizer_is_the_scripted_engines(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_server(script=SCRIPT) as first:
        tokenizer = first.frontend.tokenizer
    async with open_server(script=SCRIPT, tokenizer=tokenizer) as server:
        assert server.frontend.tokenizer is tokenizer
        engine_config = server.frontend.config.engine_config
        assert engine_config.tokenizer == str(tokenizer.files.tokenizer_json)
        r = await server.openai_client().chat.completions.create(**CHAT)
        assert r.choices[0].message.content == TEXT


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"workers": "both"}, "workers must be"),
        ({"workers": ["prefill"]}, "nothing generates"),
        ({"token_delay": 0.1}, "token_delay is the scripted engine's"),
        ({"script": [{"text": "no prompt_contains"}]}, "the script given, line 1"),
        ({"script": {"default": True, "text": "a dict"}}, "a list of rules"),
        ({"script": SCRIPT, "max_inflight": -1}, "max_inflight"),
        ({"script": SCRIPT, "engine": "vllm"}, "chosen by headwater.testing"),
    ],
)
async def test_a_bad_option_is_a_clear_error_before_anything_starts(
    options: dict[str, Any], problem: str
) -> None:
    with pytest.raises((ValueError, ScriptError), match=problem):
        async with open_server(**options):
            pass
