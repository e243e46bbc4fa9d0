"""The pure parts of scripts/seed_scenario.py: per-second bins, worker state bands, the
router's transition lines, counter deltas. The scenario itself takes minutes and is not
run here."""

from __future__ import annotations

import math
import os
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from scripts import seed_scenario as seed
from scripts.bench.loadgen import RequestRecord
from scripts.bench.scrape import HEADWATER_PREFIX, Histogram

BOUNDS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, math.inf)


def record(
    start: float, e2e: float, *, status: int | None = 200, ok: bool = True, cut_off: bool = False
) -> RequestRecord:
    return RequestRecord(
        index=0,
        body=0,
        start_s=start,
        e2e_s=e2e,
        ttft_s=None,
        itl_s=(),
        chunks=1,
        prompt_tokens=None,
        completion_tokens=None,
        status=status,
        ok=ok,
        cut_off=cut_off,
        error=None if ok else "failed",
    )


def hist(*observations: float) -> Histogram:
    """A cumulative histogram of *observations* (seconds) over BOUNDS."""
    buckets = tuple((le, float(sum(o <= le for o in observations))) for le in BOUNDS)
    return Histogram(buckets, float(len(observations)), sum(observations))


# --- requests per second --------------------------------------------------------------------


def test_requests_are_binned_by_the_time_they_ended() -> None:
    records = [
        record(0.1, 0.5),  # ends at 0.6: bin 0
        record(0.5, 0.6),  # ends at 1.1: bin 1
        record(0.2, 0.9, status=503, ok=False),  # bin 1
        record(1.5, 0.1, status=None, ok=False),  # no response: bin 1
        record(1.0, 0.5, status=200, ok=False),  # an error inside a 200: bin 1
        record(2.0, 9.0, status=None, ok=False, cut_off=True),  # neither
        record(3.5, 0.2),  # after the duration: a bin of its own
    ]
    bins = seed.bin_requests(records, duration_s=3.0)
    assert [b.t_s for b in bins] == [0.0, 1.0, 2.0, 3.0]
    assert [b.ok for b in bins] == [1, 1, 0, 1]
    assert bins[1].failed == {"200": 1, "503": 1, "none": 1}
    assert bins[0].failed == bins[2].failed == {}


def test_empty_run_still_covers_its_duration() -> None:
    bins = seed.bin_requests([], duration_s=2.5)
    assert [(b.t_s, b.ok, b.failed) for b in bins] == [(0.0, 0, {}), (1.0, 0, {}), (2.0, 0, {})]
    with pytest.raises(ValueError):
        seed.bin_requests([], duration_s=1.0, bin_s=0)


# --- loop delay per second ------------------------------------------------------------------


def test_loop_bins_take_the_histogram_delta_of_each_second() -> None:
    snapshots: list[tuple[float, Histogram | None]] = [
        (-0.3, hist()),  # before the load: the baseline
        (0.25, hist(0.0005)),
        (0.75, hist(0.0005, 0.0005, 0.05)),
        (1.25, None),  # a scrape that failed (the loop was stalled)
        (1.5, None),
        (2.25, hist(0.0005, 0.0005, 0.05, 2.0)),  # the stall's observation comes late
        (2.75, hist(0.0005, 0.0005, 0.05, 2.0, 7.0)),  # above the last finite bucket
    ]
    bins = seed.bin_loop(snapshots, n_bins=4)
    assert [b.t_s for b in bins] == [0.0, 1.0, 2.0, 3.0]
    first, second, third, fourth = bins
    assert first.samples == 3
    assert first.max_ms == pytest.approx(100.0)  # 0.05 s lies in the (0.01, 0.1] bucket
    assert not first.max_above
    assert first.p99_ms is not None
    assert 10.0 < first.p99_ms <= 100.0
    assert (second.samples, second.p99_ms, second.max_ms) == (0, None, None)
    assert third.samples == 2
    assert third.max_ms == pytest.approx(5000.0)
    assert third.max_above
    assert (fourth.samples, fourth.max_ms) == (0, None)


def test_loop_bins_without_any_good_scrape() -> None:
    bins = seed.bin_loop([(0.5, None), (1.5, None)], n_bins=2)
    assert [(b.samples, b.p99_ms) for b in bins] == [(0, None), (0, None)]


# --- worker states over time -----------------------------------------------------------------


def test_state_bands_from_polls_and_logged_transitions() -> None:
    observations = [
        (-5.0, "healthy"),  # joined before the load
        (1.0, "healthy"),  # a poll
        (2.4, "inhibited"),  # a logged transition
        (2.5, "inhibited"),  # the next poll agrees
        (3.3, "probing"),  # a logged transition no poll saw
        (4.1, "healthy"),
        (4.25, "healthy"),
    ]
    bands = seed.state_bands(observations, end_s=6.0)
    assert bands == [
        seed.Band(0.0, 2.4, "healthy"),
        seed.Band(2.4, 3.3, "inhibited"),
        seed.Band(3.3, 4.1, "probing"),
        seed.Band(4.1, 6.0, "healthy"),
    ]
    assert seed.time_in_states(bands) == {
        "healthy": pytest.approx(4.3),
        "inhibited": pytest.approx(0.9),
        "probing": pytest.approx(0.8),
    }


def test_state_is_unknown_until_first_seen_and_equal_neighbours_merge() -> None:
    bands = seed.state_bands([(1.0, "healthy"), (1.0, "healthy"), (7.0, "inhibited")], end_s=5.0)
    # The observation after the end is clamped to it and adds no empty band.
    assert bands == [seed.Band(0.0, 1.0, "unknown"), seed.Band(1.0, 5.0, "healthy")]
    assert seed.state_bands([], end_s=2.0) == [seed.Band(0.0, 2.0, "unknown")]


def test_router_transition_lines_are_parsed_in_local_time() -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_800_000_000))
    lines = [
        f"{stamp},250 WARNING frontend.router.router: worker prefill-1a: healthy -> inhibited "
        "(2 faults in a row, last: no ACK from prefill-1a within 0.5 s)\n",
        f"{stamp},900 INFO frontend.router.router: worker decode-2b: inhibited -> probing "
        "(backoff elapsed: probing)",
        f"{stamp},901 WARNING frontend.router.dispatch: worker decode-2b unreachable: no ACK",
        "not a log line",
    ]
    found = seed.parse_transitions(lines)
    assert [(t.worker_id, t.old, t.new) for t in found] == [
        ("prefill-1a", "healthy", "inhibited"),
        ("decode-2b", "inhibited", "probing"),
    ]
    assert found[0].unix == pytest.approx(1_800_000_000.25)
    assert found[0].reason.startswith("2 faults in a row")
    counts = seed.count_log_events(lines)
    assert counts["ack_missed_blamed"] == 1
    assert counts["ack_missed_excused"] == 0


# --- totals from /metrics --------------------------------------------------------------------


def _exposition(inhibited: int, excused: int) -> str:
    registry = CollectorRegistry()
    p = HEADWATER_PREFIX
    transitions = Counter(f"{p}worker_state_transitions", "t", ["from", "to"], registry=registry)
    transitions.labels("healthy", "inhibited").inc(inhibited)
    transitions.labels("inhibited", "probing").inc(inhibited)
    Counter(f"{p}excused_timeouts", "e", registry=registry).inc(excused)
    Counter(f"{p}unrelated", "u", registry=registry).inc(5)
    return generate_latest(registry).decode()


def test_counter_increase_and_transitions_by_kind() -> None:
    before = seed.counter_values(_exposition(1, 0))
    after = seed.counter_values(_exposition(4, 3))
    assert not any("unrelated" in key or "_created" in key for key in after)
    increase = seed.counter_increase(before, after)
    assert increase[f"{HEADWATER_PREFIX}excused_timeouts_total"] == 3
    assert seed.transitions_by_kind(increase) == {
        "healthy->inhibited": 3,
        "inhibited->probing": 3,
    }
    assert seed.counter_increase(after, after) == {}


def test_machine_busy_time_from_proc_stat() -> None:
    text = "cpu  100 10 50 1000 20 5 5 0 0 0\ncpu0 50 5 25 500 10 2 3 0 0 0\n"
    ticks = 100 + 10 + 50 + 5 + 5  # idle and iowait left out
    assert seed.cpu_busy_s(text) == pytest.approx(ticks / os.sysconf("SC_CLK_TCK"))
    with pytest.raises(ValueError):
        seed.cpu_busy_s("intr 1 2 3\n")
