"""The measurement scripts stay runnable: each run at its smallest (docs/performance.md
and docs/observability.md cite their figures), on loopback, bounded in time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_instrumentation_on_off_script_measures_both_sides() -> None:
    out = subprocess.run(
        ["bash", "scripts/bench_instrument_on_off.sh", "1", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["label"] for r in runs] == [
        "instrument on round 1",
        "instrument --no-instrument round 1",
    ]
    for run in runs:
        assert (run["ok"], run["failed"]) == (20, 0)
        (proc,) = run["procs"]  # the one frontend process's CPU
        assert proc["cpu_s"] > 0


def test_the_kv_trace_bench_script_parses() -> None:
    # Its runs take minutes (make bench-kv); here, that bash reads it whole.
    subprocess.run(["bash", "-n", "scripts/bench_kv_trace.sh"], cwd=REPO, check=True, timeout=30)
