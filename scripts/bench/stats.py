"""Summarise a :class:`~scripts.bench.loadgen.LoadResult`: throughput, latency percentiles.

Conventions, chosen so figures compare with other tools and with Dynamo's bench.py:
percentiles interpolate linearly between order statistics (numpy's default); latencies
are reported in milliseconds; throughput counts successful requests over the run's wall
time; ITL pools the gaps of every successful streaming request; cut-off requests (still
running at the time limit) are counted apart from failures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scripts.bench.loadgen import LoadResult


def percentile(values: Iterable[float], p: float) -> float | None:
    """The *p*-th percentile (0-100) with linear interpolation; ``None`` for no values.

    Raises :class:`ValueError` if *p* is outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True, slots=True)
class Summary:
    """The headline figures of one run; times in ms, rates per second, CPU in seconds."""

    label: str
    stream: bool
    concurrency: int
    requests: int  # finished or cut off
    ok: int
    failed: int
    cut_off: int
    wall_s: float
    req_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    prompt_tokens_mean: float | None
    completion_tokens_mean: float | None
    client_cpu_s: float
    client_cpu_pct: float  # of one core over the wall time
    first_error: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarise(result: LoadResult, label: str = "") -> Summary:
    """Reduce *result* to a :class:`Summary` (pure; no I/O)."""
    ok = result.ok
    failed = [r for r in result.records if not r.ok and not r.cut_off]
    wall = result.wall_s
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    completion = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    mean_prompt, mean_completion = _mean(prompt), _mean(completion)
    return Summary(
        label=label,
        stream=result.stream,
        concurrency=result.concurrency,
        requests=len(result.records),
        ok=len(ok),
        failed=len(failed),
        cut_off=sum(r.cut_off for r in result.records),
        wall_s=round(wall, 3),
        req_per_s=round(len(ok) / wall, 2) if wall > 0 else 0.0,
        output_tokens_per_s=round(sum(completion) / wall, 1) if wall > 0 else 0.0,
        ttft_p50_ms=_ms(percentile(ttft, 50)),
        ttft_p99_ms=_ms(percentile(ttft, 99)),
        itl_p50_ms=_ms(percentile(itl, 50)),
        itl_p99_ms=_ms(percentile(itl, 99)),
        e2e_p50_ms=_ms(percentile(e2e, 50)),
        e2e_p99_ms=_ms(percentile(e2e, 99)),
        prompt_tokens_mean=None if mean_prompt is None else round(mean_prompt, 1),
        completion_tokens_mean=None if mean_completion is None else round(mean_completion, 2),
        client_cpu_s=round(result.client.cpu_s, 3),
        client_cpu_pct=round(100 * result.client.cpu_s / wall, 1) if wall > 0 else 0.0,
        first_error=failed[0].error if failed else None,
    )


_COLUMNS = (
    "run",
    "mode",
    "conc",
    "ok/req",
    "req/s",
    "out tok/s",
    "TTFT p50/p99 ms",
    "ITL p50/p99 ms",
    "e2e p50/p99 ms",
    "client CPU %",
)


def markdown_header() -> str:
    """The header and separator lines of the table :func:`markdown_row` fills."""
    return "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def markdown_row(s: Summary) -> str:
    """One markdown table row for *s* (columns as in :func:`markdown_header`)."""
    cells = [
        s.label or "-",
        "stream" if s.stream else "unary",
        str(s.concurrency),
        f"{s.ok}/{s.requests}" + (f" ({s.cut_off} cut)" if s.cut_off else ""),
        _fmt(s.req_per_s),
        _fmt(s.output_tokens_per_s),
        f"{_fmt(s.ttft_p50_ms)} / {_fmt(s.ttft_p99_ms)}",
        f"{_fmt(s.itl_p50_ms)} / {_fmt(s.itl_p99_ms)}",
        f"{_fmt(s.e2e_p50_ms)} / {_fmt(s.e2e_p99_ms)}",
        _fmt(s.client_cpu_pct),
    ]
    return "| " + " | ".join(cells) + " |"
