"""Every field of every request body, honoured or refused as the table says, per engine.

The table is :data:`frontend.http.fields.FIELDS`. Each row is sent, on each of its routes,
to a frontend in front of each engine: the simulated one, the scripted one, and vLLM's
engine attached to a fake vLLM (an ``httpx.MockTransport`` playing its token API, which
records what vLLM would have received). A row an engine honours answers 200 (and on
vLLM, reaches vLLM's ``sampling_params``); a row it does not answers 400 naming the
field, before any worker sees the request. What a real vLLM does with each field is
in tests/test_vllm_fields.py.

Policy: one frontend per engine for the module, each on its own trio loop in a thread
(``frontend_in_thread``), bound to 127.0.0.1:0 with in-process workers; the tests
are plain functions with a synchronous client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from frontend.http.anthropic.models import MessagesRequest
from frontend.http.fields import (
    FIELDS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    TABLES,
    Field,
    markdown,
    rows,
)
from frontend.http.models import REQUEST_MODELS, SamplingParams
from frontend.http.responses_api.models import ResponsesRequest
from frontend.preprocess.tokenizer import find_tokenizer_files
from headwater.wire import Role
from headwater.wire.capabilities import Capabilities
from workers.engines.mocker.engine import CAPABILITIES as MOCKER
from workers.engines.scripted.config import ScriptedConfig
from workers.engines.scripted.engine import CAPABILITIES as SCRIPTED
from workers.engines.vllm import engine as vllm_engine
from workers.engines.vllm.config import VllmConfig

from frontend_fixture import frontend_in_thread
from test_vllm_engine import URL, FakeVllm

REPO = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v4"
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    GENERATE: "/inference/v1/generate",
    MESSAGES: "/v1/messages",
    RESPONSES: "/v1/responses",
}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "completions": {"model": MODEL, "prompt": "def f(", "max_tokens": 2},
    GENERATE: {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}},
    MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    RESPONSES: {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
}
#: Each route's request model: every field of it has a row.
MODELS: dict[str, type[msgspec.Struct]] = {
    **REQUEST_MODELS,
    MESSAGES: MessagesRequest,
    RESPONSES: ResponsesRequest,
}
CASES = [
    pytest.param(row, route, id=f"{route}:{row.where(route)}")
    for row in FIELDS
    for route in row.routes
]


def body(http: httpx.Client, url: str, row: Field, route: str) -> dict[str, Any]:
    """The route's smallest body, with what *row* asks for (a response to continue is
    made first, on the same frontend)."""
    out: dict[str, Any] = json.loads(json.dumps(BASE[route]))
    if row.sampling and route == GENERATE:
        out["sampling_params"].update(row.asks)
    else:
        out.update(row.asks)
    if row.name == "previous_response_id":
        stored = http.post(url + PATHS[RESPONSES], json=BASE[RESPONSES])
        assert stored.status_code == 200, stored.text
        out["previous_response_id"] = stored.json()["id"]
    return out


def vllm_declaration(tokenizer: bool = True) -> Capabilities:
    """vLLM's engine's declaration for a model directory with (or without) a tokenizer."""
    features = set(vllm_engine.SAMPLING_FEATURES)
    if tokenizer:
        features.add("structured_outputs")
    return Capabilities("vllm", frozenset(features))


# -- the table itself ------------------------------------------------------------------------


#: The routes the tables cover: OpenAI's chat and completions, the token-in API,
#: Anthropic's Messages and OpenAI's Responses. (/tokenize and /detokenize say what they
#: honour in docs/api.md's section of their own.)
ROUTES = tuple(route for table in TABLES for route in table)


def test_every_field_of_every_request_model_has_a_row() -> None:
    for route in ROUTES:
        model = MODELS[route]
        declared = {f.name for f in msgspec.structs.fields(model)}
        if route == GENERATE:
            sampling = {f.name for f in msgspec.structs.fields(SamplingParams)}
            have = {r.name for r in rows(route) if not r.sampling}
            have_sampling = {r.name for r in rows(route) if r.sampling}
            assert have_sampling == sampling, f"sampling_params rows: {have_sampling ^ sampling}"
        else:
            have = {r.name for r in rows(route)}
        assert have == declared, (
            f"{route}: rows without a field or fields without a row: {have ^ declared}"
        )
    assert len({(r.where(route), route) for r in FIELDS for route in r.routes}) == len(CASES)


@pytest.mark.parametrize("routes", TABLES, ids=lambda routes: routes[0])
def test_the_docs_publish_the_table(routes: tuple[str, ...]) -> None:
    engines = {"mocker": MOCKER, "scripted": SCRIPTED, "vllm": vllm_declaration()}
    table = markdown(engines, routes)
    docs = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    assert table in docs, (
        f"docs/api.md's table of {routes} differs from frontend.http.fields "
        "(regenerate it with markdown())"
    )


def test_the_engines_declare_what_the_table_says(tmp_path: Path) -> None:
    # The columns come from the engines' own declarations; here, that those are what the
    # engines built by the registry say of themselves.
    from workers.engines import registry
    from workers.engines.base import EngineContext

    context = EngineContext(Role.AGG, "w")
    assert registry.build("mocker", None, context).capabilities == MOCKER
    with_tokenizer = VllmConfig(vllm_url=URL, model=str(model_dir(tmp_path)))
    assert registry.build("vllm", with_tokenizer, context).capabilities == vllm_declaration()
    ids_only = VllmConfig(vllm_url=URL, vocab_size=1000)
    assert registry.build("vllm", ids_only, context).capabilities == vllm_declaration(False)


# -- each engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    # One client for the module: each new one builds an SSL context (~0.2 s).
    with httpx.Client(timeout=30) as client:
        yield client


def check(
    http: httpx.Client, url: str, row: Field, route: str, caps: Capabilities
) -> httpx.Response:
    r = http.post(url + PATHS[route], json=body(http, url, row, route))
    if row.honoured(caps):
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        if route == MESSAGES:  # Anthropic's errors name no param: the message does
            assert err["type"] == "invalid_request_error", err
            assert row.param(route) in err["message"], err
        else:
            assert err["param"] == row.param(route), err
        if not row.refused:  # refused for what the engine lacks: it is named
            assert caps.engine in err["message"], err
    return r


@pytest.fixture(scope="module")
def mocker_url() -> Iterator[str]:
    with frontend_in_thread() as url:
        yield url


@pytest.mark.parametrize(("row", "route"), CASES)
def test_mocker(http: httpx.Client, mocker_url: str, row: Field, route: str) -> None:
    check(http, mocker_url, row, route, MOCKER)


@pytest.fixture(scope="module")
def scripted_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = tmp_path_factory.mktemp("script") / "answers.jsonl"
    script.write_text(json.dumps({"default": True, "text": "Fine, thanks."}) + "\n")
    config = ScriptedConfig(script=str(script), token_delay=0)
    with frontend_in_thread(engine="scripted", engine_config=config) as url:
        yield url


@pytest.mark.parametrize(("row", "route"), CASES)
def test_scripted(http: httpx.Client, scripted_url: str, row: Field, route: str) -> None:
    check(http, scripted_url, row, route, SCRIPTED)


def model_dir(path: Path) -> Path:
    """A model directory for the vLLM engine: a config.json of the tokenizer's
    vocabulary and the DeepSeek-V4 tokenizer itself (so it declares structured outputs)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": 129280}))
    tokenizer = path / "tokenizer.json"
    if not tokenizer.exists():
        tokenizer.symlink_to(find_tokenizer_files(None).tokenizer_json)
    return path


class RoomyVllm(FakeVllm):
    """The fake, with a context that holds a chat prompt with tools, answering with the
    logprobs a request asks for, in vLLM's shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.generate = self.answer

    async def handle(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 8192}]})
        return await super().handle(req)

    def answer(self, req: httpx.Request) -> httpx.Response:
        body = self.bodies[-1]
        params = body["sampling_params"]
        if not body["stream"]:  # a prompt's logprobs, asked on their own
            top = params.get("prompt_logprobs") or 0
            ids = body["token_ids"]
            ranks = [{str(t): {"logprob": -1.0, "rank": 1}} for t in ids[1:]]
            for entry in ranks:  # a most likely other token for each but the first
                entry.update({str(11 + k): {"logprob": -2.0, "rank": 2 + k} for k in range(top)})
            return httpx.Response(
                200, json={"choices": [{"token_ids": [11]}], "prompt_logprobs": [None, *ranks]}
            )
        asked = params.get("logprobs")
        events = []
        for token, finish in ((11, None), (12, "length")):
            choice: dict[str, Any] = {"token_ids": [token], "finish_reason": finish}
            if asked is not None:
                picked = {
                    "token_id": token,
                    "logprob": -0.5,
                    "rank": 1,
                    "top_logprobs": [{"token_id": token, "logprob": -0.5, "rank": 1}],
                }
                choice["logprobs"] = {"content": [picked]}
            events.append({"choices": [choice]})
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["token_ids"])}}
        lines = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in [*events, usage]]
        return httpx.Response(200, content=b"".join([*lines, b"data: [DONE]\n\n"]))


@pytest.fixture(scope="module")
def vllm_frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeVllm]]:
    fake = RoomyVllm()

    def build(config: VllmConfig, context: Any) -> vllm_engine.VllmEngine:
        return vllm_engine.VllmEngine(
            config, context.role, context.worker_id, transport=httpx.MockTransport(fake.handle)
        )

    config = VllmConfig(vllm_url=URL, model=str(model_dir(tmp_path_factory.mktemp("model"))))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_engine, "build_engine", build)
        with frontend_in_thread(engine="vllm", engine_config=config, mode="agg") as url:
            yield url, fake


@pytest.mark.parametrize(("row", "route"), CASES)
def test_vllm(
    http: httpx.Client, vllm_frontend: tuple[str, FakeVllm], row: Field, route: str
) -> None:
    url, fake = vllm_frontend
    sent = len(fake.bodies)
    r = check(http, url, row, route, vllm_declaration())
    if r.status_code != 200:
        assert len(fake.bodies) == sent  # refused before dispatch: vLLM saw nothing
        return
    # The request's bodies (prompt logprobs are asked in one of their own).
    bodies = [b["sampling_params"] for b in fake.bodies[sent:]]
    if row.vllm_key:
        received = next((b for b in bodies if row.vllm_key in b), None)
        assert received is not None, bodies
        asked = row.asks.get(row.name)
        if row.sampling and isinstance(asked, int | float) and row.name != "max_tokens":
            assert received[row.vllm_key] == asked, received
