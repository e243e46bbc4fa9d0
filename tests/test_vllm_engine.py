"""The vLLM engine without vLLM: its protocol mapping, config, launcher, and the engine
against a fake vLLM (an ``httpx.MockTransport`` playing vLLM's token API).

Test policy: no process, no socket; the engine is attached (``--vllm-url``) to the
fake, on virtual time where a test waits (``autojump_clock``). What only a real vLLM
can show (exactness, NIXL, a real crash) is in tests/test_vllm_*.py.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from headwater.orphans import SUPERVISOR_ENV
from headwater.wire import (
    Chunk,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KvHandle,
    Role,
    SamplingParams,
    TokenLogprobs,
)
from workers.engines.base import EngineError, EngineFailed
from workers.engines.vllm import launcher, protocol
from workers.engines.vllm.api_server import ApiServerBackend
from workers.engines.vllm.config import VllmClient, VllmConfig
from workers.engines.vllm.engine import VllmEngine, build_engine
from workers.engines.vllm.in_process import InProcessBackend
from workers.engines.vllm.server import serve_argv, serve_env

URL = "http://vllm.test:8000"
VOCAB = 1000


def request(
    ids: list[int] | array[int] | None = None,
    max_tokens: int = 3,
    *,
    handle: KvHandle | None = None,
    eos: tuple[int, ...] = (),
    **sampling: Any,
) -> GenerateRequest:
    return GenerateRequest(
        "r1",
        "m",
        [5, 6, 7] if ids is None else ids,
        SamplingParams(max_tokens=max_tokens, **sampling),
        handle,
        eos,
    )


# ---- protocol (sans-IO) ----------------------------------------------------------------


def test_the_body_carries_every_sampling_parameter_and_the_eos_ids() -> None:
    req = request(
        array("I", [5, 6]),
        9,
        eos=(1,),
        temperature=0.5,
        top_p=0.8,
        seed=3,
        min_tokens=2,
        stop_token_ids=(7,),
    )
    body = orjson.loads(protocol.generate_body(req, stream=True))
    assert body["token_ids"] == [5, 6]
    assert body["request_id"] == "r1"
    assert body["stream_options"] == {"include_usage": True}
    assert body["sampling_params"] == {
        "max_tokens": 9,
        "min_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.8,
        "ignore_eos": False,
        "stop_token_ids": [7, 1],
        "detokenize": False,
        "seed": 3,
    }
    ignoring_eos = request(eos=(1,), ignore_eos=True)
    ignoring = orjson.loads(protocol.generate_body(ignoring_eos, stream=False))
    assert ignoring["sampling_params"]["stop_token_ids"] == []
    assert "seed" not in ignoring["sampling_params"]
    assert "stream_options" not in ignoring


def test_a_prefill_body_asks_for_one_token_and_remote_decode() -> None:
    body = orjson.loads(
        protocol.generate_body(
            request(max_tokens=50, min_tokens=10),
            stream=False,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
    )
    assert body["sampling_params"]["max_tokens"] == 1
    assert body["sampling_params"]["min_tokens"] == 1
    assert body["kv_transfer_params"] == {"do_remote_decode": True}


def test_stream_lines_become_events() -> None:
    token = protocol.parse_sse_line('data: {"choices":[{"token_ids":[42],"finish_reason":null}]}')
    assert token == protocol.StreamEvent([42])
    last = protocol.parse_sse_line('data: {"choices":[{"token_ids":[7],"finish_reason":"stop"}]}')
    assert last is not None
    assert (last.token_ids, last.finish) == ([7], "stop")
    usage = protocol.parse_sse_line(
        'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":'
        '{"cached_tokens":4}}}'
    )
    assert usage is not None
    assert usage.cached_tokens == 4
    assert protocol.parse_sse_line("data: [DONE]") is protocol.DONE
    assert protocol.parse_sse_line("") is None
    with pytest.raises(protocol.VllmRequestError, match="engine dead"):
        protocol.parse_sse_line('data: {"error":{"message":"engine dead","code":500}}')
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sse_line("data: {nope")


def test_logprobs_are_asked_and_read_in_vllms_shapes() -> None:
    req = request(max_tokens=2, logprobs=2, prompt_logprobs=1)
    params = orjson.loads(protocol.generate_body(req, stream=True))["sampling_params"]
    assert params["logprobs"] == 2
    assert "prompt_logprobs" not in params  # vLLM's stream would drop them
    unary = orjson.loads(
        protocol.generate_body(
            req, stream=False, max_tokens=1, prompt_logprobs=True, request_id="r1.p"
        )
    )
    assert (unary["sampling_params"]["prompt_logprobs"], unary["request_id"]) == (1, "r1.p")
    # vLLM's tokens shape: the position's token first, then the top ones (its dict
    # order), cut to `logprobs` entries; a token outside the top has its own rank.
    event = {
        "choices": [
            {
                "token_ids": [7, 9],
                "finish_reason": None,
                "logprobs": {
                    "content": [
                        {
                            "token_id": 7,
                            "logprob": -0.1,
                            "rank": 1,
                            "top_logprobs": [
                                {"token_id": 7, "logprob": -0.1, "rank": 1},
                                {"token_id": 8, "logprob": -2.5, "rank": 2},
                            ],
                        },
                        {
                            "token_id": 9,
                            "logprob": -4.0,
                            "rank": 5,
                            "top_logprobs": [
                                {"token_id": 9, "logprob": -4.0, "rank": 5},
                                {"token_id": 3, "logprob": -0.3, "rank": 1},
                            ],
                        },
                    ]
                },
            }
        ]
    }
    got = protocol.parse_answer(orjson.dumps(event), logprobs=2)
    assert got.logprobs == (
        TokenLogprobs(-0.1, 1, (7, 8), (-0.1, -2.5)),
        TokenLogprobs(-4.0, 5, (3,), (-0.3,)),  # the 2nd most likely was cut by vLLM
    )
    assert protocol.parse_answer(orjson.dumps(event)).logprobs is None  # not asked
    zero = protocol.parse_answer(orjson.dumps(event), logprobs=0).logprobs
    assert zero is not None
    assert [e.top_ids for e in zero] == [(), ()]
    prompt = {
        "choices": [{"token_ids": [4]}],
        "prompt_logprobs": [
            None,
            {
                "6": {"logprob": -3.0, "rank": 4, "decoded_token": None},
                "2": {"logprob": -0.5, "rank": 1, "decoded_token": None},
            },
            {"7": {"logprob": -9999.0, "rank": 900}, "8": {"logprob": -1.0, "rank": 1}},
        ],
    }
    assert protocol.parse_answer(orjson.dumps(prompt), prompt_logprobs=1).prompt_logprobs == (
        TokenLogprobs(-3.0, 4, (2,), (-0.5,)),
        TokenLogprobs(-9999.0, 900, (8,), (-1.0,)),
    )
    for bad in (
        {"choices": [{"token_ids": [7]}]},
        {"choices": [{"token_ids": [7], "logprobs": {"content": [{"token_id": 7}]}}]},
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_answer(orjson.dumps(bad), logprobs=1)
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_answer(orjson.dumps({"choices": []}), prompt_logprobs=1)


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 10.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 300.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.03
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="16384"} 1.0
"""


def test_metrics_are_read_into_load() -> None:
    m = protocol.parse_metrics(METRICS)
    assert (m.running, m.waiting, m.kv_usage) == (3, 2, 0.25)
    assert (m.kv_blocks_total, m.block_size) == (16384, 128)
    assert m.prompt_tokens_by_source == {"local_compute": 10.0, "external_kv_transfer": 300.0}
    assert (m.nixl_xfer_seconds_sum, m.nixl_xfer_count) == (0.03, 2.0)
    assert protocol.parse_metrics("garbage\nvllm:num_requests_running nan\n").running == 0


# ---- config, server command, launcher ---------------------------------------------------


def model_dir(tmp_path: Path, vocab: int = VOCAB, tokenizer: bool = True) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_the_config_reads_the_model_directory(tmp_path: Path) -> None:
    config = VllmConfig(model=str(model_dir(tmp_path)))
    assert config.model_vocab_size() == VOCAB
    assert config.tokenizer_path() == str(tmp_path)
    assert VllmConfig(model=str(tmp_path), vocab_size=7).model_vocab_size() == 7
    assert VllmConfig(vllm_url=URL).model_vocab_size() is None
    with pytest.raises(ValueError, match="vllm-url"):
        VllmConfig(vllm_url="vllm.test:8000")
    with pytest.raises(ValueError):
        VllmConfig(vllm_args="--unbalanced 'quote")


def test_a_started_server_gets_its_role_s_connector_and_environment(tmp_path: Path) -> None:
    config = VllmConfig(
        model=str(tmp_path), enforce_eager=True, vllm_args="--max-num-seqs 8", kv_lease_duration=45
    )
    argv = serve_argv(config, Role.PREFILL, 1234)
    assert argv[1:4] == ["-m", "workers.engines.vllm.launcher", "serve"]
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert "--enforce-eager" in argv
    assert "--skip-tokenizer-init" in argv  # the directory has no tokenizer to load
    assert "--enable-scale-out" in argv
    (tmp_path / "tokenizer.json").write_text("{}")  # one to build grammars over
    assert "--skip-tokenizer-init" not in serve_argv(config, Role.PREFILL, 1234)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 45},
    }
    assert "--kv-transfer-config" not in serve_argv(config, Role.AGG, 1234)
    assert (
        json.loads(
            serve_argv(config, Role.DECODE, 1)[
                serve_argv(config, Role.DECODE, 1).index("--kv-transfer-config") + 1
            ]
        )["kv_role"]
        == "kv_consumer"
    )
    env = serve_env(config, Role.PREFILL, {"UCX_TLS": "tcp"})
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["UCX_TLS"] == "tcp"  # the user's choice stays
    assert env["UCX_NET_DEVICES"] == "lo"
    assert env[SUPERVISOR_ENV] == str(os.getpid())
    assert SUPERVISOR_ENV == launcher.PARENT_ENV
    agg = serve_env(config, Role.AGG, {})
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in agg
    assert "VLLM_CPU_OMP_THREADS_BIND" not in agg  # vLLM's choice
    by_role = VllmConfig(cpu_bind="role")
    cores = sorted(os.sched_getaffinity(0))
    assert serve_env(by_role, Role.PREFILL, {})["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[0])
    assert serve_env(by_role, Role.DECODE, {})["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[-1])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve_env(by_role, Role.AGG, {})
    assert serve_env(VllmConfig(cpu_bind="0-1"), Role.AGG, {})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    gpu = serve_env(VllmConfig(kv_buffer_device="cuda"), Role.DECODE, {})
    assert "UCX_TLS" not in gpu  # UCX picks its CUDA transports


def test_the_launcher_answers_vllms_version_lookup_for_vllm_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata as md

    def only_vllm_cpu(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        if name == "other":
            return "1.0"
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(launcher, "_original_version", only_vllm_cpu)
    assert launcher._version("vllm") == "0.32.0+cpu"  # the tag vLLM finds its platform by
    assert launcher._version("other") == "1.0"
    assert launcher.vllm_version() == "0.32.0"


def test_the_launcher_writes_a_vllm_shim(tmp_path: Path) -> None:
    shim = tmp_path / "vllm"
    launcher.install_shim(shim)
    text = shim.read_text()
    assert "-m workers.engines.vllm.launcher" in text
    assert shim.stat().st_mode & 0o111


def test_an_engine_without_a_model_or_a_vocabulary_is_refused(tmp_path: Path) -> None:
    from workers.engines.base import EngineContext

    with pytest.raises(EngineFailed, match="--model PATH or --vllm-url"):
        build_engine(VllmConfig(), EngineContext(Role.AGG, "w"))
    with pytest.raises(EngineFailed, match="vocabulary"):
        build_engine(VllmConfig(vllm_url=URL), EngineContext(Role.AGG, "w"))


@pytest.mark.parametrize(
    ("client", "beside_frontend", "attached", "way"),
    [
        ("auto", False, False, InProcessBackend),  # a worker of its own: in-process
        ("auto", True, False, ApiServerBackend),  # serve's in-process workers
        ("in-process", True, False, InProcessBackend),  # asked for: obeyed
        ("api-server", False, False, ApiServerBackend),
        ("in-process", False, True, ApiServerBackend),  # --vllm-url: always its API server
    ],
)
def test_the_way_to_vllm_follows_the_option_and_where_the_worker_runs(
    client: str, beside_frontend: bool, attached: bool, way: type
) -> None:
    from workers.engines.base import EngineContext

    config = VllmConfig(
        model="/models/m",
        vllm_url=URL if attached else "",
        vllm_client=VllmClient(client),
        vocab_size=1000,
    )
    context = EngineContext(Role.AGG, "w", beside_frontend=beside_frontend)
    assert type(build_engine(config, context).backend) is way
    with pytest.raises(ValueError, match="not a valid VllmClient"):
        VllmConfig(vllm_client="sideways")  # type: ignore[arg-type]


# ---- the engine against a fake vLLM -----------------------------------------------------


Handler = Callable[[httpx.Request], Any]


class FakeVllm:
    """vLLM's endpoints, scripted per test; records the generate bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.healthy_after = 0  # /health answers 503 this many times first
        self.metrics_ok = True
        self.metrics = METRICS
        self.generate: Handler = lambda req: sse([[11], [12]], "length", cached=2)
        self.health_calls = 0

    async def handle(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if path == "/health":
            self.health_calls += 1
            return httpx.Response(200 if self.health_calls > self.healthy_after else 503)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        if path == "/metrics":
            if not self.metrics_ok:
                raise httpx.ConnectError("refused", request=req)
            return httpx.Response(200, text=self.metrics)
        if path == protocol.GENERATE_PATH:
            self.bodies.append(json.loads(await req.aread()))
            result = self.generate(req)
            response: httpx.Response = await result if hasattr(result, "__await__") else result
            return response
        return httpx.Response(404)


def sse(
    tokens: list[list[int]], finish: str | None, *, cached: int | None = None, delay: float = 0.0
) -> httpx.Response:
    parts = []
    for i, ids in enumerate(tokens):
        last = finish if i == len(tokens) - 1 else None
        event = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": last}]}
        parts.append(b"data: " + orjson.dumps(event) + b"\n\n")
    if finish is not None:
        usage: dict[str, Any] = {"prompt_tokens": 3}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        parts.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_Events(parts, delay)
    )


class _Events:
    """An SSE body's parts, each after *delay* s. An iterator, not an async generator:
    httpx never closes the body it iterates, and a generator left suspended (a stream
    the engine gave up on) warns when it is collected, in whichever test that is."""

    def __init__(self, parts: list[bytes], delay: float) -> None:
        self.parts = parts
        self.delay = delay

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        if self.delay:
            await trio.sleep(self.delay)
        return self.parts.pop(0)


def engine(fake: FakeVllm, role: Role = Role.AGG, **config: Any) -> VllmEngine:
    settings: dict[str, Any] = {"vllm_url": URL, "metrics_interval": 0.5, **config}
    return VllmEngine(
        VllmConfig(**settings),
        role,
        f"{role}-0",
        vocab_size=VOCAB,
        transport=httpx.MockTransport(fake.handle),
    )


async def collect(eng: VllmEngine, req: GenerateRequest) -> list[Chunk]:
    return [chunk async for chunk in eng.generate(req)]


async def test_not_ready_until_vllm_is_healthy(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    fake.healthy_after = 8
    eng = engine(fake)
    with pytest.raises(EngineError) as early:
        await collect(eng, request())
    assert early.value.code is ErrorCode.SHUTTING_DOWN
    started = trio.current_time()
    await nursery.start(eng.run)
    assert fake.health_calls == 9
    assert trio.current_time() - started >= 8 * 0.25
    assert eng.max_model_len == 64  # from /v1/models
    assert eng.up


async def test_a_stream_maps_tokens_finish_and_cached_tokens(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    eng = engine(fake)
    await nursery.start(eng.run)
    chunks = await collect(eng, request(eos=(1,)))
    assert [c.token_ids for c in chunks] == [[11], [12]]
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].cached_tokens == 2
    (body,) = fake.bodies
    assert body["stream"] is True
    assert body["sampling_params"]["stop_token_ids"] == [1]
    fake.generate = lambda req: sse([[11], [1]], "stop")
    chunks = await collect(eng, request(eos=(1,)))
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert eng.counters.requests_finished == 2


async def test_logprobs_reach_the_chunks_and_prompt_logprobs_come_first(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    entry = {
        "token_id": 11,
        "logprob": -0.2,
        "rank": 1,
        "top_logprobs": [{"token_id": 11, "logprob": -0.2, "rank": 1}],
    }

    def answer(req: httpx.Request) -> httpx.Response:
        body = fake.bodies[-1]
        if not body["stream"]:  # the prompt's logprobs, asked first
            return httpx.Response(
                200,
                json={
                    "choices": [{"token_ids": [11]}],
                    "prompt_logprobs": [
                        None,
                        {"6": {"logprob": -1.5, "rank": 2}, "5": {"logprob": -0.1, "rank": 1}},
                        {"7": {"logprob": -0.7, "rank": 1}},
                    ],
                },
            )
        events = [
            {
                "choices": [
                    {"token_ids": [11], "finish_reason": finish, "logprobs": {"content": [entry]}}
                ]
            }
            for finish in (None, "length")
        ]
        lines = [b"data: " + orjson.dumps(e) + b"\n\n" for e in [*events, {"choices": []}]]
        return httpx.Response(200, content=b"".join([*lines, b"data: [DONE]\n\n"]))

    fake.generate = answer
    eng = engine(fake)
    await nursery.start(eng.run)
    chunks = await collect(eng, request(max_tokens=2, logprobs=0, prompt_logprobs=1))
    assert [b["stream"] for b in fake.bodies] == [False, True]
    assert fake.bodies[0]["request_id"] == "r1.prompt"
    assert fake.bodies[0]["sampling_params"]["max_tokens"] == 1
    assert [c.logprobs for c in chunks] == [(TokenLogprobs(-0.2, 1),)] * 2
    assert chunks[0].prompt_logprobs == (
        TokenLogprobs(-1.5, 2, (5,), (-0.1,)),
        TokenLogprobs(-0.7, 1, (7,), (-0.7,)),
    )
    assert chunks[1].prompt_logprobs is None


async def test_ids_past_the_vocabulary_never_reach_vllm(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    eng = engine(fake)
    await nursery.start(eng.run)
    for bad in (
        request([5, VOCAB]),
        request([5], stop_token_ids=(VOCAB,)),
        request([]),
        request(list(range(64))),
        request(max_tokens=0),
    ):
        with pytest.raises(EngineError) as refused:
            await collect(eng, bad)
        assert refused.value.code is ErrorCode.INVALID_REQUEST
    assert fake.bodies == []
    assert eng.counters.requests_refused == 5


async def test_prefill_returns_vllms_kv_params_as_the_handle(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "e",
        "remote_request_id": "generate-tokens-r1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    fake.generate = lambda req: httpx.Response(
        200,
        json={
            "choices": [{"index": 0, "token_ids": [77], "finish_reason": "length"}],
            "kv_transfer_params": params,
        },
    )
    eng = VllmEngine(
        VllmConfig(vllm_url=URL),
        Role.PREFILL,
        "p0",
        vocab_size=VOCAB,
        transfer_address="tcp://127.0.0.1:9",
        transport=httpx.MockTransport(fake.handle),
    )
    await nursery.start(eng.run)
    (chunk,) = await collect(eng, request(max_tokens=20))
    assert chunk.token_ids == [77]
    handle = chunk.kv_handle
    assert handle is not None
    assert handle.params == params
    assert (handle.worker_id, handle.address, handle.num_tokens) == ("p0", "tcp://127.0.0.1:9", 3)
    assert handle.transfer_id == "generate-tokens-r1"
    (body,) = fake.bodies
    assert body["stream"] is False
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["sampling_params"]["max_tokens"] == 1


async def test_decode_hands_the_params_on_and_a_failed_transfer_is_retryable(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    eng = engine(fake, Role.DECODE, kv_pull_timeout=5.0)
    await nursery.start(eng.run)
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [3]}
    handle = KvHandle("p0", "tcp://p", "t", 3, params=params)
    assert len(await collect(eng, request(handle=handle))) == 2
    assert fake.bodies[-1]["kv_transfer_params"] == params

    # vLLM's own error for a transfer it could not do: kv_transfer_failed.
    fake.generate = lambda req: httpx.Response(500, json={"error": {"message": "nixl"}})
    with pytest.raises(EngineError) as failed:
        await collect(eng, request(handle=handle))
    assert failed.value.code is ErrorCode.KV_TRANSFER_FAILED

    # No first token within kv_pull_timeout: kv_transfer_failed, not a hang.
    fake.generate = lambda req: sse([[11]], "length", delay=60)
    started = trio.current_time()
    with pytest.raises(EngineError) as stuck:
        await collect(eng, request(handle=handle))
    assert stuck.value.code is ErrorCode.KV_TRANSFER_FAILED
    assert trio.current_time() - started == pytest.approx(5.0)

    # A handle of another engine's prefill (no vLLM params) cannot be used.
    with pytest.raises(EngineError) as foreign:
        await collect(eng, request(handle=KvHandle("p0", "tcp://p", "t", 3)))
    assert foreign.value.code is ErrorCode.KV_TRANSFER_FAILED


async def test_vllm_errors_map_to_codes(nursery: trio.Nursery, autojump_clock: object) -> None:
    fake = FakeVllm()
    eng = engine(fake)
    await nursery.start(eng.run)
    cases: list[tuple[Handler, ErrorCode]] = [
        (
            lambda req: httpx.Response(400, json={"error": {"message": "too long"}}),
            ErrorCode.INVALID_REQUEST,
        ),
        (lambda req: httpx.Response(500, json={"error": {"message": "boom"}}), ErrorCode.INTERNAL),
        (lambda req: sse([[11]], None), ErrorCode.SHUTTING_DOWN),  # ended without a finish
        (lambda req: sse([[11]], "abort"), ErrorCode.INTERNAL),
    ]
    for handler, code in cases:
        fake.generate = handler
        with pytest.raises(EngineError) as failed:
            await collect(eng, request())
        assert failed.value.code is code, failed.value

    def refused(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    fake.generate = refused
    with pytest.raises(EngineError) as gone:
        await collect(eng, request())
    assert gone.value.code is ErrorCode.SHUTTING_DOWN


async def test_an_attached_vllm_that_stops_answering_is_down_until_it_answers(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    fake = FakeVllm()
    eng = engine(fake)
    await nursery.start(eng.run)
    await trio.sleep(1)
    stats = eng.statistics()
    assert (stats.active_requests, stats.waiting_requests) == (3, 2)
    assert (stats.kv_blocks_used, stats.kv_blocks_total) == (4096, 16384)
    assert eng.counters.prompt_tokens_transferred == 300

    # A request waiting on vLLM when it goes down fails at once, and migrates.
    fake.generate = lambda req: sse([[11], [12]], "length", delay=100)
    fake.metrics_ok = False
    with pytest.raises(EngineError) as down:
        await collect(eng, request())
    assert down.value.code is ErrorCode.SHUTTING_DOWN
    assert not eng.up
    assert trio.current_time() < 1 + 3 * 0.5 + 0.1  # down after 3 missed polls
    fake.metrics_ok = True
    await trio.sleep(1)
    assert eng.up


def test_an_error_finish_is_the_kv_transfers_on_a_decode_leg_only() -> None:
    # vLLM in-process ends a decode whose KV pull failed with finish_reason "error"
    # (through its API server the same failure is an error event): retryable there.
    from workers.engines.vllm.engine import _finish

    with pytest.raises(EngineError) as pulled:
        _finish("error", True, kv=True)
    assert pulled.value.code is ErrorCode.KV_TRANSFER_FAILED
    with pytest.raises(EngineError) as plain:
        _finish("error", True)
    assert plain.value.code is ErrorCode.INTERNAL
    assert _finish("length", True, kv=True) is FinishReason.LENGTH
