"""Replay Mooncake's conversation trace against an OpenAI-compatible server (loopback only).

The trace (FAST '25, Apache 2.0: scripts/data/README.md; docs/routing.md, "The trace
benchmark") gives each
request's arrival time, prompt and answer lengths, and its prompt as a chain of 512-token
blocks (``hash_ids``): two requests sharing a leading run of ids share that much prefix.
This turns each request into token ids block by block (a block id always gives the same
tokens, drawn from a generator seeded with it), keeps the arrivals (divided by
``--time-scale``), scales the blocks to ``--block-tokens`` tokens, and sends each as a
streamed ``/v1/completions`` request of token ids with ``ignore_eos`` and its scaled
answer length, open loop: a request leaves at its arrival time whatever is in flight.

It reports, as one JSON object: requests, failures, TTFT and end-to-end percentiles, and
the share of prompt tokens the server reported cached
(``usage.prompt_tokens_details.cached_tokens``), which is what routing by cache changes.

Why asyncio and aiohttp here, in a project of trio: this is a load client in a process
of its own, as the benchmark's (scripts/bench/_client.py), and aiohttp is the cheapest
client per request on this machine (docs/performance.md, "Method").

    python -m scripts.trace_replay --url http://127.0.0.1:8000 --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from scripts.bench.loadgen import check_loopback

#: The trace, in the repository (scripts/data/README.md: its source and licence).
TRACE = Path(__file__).with_name("data") / "mooncake-conversation.jsonl.gz"
TRACE_BLOCK = 512  # tokens per block of the trace's hash_ids


@dataclass(frozen=True, slots=True)
class Replayed:
    """One request of the trace, ready to send."""

    at: float  # seconds from the replay's start
    prompt: list[int]
    max_tokens: int


def load(
    path: Path,
    *,
    skip: int,
    requests: int,
    time_scale: float,
    block_tokens: int,
    max_prompt_blocks: int,
    max_tokens: int,
    vocab: tuple[int, int],
) -> list[Replayed]:
    """The trace's requests *skip* .. *skip* + *requests*, scaled (see the module
    docstring); a prompt keeps its first *max_prompt_blocks* blocks."""
    rows = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        for i, line in enumerate(f):
            if i >= skip + requests:
                break
            if i >= skip:
                rows.append(json.loads(line))
    start = rows[0]["timestamp"]
    blocks: dict[int, list[int]] = {}
    out = []
    for row in rows:
        ids: list[int] = []
        for h in row["hash_ids"][:max_prompt_blocks]:
            block = blocks.get(h)
            if block is None:
                rng = random.Random(h)
                block = blocks[h] = [rng.randrange(*vocab) for _ in range(block_tokens)]
            ids += block
        length = math.ceil(row["input_length"] * block_tokens / TRACE_BLOCK)
        ids = ids[: max(1, length)]
        answer = max(
            1, min(max_tokens, math.ceil(row["output_length"] * block_tokens / TRACE_BLOCK))
        )
        out.append(Replayed((row["timestamp"] - start) / 1000 / time_scale, ids, answer))
    return out


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, req: Replayed, t0: float
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    first: float | None = None
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "status": resp.status, "error": (await resp.text())[:200]}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if first is None and event.get("choices"):
                    first = time.monotonic()
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"ok": False, "status": 0, "error": repr(exc)[:200]}
    done = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ok": first is not None,
        "ttft": (first or done) - sent,
        "latency": done - sent,
        "prompt_tokens": usage.get("prompt_tokens", len(req.prompt)),
        "cached_tokens": details.get("cached_tokens") or 0,
        "lag": sent - (t0 + req.at),  # how late the client sent it (its own health)
    }


async def replay(
    url: str, model: str, requests: list[Replayed], per_request: float
) -> dict[str, Any]:
    """Send *requests* at their times; the summary (see the module docstring)."""
    limits = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=per_request)
    async with aiohttp.ClientSession(connector=limits, timeout=client_timeout) as session:
        t0 = time.monotonic() + 0.5
        records = await asyncio.gather(*(_one(session, url, model, r, t0) for r in requests))
        wall = time.monotonic() - t0
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]

    def pct(key: str, q: float) -> float | None:
        values = sorted(r[key] for r in ok)
        return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None

    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(records),
        "failed": len(failed),
        "failures": [f"{r['status']}: {r['error']}" for r in failed[:3]],
        "wall_s": round(wall, 2),
        "ttft_p50": pct("ttft", 0.5),
        "ttft_p90": pct("ttft", 0.9),
        "ttft_p99": pct("ttft", 0.99),
        "latency_p50": pct("latency", 0.5),
        "latency_p90": pct("latency", 0.9),
        "prompt_tokens": prompt,
        "cached_share": round(sum(r["cached_tokens"] for r in ok) / prompt, 4) if prompt else None,
        "client_lag_p99": pct("lag", 0.99),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="deepseek-v4")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    p.add_argument("--requests", type=int, default=400, help="trace rows to replay")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="arrivals come this many times faster"
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=64,
        help="tokens per trace block (the trace's are 512: lengths scale by this / 512)",
    )
    p.add_argument("--max-prompt-blocks", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="cap on an answer's tokens")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--label", default="", help="a name for this run, echoed in the JSON")
    args = p.parse_args(argv)
    check_loopback(args.url)
    requests = load(
        args.trace,
        skip=args.skip,
        requests=args.requests,
        time_scale=args.time_scale,
        block_tokens=args.block_tokens,
        max_prompt_blocks=args.max_prompt_blocks,
        max_tokens=args.max_tokens,
        vocab=(1000, 100_000),
    )
    summary = asyncio.run(replay(args.url, args.model, requests, args.timeout))
    print(json.dumps({"label": args.label, **summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
