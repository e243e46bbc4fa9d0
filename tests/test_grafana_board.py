"""deploy/grafana/headwater.json: every query names a metric (and a label) that a
frontend or a worker really exports, so the board cannot drift from the code silently."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import trio

from workers.engines.mocker import MockerConfig
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker
from workers.metrics_endpoint import serve_worker_metrics

from frontend_fixture import serve_frontend

BOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "headwater.json"
METRIC = re.compile(r"\b(headwater_[a-z_]+)")
BY = re.compile(r"by \(([a-z_, ]+)\)")
SUFFIXES = ("_bucket", "_count", "_sum")
#: Labels Prometheus puts on every scraped series itself (the target's).
TARGET_LABELS = {"instance", "job"}


def exported(text: str) -> dict[str, set[str]]:
    """Metric families from ``# TYPE`` lines (declared even before a labelled series
    exists) with the labels their samples carry."""
    families: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.setdefault(line.split()[2], set())
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, labels = line.split("{", 1)
        family = next((f for f in families if name == f or name.startswith(f + "_")), None)
        if family is not None:
            families[family] |= {pair.split("=")[0] for pair in labels.split("}")[0].split(",")}
    return families


def test_the_board_is_grafana_json_with_its_variables() -> None:
    board = json.loads(BOARD.read_text())
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "job"}
    assert len(board["panels"]) >= 20
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert '{job=~"$job"}' in target["expr"], target["expr"]


async def test_every_query_names_a_metric_and_label_the_frontend_exports(
    nursery: trio.Nursery,
) -> None:
    board = json.loads(BOARD.read_text())
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as client:
        body = {
            "model": "deepseek-v4",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        with trio.fail_after(10):
            families = exported((await client.get("/metrics")).text)
    worker: RunningWorker = await nursery.start(
        serve_worker, WorkerConfig(engine_config=MockerConfig(speedup_ratio=1000.0))
    )
    port: int = await nursery.start(serve_worker_metrics, 0, worker)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        with trio.fail_after(10):
            families |= exported((await client.get("/metrics")).text)
    queried = {n for p in board["panels"] for t in p["targets"] for n in METRIC.findall(t["expr"])}
    assert any(n.startswith("headwater_worker_kv_blocks") for n in queried)  # KV usage
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in METRIC.findall(expr):
                family = name
                for suffix in ("_total", *SUFFIXES):
                    if family not in families and family.endswith(suffix):
                        family = family.removesuffix(suffix)
                assert family in families or name in families, f"{name} in {panel['title']!r}"
            # The labels grouped by are on the metric's samples (a family with no
            # sample yet, as worker state transitions before the first, says none).
            named = {n.removesuffix("_total") for n in METRIC.findall(expr)}
            named |= {n.removesuffix(s) for n in named for s in SUFFIXES}
            labels = set().union(*(families.get(n, set()) for n in named))
            for group in BY.findall(expr):
                for label in (x.strip() for x in group.split(",")):
                    if label != "le" and label not in TARGET_LABELS and labels:
                        assert label in labels, f"label {label} in {panel['title']!r}"
