"""The soak's verdict, from what was measured: pure functions, no I/O.

Each process is read a few times while idle after the warm-up (``idle_start``) and a few
times while idle after the load (``idle_end``), every read on a quiet process: no request
in flight, the load client's connections closed, the settle time past trio's idle
thread timeout (10 s) and the server's keep-alive timeout (5 s).

- **Memory**: the median RSS of the end reads against the median of the start reads;
  more than :attr:`Limits.rss_growth` (5%) up fails. Idle points, not the loaded part:
  under load RSS follows what is in flight at that instant (a few 40k-token bodies,
  their token arrays and KV bookkeeping), so its trend mixes load with leaks; idle, only
  what was kept is left. The trend over the loaded part (a least-squares line) is
  reported beside it, not judged.
- **Descriptors, tasks, threads**: a leak is what is there in *every* end read and was
  in *no* start read: ``min(end) - max(start) > 0``. That forgives constant jitter (a
  heartbeat's or a probe's short-lived task caught in one read and not the next) and
  nothing else: a leaked task or socket is in every read after it leaked.
- **Requests**: any ``lost`` or ``wrong`` outcome fails (:mod:`scripts.soak.client`).
- **End state**: the checks of :func:`judge_end_state` (nothing in flight, no KV held,
  every process the one that started, a clean exit on SIGTERM).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scripts.soak.client import FAILING, Outcome

#: The counts judged for leaks, by the name of their sample field.
COUNTED = ("fds", "tasks", "threads")


@dataclass(frozen=True, slots=True)
class Limits:
    #: Largest allowed rise of idle RSS after the warm-up (0.05: 5%).
    rss_growth: float = 0.05


@dataclass(frozen=True, slots=True)
class Check:
    """One judged figure: what, of which process, whether it passed, and the figures."""

    name: str
    passed: bool
    detail: str
    process: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "process": self.process,
            "passed": self.passed,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Sample:
    """One read of one process. ``None`` fields could not be read (gone, no endpoint)."""

    t_s: float
    phase: str
    process: str
    rss_bytes: int | None = None
    pss_bytes: int | None = None
    uss_bytes: int | None = None
    fds: int | None = None
    threads: int | None = None
    tasks: int | None = None
    tasks_by_name: Mapping[str, int] | None = field(default=None, compare=False)
    #: What the frontend's bounded tokenizer cache holds (fastokens' segment cache,
    #: ``--tokenizer-cache-mb``): growth up to its budget is not a leak.
    cache_bytes: int | None = None
    error: str | None = None

    def to_dict(self, *, names: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "t_s": round(self.t_s, 3),
            "phase": self.phase,
            "process": self.process,
            "rss_bytes": self.rss_bytes,
            "pss_bytes": self.pss_bytes,
            "uss_bytes": self.uss_bytes,
            "fds": self.fds,
            "threads": self.threads,
            "tasks": self.tasks,
            "cache_bytes": self.cache_bytes,
        }
        if self.error:
            d["error"] = self.error
        if names and self.tasks_by_name is not None:
            d["tasks_by_name"] = dict(self.tasks_by_name)
        return d


def values(samples: Iterable[Sample], phase: str, name: str) -> list[int] | None:
    """The *name* field of every sample in *phase*; None if there are none or any is
    missing (a figure that could not be read is not a figure that did not grow)."""
    found = [getattr(s, name) for s in samples if s.phase == phase]
    if not found or any(v is None for v in found):
        return None
    return [int(v) for v in found]


def growth(start: Sequence[int], end: Sequence[int]) -> float:
    """Relative rise of the median of *end* over the median of *start* (0.1: 10%)."""
    base = statistics.median(start)
    if base <= 0:
        raise ValueError("a start value must be positive")
    return (statistics.median(end) - base) / base


def leaked(start: Sequence[int], end: Sequence[int]) -> int:
    """What every end read holds beyond every start read: ``min(end) - max(start)``,
    or 0 if that is not positive."""
    return max(0, min(end) - max(start))


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t, v)`` points (v per unit of t); None for fewer than
    two distinct times."""
    if len(points) < 2:
        return None
    ts = [t for t, _ in points]
    mean_t = statistics.fmean(ts)
    mean_v = statistics.fmean(v for _, v in points)
    den = sum((t - mean_t) ** 2 for t in ts)
    if den == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / den


def loaded_trend(samples: Sequence[Sample], phase: str = "load") -> float | None:
    """The RSS trend over *phase* as a share of its fitted start: the fitted line's
    rise from the first sample to the last, over its value at the first (reported, not
    judged)."""
    points = [
        (s.t_s, float(s.rss_bytes)) for s in samples if s.phase == phase and s.rss_bytes is not None
    ]
    k = slope(points)
    if k is None:
        return None
    t0, t1 = points[0][0], points[-1][0]
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    at_t0 = mean_v + k * (t0 - mean_t)
    return k * (t1 - t0) / at_t0 if at_t0 > 0 else None


def name_leaks(samples: Sequence[Sample]) -> dict[str, int]:
    """Task names whose count grew by the :func:`leaked` rule (for the report)."""
    start = [s.tasks_by_name for s in samples if s.phase == "idle_start"]
    end = [s.tasks_by_name for s in samples if s.phase == "idle_end"]
    if not start or not end or any(m is None for m in (*start, *end)):
        return {}
    names = {n for m in (*start, *end) if m is not None for n in m}
    out = {}
    for n in sorted(names):
        grew = leaked([(m or {}).get(n, 0) for m in start], [(m or {}).get(n, 0) for m in end])
        if grew:
            out[n] = grew
    return out


def judge_process(
    process: str, samples: Sequence[Sample], *, has_tasks: bool, limits: Limits
) -> list[Check]:
    """Memory and leak checks of one process from its idle reads."""
    checks: list[Check] = []
    start = values(samples, "idle_start", "rss_bytes")
    end = values(samples, "idle_end", "rss_bytes")
    if start is None or end is None:
        checks.append(Check("rss", False, "idle RSS could not be read", process))
    else:
        text = (
            f"idle RSS {statistics.median(start) / 2**20:.1f} → "
            f"{statistics.median(end) / 2**20:.1f} MiB"
        )
        cache_start = values(samples, "idle_start", "cache_bytes")
        cache_end = values(samples, "idle_end", "cache_bytes")
        if cache_start is not None and cache_end is not None:
            # What the bounded cache holds is left out on both ends.
            start = [r - c for r, c in zip(start, cache_start, strict=True)]
            end = [r - c for r, c in zip(end, cache_end, strict=True)]
            text += (
                f", of which the tokenizer cache {statistics.median(cache_start) / 2**20:.1f}"
                f" → {statistics.median(cache_end) / 2**20:.1f} MiB; without it"
            )
        g = growth(start, end)
        checks.append(
            Check(
                "rss",
                g <= limits.rss_growth,
                f"{text} ({g:+.1%}; limit +{limits.rss_growth:.0%})",
                process,
            )
        )
    for name in COUNTED:
        if name == "tasks" and not has_tasks:
            continue
        a, b = values(samples, "idle_start", name), values(samples, "idle_end", name)
        if a is None or b is None:
            checks.append(Check(name, False, f"idle {name} could not be read", process))
            continue
        n = leaked(a, b)
        detail = f"idle {name} {_span(a)} → {_span(b)}"
        if n and name == "tasks":
            detail += f"; grew: {name_leaks(samples)}"
        checks.append(Check(name, n == 0, detail + (f"; {n} leaked" if n else ""), process))
    return checks


def _span(vs: Sequence[int]) -> str:
    lo, hi = min(vs), max(vs)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def judge_requests(counts: Mapping[str, int], lost_examples: Sequence[str] = ()) -> list[Check]:
    """Every request ended in a response, a clean error or the client's own doing."""
    total = sum(counts.values())
    bad = {o: counts.get(o, 0) for o in FAILING}
    failed = sum(bad.values())
    detail = f"{total} requests: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    if failed and lost_examples:
        detail += "; e.g. " + "; ".join(lost_examples[:3])
    checks = [Check("requests", failed == 0 and total > 0, detail)]
    if counts.get(Outcome.OK, 0) == 0:
        checks.append(Check("requests_ok", False, "no request was served"))
    return checks


def judge_end_state(end: Mapping[str, Any]) -> list[Check]:
    """The target's state once idle at the end (see :func:`scripts.soak.run`):
    ``inflight`` (name → requests in flight, each must be 0), ``kv`` (worker → blocks
    used and transfers held, 0 each), ``restarted`` (processes whose pid changed),
    ``health`` (the status of ``/health``) and ``exit_status`` after SIGTERM."""
    checks = []
    busy = {k: v for k, v in end.get("inflight", {}).items() if v != 0}
    checks.append(
        Check("inflight_at_end", not busy, f"requests in flight once idle: {busy or 'none'}")
    )
    held = {k: v for k, v in end.get("kv", {}).items() if any(v.values())}
    if "kv" in end:
        checks.append(
            Check(
                "kv_at_end",
                not held,
                f"KV blocks used / transfers held once idle: {held or 'none'}",
            )
        )
    restarted = list(end.get("restarted", ()))
    checks.append(
        Check(
            "no_restarts",
            not restarted,
            f"processes that died or were replaced: {restarted or 'none'}",
        )
    )
    checks.append(
        Check("health_at_end", end.get("health") == 200, f"/health answered {end.get('health')}")
    )
    status = end.get("exit_status")
    checks.append(Check("clean_exit", status == 0, f"exit status after SIGTERM: {status}"))
    return checks
