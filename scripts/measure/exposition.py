"""What rendering ``/metrics`` costs the event loop: prometheus-client vs TextExposition.

The frontend's registry (request metrics and loop metrics) is filled as traffic would
fill it (every request status, two workers in every state, latency observations), then
rendered by ``generate_latest``, by :class:`TextExposition`, and collected without
formatting (the part both share), in alternating rounds. Prints a JSON record per
round, then the medians over the rounds and the median of each round's
``generate_latest`` ÷ ``TextExposition``: on a shared machine rounds spread by up to 2×
(other load), and the ratio within a round is steadier than either figure. The two
renderings are checked to be identical first.

Usage: ``.venv/bin/python scripts/measure/exposition.py [--renders N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from prometheus_client import generate_latest

from frontend.metrics import FrontendMetrics
from headwater.instrumentation import FRONTEND_PREFIX, LoopMetrics
from headwater.instrumentation.exposition import TextExposition


def filled_metrics() -> FrontendMetrics:
    m = FrontendMetrics()
    LoopMetrics(m.registry, FRONTEND_PREFIX)
    for endpoint in ("chat", "completions"):
        for kind in ("unary", "stream"):
            for status in ("success", "rejected", "error", "cancelled"):
                m.requests_total.labels(endpoint, kind, status, "deepseek-v4").inc()
    for w in ("prefill-0", "decode-0"):
        for state in ("healthy", "inhibited", "draining"):
            m.worker_state.labels(w, w.split("-")[0], state).set(state == "healthy")
        m.worker_inflight.labels(w, w.split("-")[0]).set(3)
    for i in range(1000):
        m.time_to_first_token_seconds.observe(i / 1000)
        m.inter_token_latency_seconds.observe(i / 50000)
        m.request_duration_seconds.labels("deepseek-v4").observe(i / 500)
    return m


def per_call_ms(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--renders", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    m = filled_metrics()
    exposition = TextExposition(m.registry)
    text = generate_latest(m.registry)
    assert exposition.render() == text, "TextExposition differs from generate_latest"
    lines = text.count(b"\n")
    contenders: dict[str, Callable[[], object]] = {
        "generate_latest_ms": lambda: generate_latest(m.registry),
        "text_exposition_ms": exposition.render,
        "collect_only_ms": lambda: [list(f.samples) for f in m.registry.collect()],
    }
    figures: dict[str, list[float]] = {name: [] for name in contenders}
    ratios = []
    for r in range(args.rounds):
        record: dict[str, object] = {"round": r, "lines": lines}
        for name, fn in contenders.items():
            record[name] = ms = round(per_call_ms(fn, args.renders), 3)
            figures[name].append(ms)
        ratios.append(figures["generate_latest_ms"][-1] / figures["text_exposition_ms"][-1])
        print(json.dumps(record))
    print(
        json.dumps(
            {
                "median_of_rounds": args.rounds,
                "lines": lines,
                **{name: round(statistics.median(ms), 3) for name, ms in figures.items()},
                "generate_latest_over_text_exposition": round(statistics.median(ratios), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
