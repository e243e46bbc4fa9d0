"""The route stage: policies, in-flight accounting, health with backoff, draining."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import trio
import trio.testing

from frontend.discovery.static import parse_worker_url
from frontend.errors import NoWorkers
from frontend.router import BusyThresholds, HealthConfig, Router, WorkerState
from headwater.plane.base import CannotConnect, WorkerInstance
from headwater.wire import Role, WorkerLoad


class _Stub:
    """Routing only reads ``instance`` and ``load``; no transport is needed."""

    def __init__(self, worker_id: str, role: Role, model: str = "m") -> None:
        self.instance = WorkerInstance(worker_id, role, model, f"tcp://127.0.0.1:{len(worker_id)}")
        self.load: WorkerLoad | None = None


def _router(policy: str, **kw: object) -> Router:
    router = Router(policy, rng=random.Random(1), **kw)  # type: ignore[arg-type]
    for wid, role in (
        ("p0", Role.PREFILL),
        ("p1", Role.PREFILL),
        ("d0", Role.DECODE),
        ("d1", Role.DECODE),
    ):
        router.add(_Stub(wid, role))  # type: ignore[arg-type]
    return router


async def test_round_robin_spreads_serial_disaggregated_requests() -> None:
    router = _router("round-robin")
    used: Counter[str] = Counter()
    for _ in range(8):  # what the pipeline does per request: a prefill leg, then decode
        used[router.pick(Role.PREFILL, "m").instance.worker_id] += 1
        used[router.pick(Role.DECODE, "m").instance.worker_id] += 1
    assert used == {"p0": 4, "p1": 4, "d0": 4, "d1": 4}


async def test_random_uses_every_worker_of_the_role() -> None:
    router = _router("random")
    picks = {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(50)}
    assert picks == {"d0", "d1"}


@pytest.mark.parametrize("policy", ["least-loaded", "p2c"])
async def test_load_aware_policies_avoid_the_busy_worker(policy: str) -> None:
    router = _router(policy)
    busy = next(c for c in router.clients() if c.instance.worker_id == "d0")
    with router.track(busy), router.track(busy):
        picks = {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(20)}
    assert picks == {"d1"}
    assert router.views()[0].inflight == 0  # track() gave the slots back


async def test_no_worker_for_role_or_model_raises() -> None:
    router = _router("round-robin")
    with pytest.raises(NoWorkers):
        router.pick(Role.AGG, "m")
    with pytest.raises(NoWorkers):
        router.pick(Role.DECODE, "other-model")
    with pytest.raises(NoWorkers):
        router.pick(Role.DECODE, "m", exclude=frozenset({"d0", "d1"}))


async def test_draining_workers_get_no_new_requests() -> None:
    router = _router("round-robin")
    router.set_draining("d0")
    assert {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(6)} == {"d1"}
    assert {v.worker_id: v.state for v in router.views()}["d0"] is WorkerState.DRAINING
    assert router.routable(Role.DECODE, "m") == 1


async def test_a_worker_is_inhibited_after_consecutive_faults_only() -> None:
    router = _router("round-robin", health=HealthConfig(inhibit_after=3))
    d0 = next(c for c in router.clients() if c.instance.worker_id == "d0")
    for failures in (1, 2):
        router.report_failure(d0, ConnectionError("no ACK"))
        view = {v.worker_id: v for v in router.views()}["d0"]
        assert (view.state, view.failures, view.last_error) == (
            WorkerState.HEALTHY,
            failures,
            "no ACK",
        )
    router.report_success(d0)  # a served request: the faults in a row start again
    for _ in range(2):
        router.report_failure(d0, ConnectionError("no ACK"))
    assert router.routable(Role.DECODE, "m") == 2
    router.report_failure(d0, ConnectionError("no ACK"))
    view = {v.worker_id: v for v in router.views()}["d0"]
    assert view.state is WorkerState.INHIBITED
    assert view.reason is not None
    assert "3 faults in a row" in view.reason
    assert router.routable(Role.DECODE, "m") == 1


class _Probed(_Stub):
    """A stub whose probes succeed or fail as the test says, and are timed."""

    def __init__(self, worker_id: str, role: Role, answers: list[bool]) -> None:
        super().__init__(worker_id, role)
        self.answers = answers
        self.probed_at: list[float] = []

    async def probe(self) -> None:
        self.probed_at.append(trio.current_time())
        await trio.sleep(0.01)
        if not (self.answers.pop(0) if self.answers else True):
            raise CannotConnect("probe refused")


async def test_an_inhibited_worker_is_probed_with_backoff_and_comes_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changes: list[tuple[str, str, str]] = []
    health = HealthConfig(
        inhibit_after=1,
        probe_backoff=1.0,
        probe_backoff_max=3.0,
        probe_jitter=0.0,
        recover_after=2,
        probe_interval=0.5,
    )
    router = Router(
        "round-robin",
        health=health,
        rng=random.Random(1),
        on_transition=lambda wid, c: changes.append((wid, c.old.value, c.new.value)),
    )
    # Probes: one unanswered, then one answered and one unanswered, then two answered.
    worker = _Probed("d0", Role.DECODE, [False, True, False, True, True])
    router.add(worker)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        start = trio.current_time()
        router.report_failure(worker, ConnectionError("no ACK"))  # type: ignore[arg-type]
        while {v.worker_id: v.state for v in router.views()}["d0"] is not WorkerState.HEALTHY:
            await router.changed.wait()
        nursery.cancel_scope.cancel()
    times = [round(t - start, 2) for t in worker.probed_at]
    # 1 s backoff, unanswered; 2 s (doubled), answered; 0.5 s later unanswered; 3 s
    # (capped), answered; 0.5 s later answered: healthy.
    assert times == [1.0, 3.01, 3.52, 6.53, 7.04]
    assert changes == [
        ("d0", "healthy", "inhibited"),
        ("d0", "inhibited", "probing"),
        ("d0", "probing", "inhibited"),
        ("d0", "inhibited", "probing"),
        ("d0", "probing", "inhibited"),
        ("d0", "inhibited", "probing"),
        ("d0", "probing", "healthy"),
    ]
    assert router.routable(Role.DECODE, "m") == 1


async def test_an_inhibited_worker_gets_no_requests_while_probed() -> None:
    router = _router("round-robin", health=HealthConfig(inhibit_after=1))
    d0 = next(c for c in router.clients() if c.instance.worker_id == "d0")
    router.report_failure(d0, ConnectionError("gone"))
    assert {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(6)} == {"d1"}
    router.report_failure(d0, ConnectionError("gone again"))  # already out: no change
    assert {v.worker_id: v for v in router.views()}["d0"].state is WorkerState.INHIBITED


async def test_a_busy_worker_is_skipped_while_another_is_free() -> None:
    router = _router("round-robin", busy=BusyThresholds(kv_usage=0.9, waiting=4))
    d0 = next(c for c in router.clients() if c.instance.worker_id == "d0")
    d0.load = WorkerLoad(active=3, waiting=4, kv_usage=0.1)  # type: ignore[misc]
    assert {router.pick(Role.DECODE, "m").instance.worker_id for _ in range(6)} == {"d1"}
    assert not router.all_busy(Role.DECODE, "m")
    d1 = next(c for c in router.clients() if c.instance.worker_id == "d1")
    d1.load = WorkerLoad(active=1, waiting=0, kv_usage=0.95)  # type: ignore[misc]
    assert router.all_busy(Role.DECODE, "m")
    assert router.pick(Role.DECODE, "m").instance.worker_id in ("d0", "d1")  # still picks
    assert {v.worker_id: v.busy for v in router.views() if v.role is Role.DECODE} == {
        "d0": True,
        "d1": True,
    }


async def test_membership_changes_notify_and_replace() -> None:
    router = _router("round-robin")
    woken = []

    async def waiter() -> None:
        await router.changed.wait()
        woken.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        router.add(_Stub("d2", Role.DECODE))  # type: ignore[arg-type]
    assert woken == [True]
    assert router.routable(Role.DECODE, "m") == 3
    removed = router.remove("d2")
    assert removed is not None
    assert removed.instance.worker_id == "d2"
    assert router.remove("d2") is None


async def test_static_entries_without_id_accept_whoever_answers() -> None:
    named = parse_worker_url("tcp://127.0.0.1:9000?role=decode&id=w1", default_model="m")
    assert named.worker_id == "w1"
    assert "expect_worker_id" not in named.metadata
    anonymous = parse_worker_url("tcp://127.0.0.1:9001?role=decode", default_model="m")
    assert anonymous.worker_id == "127.0.0.1:9001"
    assert anonymous.metadata == {"expect_worker_id": ""}
