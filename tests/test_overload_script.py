"""scripts/overload.py, in small: a real ``headwater serve`` at 10x a tiny --max-inflight.

Policy: one server process on loopback port 0 (HF tokenizer backend: about 1 s to load),
40 clients for 2 s; the script bounds every request and the stop itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.overload import run_overload


@pytest.mark.slow
async def test_overload_answers_cleanly_and_the_server_drains(tmp_path: Path) -> None:
    report = await run_overload(
        max_inflight=4,
        factor=10,
        duration=2.0,
        serve_args=("--tokenizer-backend", "hf"),
        log_dir=tmp_path,
    )
    assert report["clients"] == 40
    assert set(report["answers"]) <= {"200", "429", "503"}, report["answers"]
    assert report["answers"].get("429", 0) > 0
    assert report["ok_whole"] == report["answers"]["200"]
    assert report["ok_broken"] == 0
    assert report["server_rejected"]["max_inflight"] == report["answers"]["429"]
    assert report["health_after_load"] == 200
    assert report["server_exit_status"] == 0
    assert report["server_error_lines"] == []
