"""The route stage: policies, in-flight accounting, health with backoff, draining."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import trio
import trio.testing

from frontend.discovery.static import parse_worker_url
from frontend.errors import NoWorkers
from frontend.router import Router, WorkerState
from headwater.plane.base import WorkerInstance
from headwater.wire import Role


class _Stub:
    """Routing only reads ``instance``; no transport is needed."""

    def __init__(self, worker_id: str, role: Role, model: str = "m") -> None:
        self.instance = WorkerInstance(worker_id, role, model, f"tcp://127.0.0.1:{len(worker_id)}")


def _router(policy: str, **kw: object) -> Router:
    router = Router(policy, rng=random.Random(1), **kw)  # type: ignore[arg-type]
    for wid, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL),
                      ("d0", Role.DECODE), ("d1", Role.DECODE)):  # fmt: skip
        router.add(_Stub(wid, role))  # type: ignore[arg-type]
    return router


async def test_round_robin_spreads_serial_disaggregated_requests() -> None:
    router = _router("round-robin")
    used = Counter()
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


async def test_unreachable_worker_is_inhibited_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    router = _router("round-robin", inhibit_s=5.0, max_inhibit_s=12.0)
    d0 = next(c for c in router.clients() if c.instance.worker_id == "d0")
    start = trio.current_time()
    for failures, expected in ((1, 5.0), (2, 10.0), (3, 12.0)):  # doubling, capped
        router.report_unreachable(d0, ConnectionError("no ACK"))
        view = {v.worker_id: v for v in router.views()}["d0"]
        assert view.state is WorkerState.INHIBITED
        assert view.failures == failures
        assert view.last_error == "no ACK"
        assert view.inhibited_for_s == pytest.approx(expected)
    assert router.routable(Role.DECODE, "m") == 1
    await trio.sleep_until(start + 12.0)
    assert router.routable(Role.DECODE, "m") == 2  # back by itself
    router.report_success(d0)
    assert {v.worker_id: v for v in router.views()}["d0"].failures == 0


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
