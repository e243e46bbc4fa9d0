"""GET /debug/heap (headwater/instrumentation/heap.py): off without tracemalloc, and with
it, a mark then the allocation sites that grew, the growth found where it was made."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from headwater.instrumentation.heap import heap_report

REPO = Path(__file__).resolve().parent.parent


def test_without_tracemalloc_it_says_how_to_turn_it_on() -> None:
    report = heap_report()
    assert report["tracing"] is False
    assert "PYTHONTRACEMALLOC" in report["how"]


@pytest.mark.slow  # a subprocess
def test_what_grew_since_the_mark_is_found_where_it_was_made() -> None:
    # In a fresh interpreter, tracing from after the imports: what they allocate would
    # only make the snapshots slower (PYTHONTRACEMALLOC traces them too, ~30 s here).
    code = textwrap.dedent("""
        import json, tracemalloc
        from headwater.instrumentation.heap import heap_report
        tracemalloc.start(5)
        kept = []
        def keep():  # the "leak": 2,000 objects of ~1 KiB held
            kept.extend(bytes(1024) + str(i).encode() for i in range(2000))
        assert heap_report(mark=True)["marked"]
        keep()
        print(json.dumps(heap_report(trim=True)))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["tracing"] is True
    assert report["since_mark_bytes"] > 2000 * 1024
    top = report["grew"][0]
    assert top["size_diff"] > 2000 * 1024
    assert top["count_diff"] >= 2000
    assert any("<string>:7" in frame for frame in top["where"]), top["where"]
    assert report["rss_bytes_after_trim"] > 0
