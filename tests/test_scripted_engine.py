"""The scripted engine: its script, its answers, and the whole path in front of it.

Test policy: scripts are written to the test's tmp_path; frontends bind 127.0.0.1 port 0
in the test's nursery (tests/frontend_fixture.py); the one worker process binds 127.0.0.1
port 0 and gets 60 s to start (its tokenizer loads in ~1 s, far longer on a loaded
machine). Engine timing is checked on trio's MockClock; everything else runs with a token
delay of 0 or 1 ms, so each test takes well under a second once the tokenizer is loaded
(once per session). The agents SDK runs on asyncio, in a thread, against the same
loopback frontend.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from headwater.cli import build_parser
from headwater.cli import main as headwater_main
from headwater.cli.launch import plan_from_args
from headwater.cli.serve import frontend_config_from_args
from headwater.cluster.recipes import start_worker
from headwater.plane.base import WorkerInstance
from headwater.plane.client import connect_worker
from headwater.wire import FinishReason, GenerateRequest, Role, SamplingParams
from workers.engines import registry
from workers.engines.base import EngineContext, EngineError, EngineFailed
from workers.engines.scripted import (
    ScriptedConfig,
    ScriptedCounters,
    ScriptedEngine,
    ScriptError,
    parse_script,
)
from workers.engines.scripted.answer import answer_tokens, continued
from workers.engines.scripted.engine import INLINE_MAX_TOKENS

from frontend_fixture import (
    assert_error,
    engines,
    eventually,
    idle,
    shared_tokenizer,
    sse_events,
    start_frontend,
)

MODEL = "deepseek-v4"
EOS = 1  # DeepSeek-V4's <｜end▁of▁sentence｜>

WEATHER = "It is sunny in Paris, 22 degrees."
GREETING = "Hello! I am a script, not a model."
SCRIPT: list[dict[str, Any]] = [
    {"prompt_contains": "weather", "text": WEATHER},
    {"default": True, "text": GREETING},
]


@pytest.fixture
def script(tmp_path: Path) -> str:
    """SCRIPT, written to a file: its path."""
    return write_script(tmp_path / "script.jsonl", SCRIPT)


def write_script(path: Path, lines: Sequence[dict[str, Any] | str]) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def ids(text: str) -> list[int]:
    """*text* in the model's tokens, by the frontend's tokenizer (an oracle independent of
    the engine's own HF tokenizer)."""
    return list(shared_tokenizer().encode_ids(text))


def prompt_ids(text: str) -> list[int]:
    return ids(f"<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜></think>")


def request(
    prompt: str, max_tokens: int = 100, rid: str = "r1", **sampling: Any
) -> GenerateRequest:
    return GenerateRequest(
        rid,
        MODEL,
        prompt_ids(prompt),
        SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=(EOS,),
    )


# -- the script: parsing and matching ---------------------------------------------------


def test_the_first_matching_line_answers_else_the_default() -> None:
    script = parse_script(
        b'{"prompt_contains": "<tool_result>", "text": "after the tool"}\n'
        b"\n"  # blank lines are skipped
        b'{"default": true, "text": "fallback"}\n'
        b'{"prompt_contains": "weather", "text": "call the tool"}\n',
        "s.jsonl",
    )
    assert [r.line for r in script.rules] == [1, 3, 4]

    def answer(prompt: str) -> str | None:
        rule = script.match(prompt)
        return None if rule is None else rule.text

    assert answer("the weather, please") == "call the tool"
    # Both occur: the earlier line wins, wherever the default line is.
    assert answer("weather <tool_result>22</tool_result>") == "after the tool"
    assert answer("nothing known") == "fallback"
    assert answer("WEATHER") == "fallback"  # a case-sensitive match
    no_default = parse_script(b'{"prompt_contains": "a", "text": "b"}', "s")
    assert no_default.match("xyz") is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "no rules"),
        (b"\n  \n", "no rules"),
        (
            b'{"default": true, "text": "x"}\n{"text": "y", "prompt_contains": "a"\n',
            "line 2: not JSON",
        ),
        (b'["text", "x"]', "line 1: expected a JSON object, got list"),
        (b'{"prompt_contains": "a"}', 'line 1: needs "text"'),
        (b'{"prompt_contains": "a", "text": ""}', 'line 1: needs "text"'),
        (b'{"prompt_contains": "a", "text": 3}', 'line 1: needs "text"'),
        (b'{"text": "x"}', 'line 1: needs either "prompt_contains" or "default"'),
        (b'{"default": true, "prompt_contains": "a", "text": "x"}', "line 1: needs either"),
        (b'{"default": false, "text": "x"}', 'line 1: "default" can only be true'),
        (b'{"prompt_contains": "", "text": "x"}', 'line 1: "prompt_contains" must be'),
        (b'{"prompt_contains": null, "text": "x"}', 'line 1: "prompt_contains" must be'),
        (b'{"promt_contains": "a", "text": "x"}', "line 1: unknown key 'promt_contains'"),
        (
            b'{"default": true, "text": "x"}\n\n{"default": true, "text": "y"}',
            "line 3: a second default rule (the first is on line 1)",
        ),
        (
            b'{"prompt_contains": "weather", "text": "x"}\n'
            b'{"prompt_contains": "the weather in Paris", "text": "y"}',
            "line 2: never answers: line 1's prompt_contains 'weather'",
        ),
        (b'{"prompt_contains": "a", "text": "\xff"}', "line 1: not JSON"),
    ],
)
def test_a_bad_script_is_one_clear_line(content: bytes, problem: str) -> None:
    with pytest.raises(ScriptError) as exc:
        parse_script(content, "my.jsonl")
    message = str(exc.value)
    assert message.startswith("script my.jsonl"), message
    assert problem in message, message
    assert "\n" not in message


def test_the_config_reads_the_script_at_once(tmp_path: Path, script: str) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError, match=f"script {missing}: cannot read it: No such file"):
        ScriptedConfig(script=str(missing))
    bad = write_script(tmp_path / "bad.jsonl", [{"default": True, "text": "x"}, "{oops"])
    with pytest.raises(ValueError, match="line 2: not JSON"):
        ScriptedConfig(script=bad)
    with pytest.raises(ValueError, match="token_delay"):
        ScriptedConfig(token_delay=-1.0)
    good = ScriptedConfig(script=script, token_delay=0.0)
    assert good.tokenizer == ""
    assert good.tokenizer_path() is None
    assert ScriptedConfig() == registry.default_config("scripted")  # no script: valid...
    with pytest.raises(EngineFailed, match="needs a script"):  # ...but serves nothing
        registry.build("scripted", None, EngineContext(Role.AGG, "w"))


# -- the answer's tokens ------------------------------------------------------------------


def plan(text_ids: list[int], eos: Sequence[int] = (EOS,), **sampling: Any) -> list[Any]:
    params = SamplingParams(**{"max_tokens": 100, **sampling})
    return list(answer_tokens(text_ids, params, eos))


def test_the_answer_ends_with_eos_or_at_max_tokens() -> None:
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    assert plan([7, 8, 9]) == [(7, None), (8, None), (9, None), (EOS, stop)]
    assert plan([7, 8, 9], max_tokens=2) == [(7, None), (8, length)]
    assert plan([7, 8, 9], max_tokens=3) == [(7, None), (8, None), (9, length)]
    assert plan([7, 8, 9], max_tokens=4) == [(7, None), (8, None), (9, None), (EOS, stop)]
    # No EOS id known: the text's last token ends it.
    assert plan([7, 8], eos=()) == [(7, None), (8, stop)]


def test_stop_token_ids_min_tokens_and_ignore_eos_bend_it_as_a_model() -> None:
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    # A stop token in the text ends the output there, with it.
    assert plan([7, 8, 9], stop_token_ids=(8,)) == [(7, None), (8, stop)]
    # ... but not before min_tokens: the text goes on, then starts over, until allowed.
    assert plan([7, 8, 9], stop_token_ids=(8,), min_tokens=2) == [
        (7, None),
        (8, None),
        (9, None),
        (EOS, stop),
    ]
    assert plan([7, 8, 9], stop_token_ids=(8,), min_tokens=4) == [
        (7, None),
        (8, None),
        (9, None),
        (7, None),
        (8, stop),
    ]
    # The text is said whole each time: EOS comes at the end of a pass.
    assert plan([7, 8], min_tokens=3) == [(7, None), (8, None), (7, None), (8, None), (EOS, stop)]
    assert plan([7, 8], min_tokens=2) == [(7, None), (8, None), (EOS, stop)]
    # ignore_eos: the text over and over, up to max_tokens; EOS is no stop token then.
    assert plan([7, EOS, 8], ignore_eos=True, max_tokens=5) == [
        (7, None),
        (EOS, None),
        (8, None),
        (7, None),
        (EOS, length),
    ]
    # EOS written in the text stops it, as a model's EOS does.
    assert plan([7, EOS, 8]) == [(7, None), (EOS, stop)]


def test_a_prompt_ending_with_the_texts_start_is_continued() -> None:
    # A migrated request's prompt ends with what was said before its stream broke.
    stop = FinishReason.STOP
    assert continued([1, 2, 7, 8], [7, 8, 9], most=3) == 2
    assert continued([1, 2, 3], [7, 8, 9], most=3) == 0
    assert continued([7, 8, 7], [7, 8, 9], most=3) == 1  # the longest tail that fits: [7]
    assert continued([5, 7, 8, 9], [7, 8, 9], most=3) == 3  # all said: only EOS is left
    assert continued([5, 7, 8, 9], [7, 8, 9], most=2) == 0  # ...unless it may not be
    assert continued([], [7], most=1) == 0
    params = SamplingParams(max_tokens=100)
    assert list(answer_tokens([7, 8, 9], params, (EOS,), 2)) == [(9, None), (EOS, stop)]
    assert list(answer_tokens([7, 8, 9], params, (EOS,), 3)) == [(EOS, stop)]
    # min_tokens past the rest: the text starts over, whole.
    assert list(answer_tokens([7, 8], SamplingParams(max_tokens=9, min_tokens=2), (EOS,), 1)) == [
        (8, None),
        (7, None),
        (8, None),
        (EOS, stop),
    ]
    with pytest.raises(ValueError, match="past the text"):
        list(answer_tokens([7, 8], params, (), 2))  # no EOS: nothing is left to say


# -- the engine on its own, on virtual time ---------------------------------------------------


async def started_engine(
    nursery: trio.Nursery, script: str, role: Role = Role.AGG, token_delay: float = 0.0
) -> ScriptedEngine:
    engine = ScriptedEngine(ScriptedConfig(script=script, token_delay=token_delay), role, "w")
    await nursery.start(engine.run)
    return engine


async def test_tokens_come_one_per_delay_on_the_mock_clock(
    script: str, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = await started_engine(nursery, script, token_delay=0.25)
    start = trio.current_time()
    got: list[tuple[float, list[int], FinishReason | None]] = []
    async for chunk in engine.generate(request("What is the weather?")):
        got.append((trio.current_time(), chunk.token_ids, chunk.finish_reason))
    expected = [*ids(WEATHER), EOS]
    assert [c[1] for c in got] == [[t] for t in expected]
    assert [c[0] for c in got] == [start + n * 0.25 for n in range(1, len(expected) + 1)]
    assert [c[2] for c in got] == [None] * (len(expected) - 1) + [FinishReason.STOP]
    assert engine.counters.requests_finished == 1
    assert engine.counters.output_tokens == len(expected)


async def test_a_cancelled_or_closed_stream_is_counted_cancelled_and_leaves_nothing(
    script: str, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    engine = await started_engine(nursery, script, token_delay=1.0)
    stream = engine.generate(request("hi", max_tokens=1000, ignore_eos=True))
    await stream.__anext__()  # at 1.0
    assert engine.statistics().active_requests == 1
    with trio.move_on_after(1.5):  # cancelled while it waits for its third token (3.0)
        while True:
            await stream.__anext__()
    assert trio.current_time() == 2.5
    assert engine.statistics().active_requests == 0
    assert engine.counters.requests_cancelled == 1
    closed = engine.generate(request("hi", max_tokens=1000, ignore_eos=True, rid="r2"))
    await closed.__anext__()
    await closed.aclose()  # the consumer leaves between two tokens
    assert engine.statistics().active_requests == 0
    assert engine.counters.requests_cancelled == 2
    assert engine.counters.requests_finished == engine.counters.requests_failed == 0


async def test_a_long_prompt_is_read_beside_the_loop(script: str, nursery: trio.Nursery) -> None:
    engine = await started_engine(nursery, script)
    filler = "All work and no play makes Jack a dull boy. " * 400
    long = request(filler + "Now, the weather?")
    assert len(long.token_ids) > 10 * INLINE_MAX_TOKENS
    tokens: list[int] = []
    done = trio.Event()

    async def consume() -> None:
        tokens.extend([t async for c in engine.generate(long) for t in c.token_ids])
        done.set()

    nursery.start_soon(consume)
    seen_reading = False
    with trio.fail_after(30):
        while not done.is_set():
            # Read on the loop, the prompt would be read between two of these looks.
            seen_reading |= engine.statistics().waiting_requests == 1
            await trio.lowlevel.checkpoint()
    assert seen_reading  # the loop went on while the prompt was read
    assert tokens == [*ids(WEATHER), EOS]
    assert engine.statistics().waiting_requests == 0


async def test_no_matching_line_is_an_invalid_request_naming_the_script(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    path = write_script(tmp_path / "s.jsonl", SCRIPT[:1])
    engine = await started_engine(nursery, path)
    with pytest.raises(EngineError) as exc:
        [c async for c in engine.generate(request("hello"))]
    assert exc.value.code == "invalid_request"
    assert path in exc.value.message
    assert engine.counters.requests_unmatched == engine.counters.requests_failed == 1


async def test_a_prefill_engine_hands_back_a_handle_to_nothing(
    script: str, nursery: trio.Nursery
) -> None:
    engine = await started_engine(nursery, script, Role.PREFILL)
    req = request("weather")
    (chunk,) = [c async for c in engine.generate(req)]
    assert chunk.token_ids == []
    assert chunk.finish_reason is None
    assert chunk.kv_handle is not None
    assert chunk.kv_handle.num_tokens == len(req.token_ids)
    assert engine.statistics().kv_transfers_held == 0


async def test_a_bad_tokenizer_fails_the_engine_at_start(
    tmp_path: Path, script: str, nursery: trio.Nursery
) -> None:
    config = ScriptedConfig(script=script, tokenizer=str(tmp_path))
    engine = ScriptedEngine(config, Role.AGG, "w")
    with pytest.raises(EngineFailed, match=r"no tokenizer\.json at "):
        await nursery.start(engine.run)


# -- through the HTTP API, in-process --------------------------------------------------------


async def scripted_frontend(
    nursery: trio.Nursery, script: str, mode: str = "disagg", token_delay: float = 0.001
) -> tuple[Any, str]:
    config = ScriptedConfig(script=script, token_delay=token_delay)
    frontend, url, _ = await start_frontend(
        nursery, engine="scripted", engine_config=config, mode=mode
    )
    return frontend, url


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("mode", ["disagg", "agg"])
async def test_unary_answers_and_finish_reasons(
    script: str, nursery: trio.Nursery, mode: str
) -> None:
    frontend, url = await scripted_frontend(nursery, script, mode)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat("How is the weather?"))
        cut = await c.post("/v1/chat/completions", json=chat("Who are you?", max_tokens=3))
        completion = {"model": MODEL, "prompt": "Say hi", "max_tokens": 50}
        text = await c.post("/v1/completions", json=completion)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == WEATHER
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(ids(WEATHER)) + 1  # and its EOS
    assert cut.json()["choices"][0]["message"]["content"] == shared_tokenizer().decode(
        ids(GREETING)[:3]
    )
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    assert text.json()["choices"][0]["text"] == GREETING
    decode = next(e for e in engines(frontend) if e.role is not Role.PREFILL)
    counters: object = decode.counters
    assert isinstance(counters, ScriptedCounters)  # engines() is typed for mocker engines
    assert counters.requests_finished == 3
    assert counters.default_answers == 2


async def test_streaming_delivers_the_answer_token_by_token(
    script: str, nursery: trio.Nursery
) -> None:
    _, url = await scripted_frontend(nursery, script)
    body = chat("weather?", stream=True, stream_options={"include_usage": True})
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        events = await sse_events(r)
    assert events[-1] == "DONE"
    chunks = [e for e in events[:-1] if e["choices"]]
    deltas = [ch["choices"][0]["delta"].get("content", "") for ch in chunks]
    assert "".join(deltas) == WEATHER
    assert len([d for d in deltas if d]) >= len(ids(WEATHER)) // 2  # streamed, not at once
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == len(ids(WEATHER)) + 1


async def test_no_match_is_a_400_naming_the_script(tmp_path: Path, nursery: trio.Nursery) -> None:
    path = write_script(tmp_path / "only-weather.jsonl", SCRIPT[:1])
    frontend, url = await scripted_frontend(nursery, path)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat("hello"))
        async with c.stream("POST", "/v1/chat/completions", json=chat("hello", stream=True)) as s:
            events = await sse_events(s)
        ok = await c.post("/v1/chat/completions", json=chat("weather"))
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert path in err["message"]
    assert "no answer for this prompt" in err["message"]
    # A stream has sent its 200 already: the error comes in-stream, as OpenAI's do.
    assert events[-1] == "DONE"
    assert path in events[-2]["error"]["message"]
    assert ok.status_code == 200  # nothing else broke: the worker still serves
    await eventually(idle(frontend))


async def test_a_client_that_leaves_cancels_its_answer(script: str, nursery: trio.Nursery) -> None:
    frontend, url = await scripted_frontend(nursery, script, token_delay=0.05)
    body = chat("hi", stream=True, max_tokens=1000, ignore_eos=True)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if '"content":"Hello' in line:
                break  # leave mid-answer
    decode = next(e for e in engines(frontend) if e.role is not Role.PREFILL)
    await eventually(lambda: decode.counters.requests_cancelled == 1)
    assert decode.statistics().active_requests == 0
    await eventually(idle(frontend))


# -- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "worker", "launch"])
def test_every_command_refuses_a_bad_script_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    lines = [{"prompt_contains": "a", "text": "x"}, {"text": "y"}]
    bad = write_script(tmp_path / "bad.jsonl", lines)
    assert headwater_main([command, "--engine", "scripted", "--script", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f'headwater {command}: script {bad}, line 2: needs either "prompt_contains" '
        'or "default": true'
    )


def test_one_tokenizer_option_serves_the_frontend_and_the_engine(script: str) -> None:
    tok = str(Path(shared_tokenizer().files.tokenizer_json).parent)
    given = ["--engine", "scripted", "--script", script, "--token-delay", "0.02"]
    serve = build_parser("serve")
    config = frontend_config_from_args(serve.parse_args([*given, "--tokenizer", tok]))
    assert config.engine_config == ScriptedConfig(script=script, token_delay=0.02, tokenizer=tok)
    assert config.tokenizer == tok
    assert frontend_config_from_args(serve.parse_args(given)).tokenizer is None
    # launch: the workers get the engine's options, the frontend the same tokenizer.
    plan = plan_from_args(
        build_parser("launch").parse_args(
            [*given, "--tokenizer", tok, "--agg", "1", "--discovery", "static"]
        )
    )
    assert plan.engine == "scripted"
    assert plan.engine_args == ("--script", script, "--token-delay", "0.02", "--tokenizer", tok)
    assert plan.serve_args == ("--tokenizer", tok)


# -- over TCP: a worker process ---------------------------------------------------------------


@pytest.mark.slow
async def test_a_worker_process_answers_over_tcp(
    tmp_path: Path, script: str, nursery: trio.Nursery
) -> None:
    worker = await start_worker(
        nursery,
        "agg",
        log_dir=tmp_path,
        model=MODEL,
        engine="scripted",
        engine_args=["--script", script, "--token-delay", "0"],
        ready_within=60,
    )
    _, url, _ = await start_frontend(nursery, workers=worker.static_url(MODEL))
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        body = chat("weather", stream=True)
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = await sse_events(r)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == WEATHER
    client = await connect_worker(
        WorkerInstance(worker.worker_id, Role.AGG, MODEL, worker.address), nursery
    )
    async with client.stream(request("no match here", rid="direct", max_tokens=4)) as chunks:
        tokens = [t async for chunk in chunks for t in chunk.token_ids]
    assert tokens == ids(GREETING)[:4]
    stats = await client.fetch_stats()
    assert stats["engine_requests_finished"] == 2
    assert stats["engine_default_answers"] == 1
    assert stats["engine_output_tokens"] == len(ids(WEATHER)) + 1 + 4


# -- end to end with the official OpenAI SDK ------------------------------------------------


async def test_the_openai_sdk_streams_a_scripted_answer(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    script = write_script(tmp_path / "s.jsonl", SCRIPT[:1])  # no default line
    _, url = await scripted_frontend(nursery, script)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Any weather news?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage = [], None, None
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
        with pytest.raises(openai.BadRequestError, match="no answer for this prompt") as exc:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello"}]
            )
    assert "".join(pieces) == WEATHER
    assert len([p for p in pieces if p]) > 1
    assert finish == "stop"
    assert usage is not None
    assert usage.completion_tokens == len(ids(WEATHER)) + 1
    assert script in exc.value.message


# -- tool calls end to end: the OpenAI SDK and the openai-agents SDK ---------------------------
#
# The scripted answer is DeepSeek-V4's own tool-call markup (DSML); what the clients must see
# is OpenAI's: `tool_calls`, finish_reason "tool_calls", no markup in `content`.

DSML = "｜DSML｜"
CALL = (
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>"
)
FINAL = "It is 22 degrees and sunny in Paris."
TOOL_RESULT = "22 degrees, sunny"
#: The tool's result comes back in a later prompt (DeepSeek-V4 writes it in a
#: <tool_result> block): that line first, as the question is in that prompt too.
TOOL_SCRIPT = [
    {"prompt_contains": "<tool_result>", "text": FINAL},
    {"prompt_contains": "weather in Paris", "text": CALL},
]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = "What is the weather in Paris?"


async def tool_frontend(tmp_path: Path, nursery: trio.Nursery) -> str:
    _, url = await scripted_frontend(nursery, write_script(tmp_path / "tools.jsonl", TOOL_SCRIPT))
    return f"{url}/v1"


async def ask(
    client: openai.AsyncOpenAI, messages: list[Any], stream: bool
) -> tuple[str | None, list[dict[str, str]], str | None]:
    """One chat completion with TOOLS: its content, its tool calls (id, name, arguments)
    and finish reason, from the whole answer or reassembled from a stream's deltas."""
    finish: str | None
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = []
        for c in message.tool_calls or []:
            assert isinstance(c, ChatCompletionMessageFunctionToolCall)
            calls.append(
                {
                    "id": c.id,
                    "type": c.type,
                    "name": c.function.name,
                    "arguments": c.function.arguments,
                }
            )
        return message.content, calls, finish
    parts: list[str] = []
    slots: dict[int, dict[str, str]] = {}
    finish = None
    s = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    async with s:
        async for chunk in s:
            for choice in chunk.choices:
                delta = choice.delta
                parts.append(delta.content or "")
                for tc in delta.tool_calls or []:
                    slot = slots.setdefault(tc.index, {"arguments": ""})
                    if tc.id:  # the call's first delta: id, type and name
                        assert tc.function is not None
                        slot.update(id=tc.id, type=tc.type or "", name=tc.function.name or "")
                    elif tc.function is not None:
                        assert not tc.function.name  # named once
                    if tc.function is not None and tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
                finish = choice.finish_reason or finish
    assert list(slots) == sorted(slots)
    return "".join(parts), list(slots.values()), finish


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
async def test_the_openai_sdk_drives_a_tool_call_loop(
    tmp_path: Path, nursery: trio.Nursery, stream: bool
) -> None:
    base_url = await tool_frontend(tmp_path, nursery)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        content, calls, finish = await ask(client, messages, stream)
        assert finish == "tool_calls"
        assert not (content or "").strip()  # no markup, nor anything else, in content
        (call,) = calls
        assert call["id"]
        assert call["type"] == "function"
        assert call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        # The client runs the tool and sends its result back, as an agent loop does.
        messages += [
            {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT},
        ]
        content, calls, finish = await ask(client, messages, stream)
    assert content == FINAL
    assert calls == []
    assert finish == "stop"


@pytest.fixture
def agents_sdk() -> Any:
    """The openai-agents SDK (the test extra has it); a test needing it is skipped
    without it, but fails under CI, where it must be installed."""
    try:
        import agents
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("the openai-agents SDK is not installed (pip install -e '.[test]')")
    return agents


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.slow
async def test_the_agents_sdk_runs_an_agent_with_a_tool(
    tmp_path: Path, nursery: trio.Nursery, agents_sdk: Any, stream: bool
) -> None:
    agents = agents_sdk
    base_url = await tool_frontend(tmp_path, nursery)
    asked: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return TOOL_RESULT

    async def run_agent() -> Any:
        # The agents SDK runs on asyncio: it gets a loop of its own, in a thread, and
        # reaches this test's frontend over loopback like any client.
        agents.set_tracing_disabled(True)
        # Its own timeout bounds the run: a thread cannot be cancelled from here.
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=20
        ) as client:
            agent = agents.Agent(
                name="forecaster",
                instructions="Answer questions about the weather with the get_weather tool.",
                tools=[agents.function_tool(get_weather)],
                model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            )
            if not stream:
                return (await agents.Runner.run(agent, QUESTION)).final_output
            result = agents.Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
            return result.final_output

    final = await trio.to_thread.run_sync(asyncio.run, run_agent())
    assert asked == ["Paris"]
    assert final == FINAL
