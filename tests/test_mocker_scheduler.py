"""The mocker's scheduler, held transfers and draws, driven step by step without trio.

Test policy: no event loop, no clock but the numbers passed in. A test builds a
:class:`Scheduler` over a small :class:`KvCache`, adds sequences and runs steps with
:func:`step` (``plan`` then ``finish``); expected durations come from
:mod:`workers.engines.mocker.timing`. The trio shell's own behaviour (virtual-time
delivery, cancellation, shutdown) is in ``test_mocker.py``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from headwater.wire import FinishReason
from headwater.wire.tokens import token_array
from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.kv_cache import KvCache
from workers.engines.mocker.sampling import (
    HEAD,
    PROMPT_KEY,
    logprobs_at,
    output_length,
    prompt_logprobs,
    seed_key,
    shape,
    token_at,
)
from workers.engines.mocker.scheduler import MockerCounters, Scheduler, Sequence, State
from workers.engines.mocker.timing import decode_ms, prefill_ms
from workers.engines.mocker.transfers import HeldTransfers

REPO = Path(__file__).resolve().parent.parent


def scheduler(transfers: bool = False, **overrides: object) -> Scheduler[Sequence]:
    cfg = MockerConfig(**overrides)  # type: ignore[arg-type]
    cache = KvCache(cfg.num_gpu_blocks, cfg.block_size)
    held = HeldTransfers(cache, cfg.kv_transfer_timeout, "w", "memory://w") if transfers else None
    return Scheduler(cfg, cache, MockerCounters(), held)


def seq(rid: str, n: int, max_tokens: int = 8, *, start: int = 1000, **fields: object) -> Sequence:
    """A sequence with an *n*-token prompt ``start, start + 1, ...``."""
    return Sequence(rid, token_array(range(start, start + n)), max_tokens, **fields)  # type: ignore[arg-type]


def step(sched: Scheduler[Sequence], now: float = 0.0) -> tuple[list[tuple[str, int]], float]:
    """Plan and finish one step that starts at *now*, as the engine does; return
    (request id, tokens) in batch order and the step's duration. ``sched.woken`` is
    then what this step woke."""
    sched.woken.clear()
    batch, seconds = sched.plan()
    sched.finish(batch, now + seconds)
    return [(s.request_id, n) for s, n in batch], seconds


def used_blocks(sched: Scheduler[Sequence]) -> int:
    return sched.cache.statistics().used_blocks


def output(s: Sequence) -> list[int]:
    return list(s.tokens[len(s.tokens) - s.num_output :])


# ---- admission -----------------------------------------------------------------------


def test_admission_stops_at_max_num_seqs_and_a_finish_makes_room() -> None:
    sched = scheduler(max_num_seqs=2)
    a, b, c = seq("a", 10, 1), seq("b", 10, 5, start=2000), seq("c", 10, start=3000)
    for s in (a, b, c):
        sched.add(s)
    assert step(sched)[0] == [("a", 10), ("b", 10)]
    assert list(sched.waiting) == [c]
    assert c.state is State.WAITING
    assert c.table is None
    # a sampled its one token and finished: c takes its slot in the next plan.
    assert a.finish is FinishReason.LENGTH
    assert step(sched)[0] == [("b", 1), ("c", 10)]
    assert sched.running == [b, c]


def test_admission_waits_for_kv_in_fifo_order() -> None:
    sched = scheduler(num_gpu_blocks=4, block_size=16)  # 64 tokens
    a = seq("a", 40, 1)  # 3 blocks
    b = seq("b", 30, start=2000)  # 2 blocks: only 1 left
    c = seq("c", 10, start=3000)  # 1 block would fit, but waits behind b
    for s in (a, b, c):
        sched.add(s)
    assert step(sched)[0] == [("a", 40)]
    assert list(sched.waiting) == [b, c]
    assert a.state is State.DONE  # finished: its blocks came back
    assert used_blocks(sched) == 0
    assert step(sched)[0] == [("b", 30), ("c", 10)]
    assert used_blocks(sched) == 3


def test_a_cached_prefix_is_admitted_as_computed() -> None:
    sched = scheduler(block_size=16)
    first = seq("first", 40, 1)
    sched.add(first)
    step(sched)
    second = Sequence("second", token_array([*range(1000, 1032), *range(5000, 5010)]), 1)
    sched.add(second)
    assert step(sched)[0] == [("second", 10)]  # two full blocks served by the cache
    assert second.cached_tokens == 32
    assert sched.counters.prefill_tokens_cached == 32
    assert sched.counters.prefill_tokens_computed == 40 + 10


def test_a_fully_transferred_prompt_starts_decoding() -> None:
    sched = scheduler()
    s = seq("d", 300, 2, transferred=300)
    sched.add(s)
    batch, seconds = step(sched)
    # Its first step computes the last prompt token and samples, priced as decode.
    assert batch == [("d", 1)]
    assert seconds == pytest.approx(decode_ms(300 / sched.config.kv_capacity_tokens) / 1000)
    assert s.num_output == 1
    assert sched.counters.prefill_tokens_computed == 0


# ---- planning: budget, chunks, timing ------------------------------------------------------


def test_decode_goes_before_prefill_within_the_token_budget() -> None:
    sched = scheduler(max_num_batched_tokens=8)
    a = seq("a", 4, 10)
    sched.add(a)
    assert step(sched)[0] == [("a", 4)]
    b = seq("b", 20, start=2000)
    sched.add(b)
    # Admitted after a, planned after it too: a's decode token first, b the rest.
    for chunk in (7, 7, 6):
        batch, seconds = step(sched)
        assert batch == [("a", 1), ("b", chunk)]
        assert seconds == pytest.approx(prefill_ms(chunk) / 1000)  # decode rides along
    assert b.num_computed == 20
    assert b.num_output == 1
    assert a.num_output == 4


def test_a_budget_smaller_than_the_batch_leaves_later_decoders_for_the_next_step() -> None:
    sched = scheduler(max_num_batched_tokens=2)
    seqs = [seq(f"s{i}", 1, 10, start=1000 + i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert step(sched)[0] == [("s0", 1), ("s1", 1)]
    assert step(sched)[0] == [("s0", 1), ("s1", 1)]  # decoding s0, s1 take it all
    assert seqs[2].num_computed == 0
    assert seqs[2].state is State.RUNNING


def test_long_prompt_is_prefilled_in_chunks_and_samples_after_the_last() -> None:
    sched = scheduler(max_num_batched_tokens=512)
    s = seq("long", 1300, 1)
    sched.add(s)
    now = 0.0
    for chunk, computed in ((512, 512), (512, 1024), (276, 1300)):
        assert not s.pending
        assert not sched.woken
        batch, seconds = step(sched, now)
        now += seconds
        assert batch == [("long", chunk)]
        assert s.num_computed == computed
    assert now == pytest.approx((2 * prefill_ms(512) + prefill_ms(276)) / 1000)
    assert len(s.pending) == 1
    assert sched.counters.prefill_tokens_computed == 1300


def test_step_durations_follow_the_timing_model() -> None:
    sched = scheduler(speedup_ratio=4.0, num_gpu_blocks=64)  # small cache: u visibly > 0
    cap = sched.config.kv_capacity_tokens
    sched.add(seq("r", 300, 4))
    durations = [step(sched)[1] for _ in range(4)]
    assert durations[0] == pytest.approx(prefill_ms(300) / 4000)
    for k in range(1, 4):
        assert durations[k] == pytest.approx(decode_ms((300 + k) / cap) / 4000)
    assert sched.plan() == ([], 0.0)  # idle
    assert not sched.replan


# ---- preemption and finishing --------------------------------------------------------------


def test_preemption_takes_the_newest_sequence_and_requeues_it_first() -> None:
    sched = scheduler(num_gpu_blocks=4, block_size=4)
    a, b, c = (seq(rid, 4, 20, start=1000 + 100 * i, seed_key=i) for i, rid in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # one full block each, a token sampled each; one block free
    assert used_blocks(sched) == 3
    d = seq("d", 8, start=9000)  # two blocks: waits
    sched.add(d)
    # a takes the free block; b needs one too and c, the newest, gives it up.
    assert step(sched)[0] == [("a", 1), ("b", 1)]
    assert sched.replan
    assert sched.counters.preemptions == 1
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]  # back at the head of the queue
    assert (c.state, c.table, c.num_computed) == (State.WAITING, None, 0)
    assert output(c) == list(c.pending)  # its token is kept, to recompute
    assert used_blocks(sched) == 4


def test_a_preempted_sequence_recomputes_and_draws_the_same_tokens() -> None:
    def run(num_gpu_blocks: int) -> tuple[list[list[int]], int]:
        sched = scheduler(num_gpu_blocks=num_gpu_blocks, block_size=4)
        seqs = [
            seq(rid, 8, 12, start=1000 + 100 * i, seed_key=seed_key(i, rid))
            for i, rid in enumerate("ab")
        ]
        for s in seqs:
            sched.add(s)
        while sched.running or sched.waiting:
            step(sched)
        assert used_blocks(sched) == 0
        return [output(s) for s in seqs], sched.counters.preemptions

    roomy, none = run(64)
    tight, preempted = run(6)  # both prompts fit, both outputs do not
    assert none == 0
    assert preempted >= 1
    assert tight == roomy
    assert all(len(out) == 12 for out in tight)


def test_a_sequence_alone_that_outgrows_the_cache_finishes_length_while_planning() -> None:
    sched = scheduler(num_gpu_blocks=2, block_size=4)  # 8 tokens
    s = seq("big", 7, 100)
    sched.add(s)
    step(sched)
    step(sched)  # the 8th slot still fits
    sched.woken.clear()
    batch, seconds = sched.plan()
    assert (batch, seconds) == ([], 0.0)
    assert sched.replan  # it freed KV: plan again rather than wait
    assert sched.woken == [s]
    assert s.finish is FinishReason.LENGTH
    assert s.num_output == 8 - 7 + 1
    assert used_blocks(sched) == 0


def test_a_finished_sequence_frees_its_blocks_and_leaves_its_prefix_cached() -> None:
    sched = scheduler(block_size=16)
    s = seq("r", 100, 3)
    sched.add(s)
    step(sched)
    assert used_blocks(sched) == 7
    assert sched.woken == [s]
    step(sched)
    step(sched)
    assert s.finish is FinishReason.LENGTH
    assert (s.state, s.table, sched.running) == (State.DONE, None, [])
    assert sched.woken == [s]
    stats = sched.cache.statistics()
    assert stats.used_blocks == 0
    assert stats.cached_free_blocks == 102 // 16  # the computed full blocks stay cached


def test_eos_and_stop_ids_finish_stop() -> None:
    sched = scheduler()
    eos = seq("eos", 5, 50, eos_token=1, eos_index=3)
    base = seq("base", 5, 6, start=2000, seed_key=9)
    for s in (eos, base):
        sched.add(s)
    while sched.running or sched.waiting:
        step(sched)
    assert output(eos) == [*output(eos)[:3], 1]
    assert eos.finish is FinishReason.STOP
    stop = output(base)[2]
    early = seq("early", 5, 6, start=2000, seed_key=9, stop_ids=frozenset([stop]))
    late = seq("late", 5, 6, start=2000, seed_key=9, stop_ids=frozenset([stop]), min_tokens=3)
    for s in (early, late):
        sched.add(s)
    while sched.running or sched.waiting:
        step(sched)
    assert output(early) == output(base)[:3]
    assert early.finish is FinishReason.STOP
    assert output(late) == output(base)  # min_tokens: not before index 3
    assert late.finish is FinishReason.LENGTH


def test_a_sequence_removed_mid_step_is_skipped_and_freed() -> None:
    sched = scheduler()
    a, b = seq("a", 100, 4), seq("b", 100, 4, start=5000)
    for s in (a, b):
        sched.add(s)
    batch, seconds = sched.plan()
    sched.remove(b)  # its consumer left while the step ran
    sched.finish(batch, seconds)
    assert sched.woken == [a]
    assert not b.pending
    assert (b.state, b.table) == (State.DONE, None)
    assert sched.counters.prefill_tokens_computed == 100
    assert used_blocks(sched) == -(-101 // 64)
    sched.remove(a)
    assert used_blocks(sched) == 0
    assert sched.plan() == ([], 0.0)


def test_drain_frees_everything_and_returns_waiting_then_running() -> None:
    sched = scheduler(max_num_seqs=1)
    a, b = seq("a", 10), seq("b", 10, start=2000)
    for s in (a, b):
        sched.add(s)
    step(sched)
    assert sched.drain() == [b, a]
    assert all(s.state is State.DONE for s in (a, b))
    assert (sched.running, list(sched.waiting)) == ([], [])
    assert used_blocks(sched) == 0


def test_output_tokens_are_the_draws_at_their_absolute_positions() -> None:
    # What makes a rerun, a preemption or a migration (output appended to the prompt)
    # reproduce the same ids.
    sched = scheduler(output_token_low=10, output_token_high=1010)
    key = seed_key(3, "r")
    s = seq("r", 50, 20, seed_key=key)
    sched.add(s)
    while sched.running or sched.waiting:
        step(sched)
    assert output(s) == [token_at(key, 50 + i + 1, 10, 1000) for i in range(20)]
    migrated = Sequence("m", token_array([*s.tokens[:60]]), 10, seed_key=key)
    sched.add(migrated)
    while sched.running or sched.waiting:
        step(sched)
    assert output(migrated) == output(s)[10:]


# ---- held transfers (prefill role) -------------------------------------------------------


def test_a_prefill_only_sequence_holds_its_kv_until_released_or_expired() -> None:
    sched = scheduler(transfers=True, block_size=16, kv_transfer_timeout=5.0)
    held = sched.transfers
    assert held is not None
    p, q = seq("p", 100, prefill_only=True), seq("q", 40, start=5000, prefill_only=True)
    sched.add(p)
    step(sched, now=10.0)
    assert sched.woken == [p]
    sched.add(q)
    step(sched, now=11.0)
    assert sched.woken == [q]
    assert p.handle is not None
    assert q.handle is not None
    assert (p.state, p.table, p.num_output) == (State.DONE, None, 0)
    assert sched.running == []
    assert (p.handle.worker_id, p.handle.address, p.handle.num_tokens) == ("w", "memory://w", 100)
    assert len(held) == 2
    assert used_blocks(sched) == 7 + 3
    deadline = 10.0 + prefill_ms(100) / 1000 + 5.0
    assert held.next_expiry() == pytest.approx(deadline)
    assert held.expire(deadline - 1e-6) == 0
    assert held.expire(deadline) == 1  # p's; q has a second to go
    assert used_blocks(sched) == 3
    assert held.release(p.handle.transfer_id) is None  # expired
    assert held.release(q.handle.transfer_id) == 40
    assert (len(held), held.next_expiry(), used_blocks(sched)) == (0, None, 0)


def test_prefill_only_sequences_need_transfers() -> None:
    with pytest.raises(ValueError, match="transfers"):
        scheduler().add(seq("p", 10, prefill_only=True))


# ---- draws -------------------------------------------------------------------------------


def test_draws_are_pinned_functions_of_seed_and_position() -> None:
    # Pinned: a change would make workers of two versions disagree mid-migration.
    assert seed_key(None, "id-1") == 6534366926336042706  # blake2b: not salted per process
    key = seed_key(7, "ignored when seeded")
    assert key == 7191089600892374487
    assert [token_at(key, p, 3, 128000 - 3) for p in (1, 2, 101)] == [54490, 119857, 14045]
    assert output_length(key, 256, 1.0) == 141
    assert {token_at(key, p, 3, 5) for p in range(200)} == {3, 4, 5, 6, 7}


def test_output_lengths_are_lognormal_of_the_configured_mean() -> None:
    lengths = sorted(output_length(seed_key(s, ""), 256, 1.0) for s in range(20_000))
    mean = sum(lengths) / len(lengths)
    assert mean == pytest.approx(256, rel=0.03)
    # Right-skewed as answers are: the median at exp(-σ²/2) = 0.61 of the mean.
    assert lengths[len(lengths) // 2] == pytest.approx(256 * 0.607, rel=0.03)
    assert lengths[0] >= 1
    # σ = 0: every answer exactly the mean; a shape of its own per σ otherwise.
    assert {output_length(seed_key(s, ""), 40, 0.0) for s in range(100)} == {40}
    narrow = [output_length(seed_key(s, ""), 40, 0.25) for s in range(1000)]
    assert max(narrow) < 2 * 40 < max(lengths)


@pytest.mark.parametrize("span", [5, 20, 21, 128000 - 3])
def test_each_position_has_one_distribution_over_the_range(span: int) -> None:
    s = shape(span)
    assert s.head == min(HEAD, span)
    probs = [math.exp(lp) for lp in s.logprobs]
    assert probs == sorted(probs, reverse=True)  # the candidates, most likely first
    tail = (span - s.head) * math.exp(s.tail_logprob)
    assert sum(probs) + tail == pytest.approx(1.0)
    if span > s.head:  # every other token is less likely than the last candidate
        assert s.tail_logprob < s.logprobs[-1]


def test_tokens_are_drawn_from_the_distribution_logprobs_reports() -> None:
    span, key, n = 128000 - 3, seed_key(11, ""), 20_000
    ranks: Counter[int] = Counter()
    for p in range(1, n + 1):
        token = token_at(key, p, 3, span)
        lp = logprobs_at(key, p, token, 3, span, top=5)
        assert 3 <= token < 3 + span
        assert lp.top_logprobs == shape(span).logprobs[:5]
        assert len(set(lp.top_ids)) == 5
        if lp.rank <= 5:  # a candidate: it is where the top list says, with that logprob
            assert (lp.top_ids[lp.rank - 1], lp.top_logprobs[lp.rank - 1]) == (token, lp.logprob)
        else:
            assert token not in lp.top_ids
        ranks[min(lp.rank, HEAD + 1)] += 1
    # How often each rank is drawn is what its logprob says (within 4 sigma).
    for rank in (1, 2, 3):
        prob = math.exp(shape(span).logprobs[rank - 1])
        assert abs(ranks[rank] - n * prob) < 4 * math.sqrt(n * prob * (1 - prob))
    assert ranks[HEAD + 1] > 0  # the tail is drawn too, now and then


def test_a_forced_token_and_tokens_off_the_range() -> None:
    key, span = seed_key(1, ""), 1000
    usual = logprobs_at(key, 9, 0, 3, span, top=3)
    assert (usual.logprob, usual.rank) == (-math.inf, span + 1)  # 0 is not in [3, 1003)
    # The EOS a request ends with takes the most likely candidate's place.
    eos = logprobs_at(key, 9, 1, 3, span, top=3, first=1)
    assert (eos.logprob, eos.rank) == (shape(span).logprobs[0], 1)
    assert eos.top_ids == (1, *usual.top_ids[1:])
    assert eos.top_logprobs == usual.top_logprobs
    displaced = logprobs_at(key, 9, usual.top_ids[0], 3, span, top=3, first=1)
    assert displaced.rank == span + 1


def test_prompt_logprobs_depend_on_the_prompt_alone() -> None:
    tokens = [5, 900, 17, 42]
    got = prompt_logprobs(tokens, 2, 3, 1000)
    assert len(got) == 3  # the first token has none
    assert got == prompt_logprobs(list(tokens), 2, 3, 1000)
    assert got[1] == logprobs_at(PROMPT_KEY, 3, 17, 3, 1000, top=2)


# ---- no trio -----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_scheduler_and_its_helpers_import_no_trio() -> None:
    # The package's __init__ imports the trio shell, so it is stubbed out: what is
    # checked is what these modules themselves pull in.
    code = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("workers.engines.mocker")
        pkg.__path__ = [{str(REPO / "workers" / "engines" / "mocker")!r}]
        sys.modules["workers.engines.mocker"] = pkg
        import workers.engines.mocker.scheduler
        import workers.engines.mocker.sampling
        import workers.engines.mocker.transfers
        print(sorted(m for m in sys.modules if m.split(".")[0] == "trio"))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
