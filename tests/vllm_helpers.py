"""Helpers of the vLLM tests: vLLM's own API as the reference, and headwater's plane."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import trio

from headwater.plane.base import WorkerClient, WorkerInstance
from headwater.plane.client import TcpWorkerClient, connect_worker
from headwater.plane.connection import PlaneConfig
from headwater.wire import Chunk, GenerateRequest, KvHandle, SamplingParams

from vllm_fixture import MODEL_NAME, PATIENCE


@dataclass(frozen=True)
class Reference:
    """vLLM's own answer to a token-in request."""

    token_ids: list[int]
    finish_reason: str
    cached_tokens: int | None


async def vllm_generate(
    url: str, token_ids: Sequence[int], sampling: dict[str, Any], *, rid: str = ""
) -> Reference:
    """``POST /inference/v1/generate`` on vLLM itself (unary)."""
    body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": sampling}
    if rid:
        body["request_id"] = rid
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(url + "/inference/v1/generate", json=body)
    r.raise_for_status()
    answer = r.json()
    choice = answer["choices"][0]
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return Reference(choice["token_ids"], choice["finish_reason"], details.get("cached_tokens"))


Metrics = list[tuple[str, dict[str, str], float]]


async def vllm_metrics(url: str) -> Metrics:
    """vLLM's /metrics as (series name, labels, value) entries. Generous: on two shared
    cores an engine restarted by the test before may keep its API server busy a while."""
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.get(url + "/metrics")
    r.raise_for_status()
    entries: Metrics = []
    for line in r.text.splitlines():
        if line.startswith("vllm:"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            entries.append((name, dict(_LABEL.findall(labels)), float(value)))
    return entries


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def metric(values: Metrics, name: str, **labels: str) -> float:
    """The sum of the series *name* whose labels include *labels*."""
    return sum(
        v
        for n, have, v in values
        if n == name and all(have.get(k) == want for k, want in labels.items())
    )


def request(
    rid: str,
    token_ids: Sequence[int],
    max_tokens: int,
    *,
    handle: KvHandle | None = None,
    eos: tuple[int, ...] = (),
    **sampling: Any,
) -> GenerateRequest:
    """A greedy request unless *sampling* says otherwise."""
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling})
    return GenerateRequest(rid, MODEL_NAME, list(token_ids), params, handle, eos)


async def connect(instance: WorkerInstance, nursery: trio.Nursery) -> TcpWorkerClient:
    """A plane client of a vLLM test worker, patient as the workers are (PATIENCE)."""
    config = PlaneConfig(ack_timeout=PATIENCE, heartbeat_timeout=PATIENCE)
    return await connect_worker(instance, nursery, config=config)


async def generate(client: WorkerClient, req: GenerateRequest) -> list[Chunk]:
    """Every chunk of *req* on *client*'s worker."""
    async with client.stream(req) as replies:
        return [chunk async for chunk in replies]


def tokens(chunks: Sequence[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def prompt(n: int, salt: int = 0) -> list[int]:
    """*n* ordinary token ids (deterministic, varied, below DeepSeek-V4's specials)."""
    return [3 + (i * 7919 + salt * 104729) % 120000 for i in range(n)]


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body (without [DONE])."""
    events = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(orjson.loads(line[6:]))
    return events
