"""vLLM's own KV cache events reach the KV router (workers/engines/vllm/kv_events.py).

Test policy: the session's aggregated vLLM worker (tests/vllm_fixture.py), which starts
vLLM with its ZMQ publisher (``--kv-events-config``) and block size 64; a frontend with
``--router kv`` in front of it. A prompt sent once must show up in the router's index as
the blocks vLLM stored (so that the events flow through vLLM, the worker and the plane),
and sent again it is routed by that overlap, which vLLM reports as cached tokens.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from frontend.router.kv_index import prompt_hashes
from frontend.router.kv_routing import KvConfig
from headwater.wire import Role

from frontend_fixture import serve_frontend
from vllm_fixture import MODEL_NAME, VllmCluster
from vllm_helpers import prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


async def test_vllms_events_fill_the_routers_index(vllm_cluster: VllmCluster) -> None:
    agg = vllm_cluster.workers[Role.AGG]
    ids = prompt(300, 77)  # four full 64-token blocks, then 44
    worker = f"{agg.address}?role=agg&id={agg.worker_id}"
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0}
    async with (
        serve_frontend(workers=worker, router="kv", kv=KvConfig(block_size=64)) as (fe, url),
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        with trio.fail_after(60):
            while (await http.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        first = await http.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        # The stored blocks travel vLLM → ZMQ → the worker's log → a kv_poll → the index.
        index = fe.router.kv_index
        # Wait for this prompt's own blocks: the session's vLLM may hold other tests'
        # blocks, which the router's first dump already counts for this worker.
        hashes = prompt_hashes(ids, 64)
        with trio.fail_after(30):
            while index.overlaps(hashes).get(agg.worker_id, 0) < 4:
                await trio.sleep(0.05)
        assert index.statistics().events > 0
        assert index.statistics().mismatched == 0  # vLLM's blocks are the router's size
        stats = fe.router.kv_statistics()
        (view,) = (await http.get("/debug/workers")).json()
        assert view["cache_view"] == "events"
        second = await http.post("/v1/completions", json=body)
        assert second.status_code == 200, second.text
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 256  # what vLLM reports: its four full blocks
        after = fe.router.kv_statistics()
        assert after.overlap_blocks - stats.overlap_blocks == 4  # routed by that overlap
