"""Several models behind one frontend (frontend/catalog.py; docs/api.md, "Several models").

The catalog on its own (a router's registered workers decide what is discovered), a
frontend with a configured second model, and a launched cluster of two models: the
mocker's deepseek-v4 and the scripted engine under a second name, each request reaching
only its model's workers, one model's workers stopped while the other keeps serving.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import trio

from frontend.catalog import ModelCatalog, ModelSpec, parse_model_spec
from frontend.errors import UnknownModel
from frontend.pipeline import Pipeline
from frontend.router.router import Router
from headwater.cli.launch import extra_model

from cluster_fixture import launch, wait_dead
from frontend_fixture import serve_frontend

MODEL = "deepseek-v4"


def test_a_served_models_spec_names_its_settings() -> None:
    assert parse_model_spec("coder") == ModelSpec("coder")
    spec = parse_model_spec(
        "coder:tokenizer=/m/tok.json,context-length=8192,tool-call-parser=hermes"
    )
    assert spec == ModelSpec(
        "coder", tokenizer="/m/tok.json", context_length=8192, tool_call_parser="hermes"
    )
    for bad in (":tokenizer=x", "coder:vocab=1", "coder:context-length=0", "coder:tokenizer"):
        with pytest.raises(ValueError, match="served model"):
            parse_model_spec(bad)


class Workers:
    """A router's registered workers, as the catalog reads them."""

    def __init__(self) -> None:
        self.models: list[str] = []

    def clients(self) -> list[Any]:
        return [SimpleNamespace(instance=SimpleNamespace(model=m)) for m in self.models]


def pipeline(name: str) -> Pipeline:
    return cast(Pipeline, SimpleNamespace(model_name=name, attach=lambda nursery: None))


def test_a_discovered_model_is_served_while_it_has_workers() -> None:
    workers = Workers()
    built: list[str] = []

    def discover(name: str) -> Pipeline:
        built.append(name)
        return pipeline(name)

    catalog = ModelCatalog(
        pipeline(MODEL), cast(Router, workers), (pipeline("configured"),), discover
    )
    # The configured models are served with or without workers.
    assert catalog.names() == [MODEL, "configured"]
    assert catalog.get(None).model_name == catalog.get(MODEL).model_name == MODEL
    assert catalog.get("configured").model_name == "configured"
    with pytest.raises(UnknownModel):
        catalog.get("coder")
    workers.models = [MODEL, "coder", "coder"]
    assert catalog.names() == [MODEL, "configured", "coder"]
    first = catalog.get("coder")
    assert catalog.get("coder") is first  # built once, from its first request on
    assert built == ["coder"]
    assert catalog.label("coder") == "coder"
    assert catalog.label("anything else") == ""  # no series per name a client sends
    workers.models = [MODEL]  # its last worker left
    assert catalog.names() == [MODEL, "configured"]
    with pytest.raises(UnknownModel):
        catalog.get("coder")
    assert catalog.label("coder") == ""
    # Configured-only: what workers register is not served.
    fixed = ModelCatalog(pipeline(MODEL), cast(Router, Workers()))
    assert not fixed.discovers
    with pytest.raises(UnknownModel):
        fixed.get("coder")
    with pytest.raises(ValueError, match="name of its own"):
        ModelCatalog(pipeline(MODEL), cast(Router, workers), (pipeline(MODEL),))


async def test_a_configured_model_has_a_pipeline_of_its_own() -> None:
    spec = ModelSpec("small", context_length=512, tool_call_parser="hermes")
    async with (
        serve_frontend(served_models=(spec,)) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        listed = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        assert listed == [MODEL, "small"]
        assert (await c.get("/v1/models/small")).json()["id"] == "small"
        assert (await c.get("/v1/models/other")).status_code == 404
        small = fe.catalog.get("small")
        assert (small.context_length, small.parsers.tool_call_parser) == (512, "hermes")
        assert small.pool is fe.pipeline.pool  # the same tokenizer: one pool
        # Its own context length: a prompt the primary takes is too long for it.
        long = {"messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 2}
        r = await c.post("/v1/chat/completions", json={**long, "model": "small"})
        assert r.status_code == 400, r.text
        assert "512" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json={**long, "model": MODEL})
        assert r.status_code == 200, r.text
        # No worker serves it (the in-process workers are the primary's): retryable.
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await c.post("/v1/chat/completions", json={**short, "model": "small"})
        assert r.status_code == 503, r.text
        r = await c.post("/v1/chat/completions", json={**short, "model": "nope"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        metrics = (await c.get("/metrics")).text
        assert 'model="deepseek-v4",request_type="unary",status="success"' in metrics
        assert 'model="small",request_type="unary",status="rejected"' in metrics


def test_launchs_extra_models_are_checked_before_anything_starts() -> None:
    extra = extra_model("coder scripted prefill=1 decode=2 --token-delay 0.01")
    assert (extra.model, extra.engine, extra.roles) == (
        "coder",
        "scripted",
        ("prefill", "decode", "decode"),
    )
    assert extra.engine_args == ("--token-delay", "0.01")
    assert extra_model("coder mocker").roles == ("agg",)
    for bad, message in [
        ("coder", "NAME ENGINE"),
        ("coder nope", "NAME ENGINE"),
        ("coder scripted prefill=1", "both prefill"),
        ("coder scripted gpu=1", "ROLE=N"),
        ("coder scripted --bogus 1", "not an option of the scripted engine"),
    ]:
        with pytest.raises(ValueError, match=message):
            extra_model(bad)


@pytest.mark.slow
async def test_a_launch_of_two_models_routes_each_to_its_own_workers(tmp_path: Path) -> None:
    script = tmp_path / "coder.jsonl"
    script.write_text(json.dumps({"default": True, "text": "CODER ANSWER"}) + "\n")
    args = (
        "--agg",
        "1",
        "--lease-ttl",
        "2",
        "--restart-backoff",
        "4",  # a stopped worker stays down 2-4 s: long enough to look
        "--extra-model",
        f"coder scripted agg=1 --script {script} --token-delay 0",
    )
    async with (
        launch(tmp_path, *args) as cluster,
        httpx.AsyncClient(base_url=cluster.url, timeout=30) as c,
    ):

        async def ask(model: str) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            return await c.post("/v1/chat/completions", json={**body, "max_tokens": 8})

        async def listed() -> list[str]:
            return [m["id"] for m in (await c.get("/v1/models")).json()["data"]]

        with trio.fail_after(30):
            while "coder" not in await listed():
                await trio.sleep(0.1)
        assert await listed() == [MODEL, "coder"]
        for _ in range(4):  # each model's answers come from its own engine only
            coder, mocker = await ask("coder"), await ask(MODEL)
            assert coder.status_code == mocker.status_code == 200, (coder.text, mocker.text)
            assert coder.json()["choices"][0]["message"]["content"] == "CODER ANSWER"
            assert "CODER" not in (mocker.json()["choices"][0]["message"]["content"] or "")
        # The coder's worker stops (SIGTERM: it drains and leaves etcd): the model is
        # gone, a 404 like any unknown model, while deepseek-v4 keeps serving.
        pid = cluster.children["coder-agg-0"]
        os.kill(pid, signal.SIGTERM)
        await wait_dead(pid)
        with trio.fail_after(10):
            while "coder" in await listed():
                await trio.sleep(0.05)
        gone = await ask("coder")
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["code"] == "model_not_found"
        assert (await ask(MODEL)).status_code == 200
        # The launcher restarts it: served again, no frontend restart.
        with trio.fail_after(30):
            while "coder" not in await listed():
                await trio.sleep(0.1)
        back = await ask("coder")
        assert back.status_code == 200, back.text
        assert back.json()["choices"][0]["message"]["content"] == "CODER ANSWER"
        assert cluster.restarted("frontend") is None
