"""The trace benchmark's chart (scripts/plot_kv_trace.py): medians over rounds, a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.plot_kv_trace import medians, plot


def test_each_setup_is_the_median_of_its_rounds(tmp_path: Path) -> None:
    runs = tmp_path / "runs.jsonl"
    rows = [
        {"label": "a kv", "cached_share": s, "ttft_p50": t, "ttft_p90": 2 * t}
        for s, t in ((0.1, 0.3), (0.2, 0.1), (0.3, 0.2))
    ] + [{"label": "a rr", "cached_share": 0.05, "ttft_p50": 0.4, "ttft_p90": 0.5}]
    runs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = medians([runs])
    assert list(got) == ["a kv", "a rr"]
    assert got["a kv"] == {"cached_share": 0.2, "ttft_p50": 0.2, "ttft_p90": 0.4}
    out = plot(tmp_path / "chart.png", [runs])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
