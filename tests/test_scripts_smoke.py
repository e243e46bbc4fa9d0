"""The measurement scripts stay runnable: each run at its smallest (the docs cite their
figures, with the commands that made them), on loopback, bounded in time. Each check
reads a figure the script prints, so a script that runs but measures nothing fails."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from headwater.cluster.recipes import start_frontend, wait_healthy

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


def _measure(name: str, *args: str, limit_s: float = 180) -> str:
    """``python -m scripts.measure.<name> ARGS``'s output; it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-m", f"scripts.measure.{name}", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=limit_s,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in {text[-800:]!r}"
    return float(found[1].replace(",", ""))


#: Each script at its smallest, and what its output must show: (name, args, a check).
SMALLEST: list[tuple[str, list[str], Callable[[str], object]]] = [
    (
        "answer_parse",
        ["--rounds", "1", "--reasoning-tokens", "50"],
        # A difference of two timings: at one round its sign is the machine's noise.
        lambda out: math.isfinite(_number(r"the parse stage adds (-?[\d.]+) ms", out)),
    ),
    (
        "asyncio_hop",
        ["--streams", "2", "--items", "20", "--gap", "0.001", "--rounds", "2"],
        lambda out: _number(r"stream +median +([\d.]+) µs", out) > 0,
    ),
    (
        "cancel",
        ["--requests", "3"],
        lambda out: _number(r"3 disconnects: p50 ([\d.]+) ms", out) > 0,
    ),
    (
        "exposition",
        ["--renders", "5", "--rounds", "1"],
        lambda out: _json_lines(out)[-1]["lines"] > 100,
    ),
    (
        "frame_mac",
        ["--repeat", "100"],
        lambda out: json.loads(out[out.index("{") :])["ack"]["tag_cost_us"] > 0,
    ),
    (
        "idle_cpu",
        ["--rounds", "1", "--settle", "1", "--window", "1"],
        lambda out: _json_lines(out)[-1]["median_cpu_pct_of_a_core"] >= 0,
    ),
    (
        "instrument_overhead",
        ["--steps", "500", "--tasks", "5", "--reps", "3"],
        lambda out: _number(r"StallDetector \(\+watchdog\) +([\d.]+)", out) > 0,
    ),
    (
        "kv_receive",
        ["--pieces", "5"],
        lambda out: json.loads(out[out.index("{") :])["us_per_piece"]["payload_buffer"] > 0,
    ),
    ("parse", ["--runs", "20"], lambda out: _number(r"short chat .* decode +([\d.]+) us", out) > 0),
    (
        "plane",
        ["--requests", "30", "--warmup", "5", "--concurrency", "4"],
        lambda out: json.loads(out[out.index("{") :])["tcp"]["req_per_s_c4"] > 0,
    ),
    (
        "startup",
        ["--rounds", "1", "--no-cold", "--processes", "1", "--json"],
        lambda out: (
            _json_lines(out)[-1]["headwater --processes 1"]["warm"]["healthy_s"]["median"] > 0
        ),
    ),
    (
        "tokenizer",
        ["--quick"],
        lambda out: {r["figure"] for r in _json_lines(out)} >= {"coalesce", "loop_lag"},
    ),
    (
        "virtual_time",
        ["--rounds", "1"],
        lambda out: _number(r"a server's start and stop: median ([\d.]+) ms", out) > 0,
    ),
    (
        "worker_heap",
        ["--warmup", "20", "--steps", "2", "--step", "20", "--quiet", "0.2", "--top", "3"],
        lambda out: "(0 request errors)" in out,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args", "check"), SMALLEST, ids=[s[0] for s in SMALLEST])
def test_each_measurement_runs_at_its_smallest(
    name: str, args: list[str], check: Callable[[str], object]
) -> None:
    out = _measure(name, *args)
    assert check(out) is not False, out[-1500:]


@pytest.mark.slow
async def test_the_steady_state_measurement_runs_against_a_server(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        server = await start_frontend(nursery, log_dir=tmp_path, extra_args=["--mode", "agg"])
        await wait_healthy(server.address, child=server)
        out = await trio.to_thread.run_sync(
            lambda: _measure(
                "steady",
                *("--url", server.address, "--pid", str(server.pid), "--runs", "1"),
                *("--requests", "8", "--concurrency", "2", "--scenario", "short"),
            )
        )
        await server.stop()
    (run,) = [r for r in _json_lines(out) if "run" in r]
    assert run["ok"] == 8
    assert run["req_per_s"] > 0


def test_every_measurement_has_a_smoke_test() -> None:
    scripts = {p.stem for p in (REPO / "scripts" / "measure").glob("*.py")} - {"__init__"}
    # steady needs a server (below), vllm_client_cost a vLLM (its options: below).
    assert scripts == {name for name, _, _ in SMALLEST} | {"steady", "vllm_client_cost"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["ab_checkouts", "bench_vllm", "gpu_vllm", "measure.vllm_client_cost"]
)
def test_the_scripts_that_need_more_than_this_machine_still_parse_their_options(
    name: str,
) -> None:
    """Two checkouts side by side, vLLM's server against headwater, a GPU: their runs
    are the docs' (docs/performance.md, docs/performance-vllm.md); here, each imports and
    reads its options."""
    out = subprocess.run(
        [sys.executable, "-m", f"scripts.{name}", "--help"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:")


def test_the_vllm_client_cost_reads_each_thread_of_a_py_spy_profile(tmp_path: Path) -> None:
    from scripts.measure.vllm_client_cost import read_samples

    serve = (
        "_serve (workers/engines/vllm/asyncio_thread.py:107);run_forever (asyncio/base_events.py:1)"
    )
    loop = "run (trio/_core/_run.py:1);handle (frontend/http/app.py:1)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        f"{serve};select (selectors.py:1);EpollSelector.select (selectors.py:2) 5\n"
        f"{serve};send (zmq/sugar/socket.py:1) 3\n"
        f"{serve};process_outputs (vllm/v1/engine/output_processor.py:1) 2\n"
        f"{loop};run (workers/engines/vllm/asyncio_thread.py:40) 4\n"
        f"{loop} 7\n"
        "_bootstrap (threading.py:1);encode (frontend/preprocess/pool.py:1) 6\n"
    )
    samples = read_samples(raw)
    assert samples["asyncio thread (vLLM's client)"] == {
        "idle (waiting in select)": 5,
        "zmq sockets": 3,
        "vLLM output processing": 2,
    }
    assert samples["trio loop"] == {"hop to the asyncio thread": 4, "other": 7}
    assert samples["other threads"] == {"all": 6}


def test_ab_checkouts_serves_one_process_whatever_the_checkouts_age(tmp_path: Path) -> None:
    """Its CPU figure is one pid's: each side must serve one process, not a group,
    whether ``--processes`` is a literal of the checkout's serve or generated from its
    config's field (as now); a checkout from before the option gets none."""
    from scripts.ab_checkouts import serve_command

    old = tmp_path / "old"
    (old / "headwater" / "cli").mkdir(parents=True)
    (old / "headwater" / "cli" / "serve.py").write_text('p.add_argument("--processes")\n')
    older = tmp_path / "older"
    older.mkdir()
    assert "--processes=1" in serve_command(REPO, 8000)
    assert "--processes=1" in serve_command(old, 8000)
    assert "--processes=1" not in serve_command(older, 8000)
