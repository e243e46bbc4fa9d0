"""Worker processes: ``headwater worker`` end to end over the TCP request plane.

Test policy: every worker binds 127.0.0.1 port 0 and announces its address on the
READY line; each process gets 10 s to start and 10 s to exit; the whole file stays
well under 20 s. Processes are killed (by their own handle) if a test fails.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from headwater.cluster.children import ProcessHandle
from headwater.cluster.recipes import start_worker
from headwater.plane.base import WorkerInstance
from headwater.plane.client import ClientState, TcpWorkerClient, connect_worker
from headwater.wire import FinishReason, GenerateRequest, Role, SamplingParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v4"


@dataclass
class WorkerProcess:
    process: ProcessHandle
    address: str
    worker_id: str
    role: Role

    @property
    def instance(self) -> WorkerInstance:
        return WorkerInstance(self.worker_id, self.role, MODEL, self.address)


@asynccontextmanager
async def worker_process(tmp_path: Path, role: str, *args: str) -> AsyncIterator[WorkerProcess]:
    """A worker started by the project's own recipe; killed when the block ends."""
    async with trio.open_nursery() as nursery:
        child = await start_worker(
            nursery, role, log_dir=tmp_path, model=MODEL, extra_args=args, ready_within=10
        )
        yield WorkerProcess(child.process, child.address, child.worker_id, Role(child.role))
        nursery.cancel_scope.cancel()


def request(rid: str, max_tokens: int, prompt: int = 64) -> GenerateRequest:
    return GenerateRequest(
        rid,
        MODEL,
        list(range(3, 3 + prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1),
    )


async def test_sigterm_lets_the_inflight_request_finish(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    async with worker_process(tmp_path, "agg", "--speedup-ratio", "20") as worker:
        assert worker.role is Role.AGG
        client: TcpWorkerClient = await connect_worker(worker.instance, nursery)
        async with client.stream(request("quick", 4)) as chunks:
            assert len([t async for c in chunks for t in c.token_ids]) == 4
        # ~1000 decode steps of ~0.3 ms each: still running when the signal lands.
        after_goaway = 0
        async with client.stream(request("inflight", 1000)) as chunks:
            got = [await chunks.__anext__()]
            worker.process.send_signal(signal.SIGTERM)
            async for chunk in chunks:
                got.append(chunk)
                after_goaway += client.state is ClientState.DRAINING
        assert after_goaway > 0  # the drain began while the request ran
        assert sum(len(c.token_ids) for c in got) == 1000
        assert got[-1].finish_reason is FinishReason.LENGTH
        with trio.fail_after(10):
            assert await worker.process.wait() == 0


async def test_prefill_and_decode_processes_move_kv(tmp_path: Path, nursery: trio.Nursery) -> None:
    common = ("--speedup-ratio", "1000", "--kv-bytes-per-token", "256")
    async with (
        worker_process(tmp_path, "prefill", *common) as prefill,
        worker_process(tmp_path, "decode", *common) as decode,
    ):
        to_prefill = await connect_worker(prefill.instance, nursery)
        to_decode = await connect_worker(decode.instance, nursery)
        req = request("disagg", 6, prompt=5000)
        async with to_prefill.stream(req) as chunks:
            (handoff,) = [c async for c in chunks]
        assert handoff.kv_handle is not None
        assert handoff.kv_handle.address == prefill.address
        leg = GenerateRequest(req.request_id, MODEL, req.token_ids, req.sampling, handoff.kv_handle)
        async with to_decode.stream(leg) as chunks:
            assert len([t async for c in chunks for t in c.token_ids]) == 6
        served, pulled = await to_prefill.fetch_stats(), await to_decode.fetch_stats()
        assert served["plane_kv_pulls_served_total"] == 1
        assert served["plane_kv_bytes_served_total"] == 5000 * 256
        assert pulled["kv_pulls_total"] == 1
        assert pulled["kv_bytes_total"] == 5000 * 256
        for worker in (prefill, decode):
            worker.process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await worker.process.wait() == 0


async def test_refuses_to_listen_off_loopback_without_a_secret(tmp_path: Path) -> None:
    env_free = {"PATH": "/usr/bin:/bin"}
    result = await trio.run_process(
        [sys.executable, "-m", "headwater", "worker", "--listen", "0.0.0.0:0"],
        cwd=REPO,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env_free,
    )
    assert result.returncode == 2
    assert b"plane secret" in result.stderr
    assert b"HEADWATER_WORKER_READY" not in result.stdout
