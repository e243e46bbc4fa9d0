"""vLLM's KV cache events, decoded and republished (workers/engines/vllm/kv_events.py).

Batches built by hand in both of vLLM's encodings (the older positional one and the
keyed one of the pinned vLLM, encoded with vLLM's own classes where it is installed),
malformed ones, a gap in vLLM's numbers, a dump of what the cache holds, and the
subscriber reading a real ZMQ publisher on loopback. vLLM itself publishing them is
tested in tests/test_vllm_kv_routing.py.
"""

from __future__ import annotations

import msgspec
import pytest
import trio

from frontend.router.kv_index import KvIndex, prompt_hashes
from headwater.wire.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventLog
from workers.engines.vllm.kv_events import (
    EventDecodeError,
    VllmKvEvents,
    decode_batch,
    subscribe,
)

BLOCK = 4
TOKENS = list(range(100, 112))  # three blocks


def positional(*events: list[object]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), None])


def keyed(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events)])


def test_both_encodings_decode_to_the_same_events() -> None:
    old = positional(
        ["BlockStored", [11, 12], None, TOKENS[:8], BLOCK, None, "GPU"],
        ["BlockStored", [13], 12, TOKENS[8:], BLOCK, None, "GPU"],
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    )
    new = keyed(
        {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": None,
            "token_ids": TOKENS[:8],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [13],
            "parent_block_hash": 12,
            "token_ids": TOKENS[8:],
            "block_size": BLOCK,
        },
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    )
    want = [
        BlockStored((11, 12), None, 0, TOKENS[:8], BLOCK),
        BlockStored((13,), 12, 0, TOKENS[8:], BLOCK),
        BlockRemoved((11,)),
        AllCleared(),
    ]
    assert decode_batch(old) == want
    assert decode_batch(new) == want


def test_the_pinned_vllms_own_batches_decode() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM not installed")
    digest = bytes(range(32))  # a sha256 block hash, as vLLM's ExternalBlockHash may be
    batch = kv_events.EventBatch(
        ts=2.0,
        events=[
            kv_events.BlockStored(
                block_hashes=[digest],
                parent_block_hash=None,
                token_ids=TOKENS[:4],
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            kv_events.BlockRemoved(block_hashes=[digest], medium="GPU"),
            kv_events.AllBlocksCleared(),
        ],
    )
    payload = msgspec.msgpack.Encoder().encode(batch)
    stored, removed, cleared = decode_batch(payload)
    ident = int.from_bytes(digest[:8], "big")  # its first 8 bytes: an int64, as the plane's
    assert -(2**63) <= ident < 2**63
    assert stored == BlockStored((ident,), None, 0, TOKENS[:4], BLOCK)
    assert removed == BlockRemoved((ident,))
    assert cleared == AllCleared()


def test_block_ids_fit_the_planes_int64() -> None:
    from workers.engines.vllm.kv_events import block_id

    assert block_id(5) == 5
    assert block_id(2**64 - 1) == -1  # folded, as the plane carries signed 64-bit ids
    assert block_id(b"\xff" * 32) == -1
    assert block_id(bytes(range(32))) == int.from_bytes(bytes(range(8)), "big")
    for value in (2**70 + 3, -(2**63), b"\x80" + bytes(31)):
        assert -(2**63) <= block_id(value) < 2**63


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1}),  # not a batch
        positional(["BlockStored", [1], None, [1, 2, 3], BLOCK, None, None]),  # short run
        positional(["Exploded", [1]]),
        keyed({"type": "BlockStored", "block_hashes": [1]}),  # fields missing
        keyed({"type": "BlockRemoved", "block_hashes": [True]}),
        keyed(
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": ["a", "b", "c", "d"],
                "block_size": BLOCK,
            }
        ),
    ],
)
def test_a_malformed_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_the_log_gets_the_events_a_router_indexes() -> None:
    log = KvEventLog()
    events = VllmKvEvents(log)
    events.receive(0, positional(["BlockStored", [11, 12], None, TOKENS[:8], BLOCK, None, None]))
    events.receive(
        1,
        keyed(
            {
                "type": "BlockStored",
                "block_hashes": [13],
                "parent_block_hash": 12,
                "token_ids": TOKENS[8:],
                "block_size": BLOCK,
            }
        ),
    )
    events.receive(2, b"garbage")  # counted and skipped: the worker goes on
    assert (events.batches, events.bad) == (2, 1)
    # The position of a block stored after its parent is known: its chain's third.
    assert [e.position for e in log.read(0).events if isinstance(e, BlockStored)] == [0, 2]
    index = KvIndex(BLOCK)
    assert index.apply("w", log.read(-1))  # a reader starts with a dump of the cache
    # The three blocks, chained through vLLM's parent ids.
    assert index.overlaps(prompt_hashes([*TOKENS, 1, 2], BLOCK)) == {"w": 3}
    events.receive(3, keyed({"type": "BlockRemoved", "block_hashes": [13]}))
    assert index.apply("w", log.read(log.next_seq - 1))  # the removal, in order
    assert index.overlaps(prompt_hashes(TOKENS, BLOCK)) == {"w": 2}


def test_a_gap_in_vllms_numbers_forgets_rather_than_believes_stale_blocks() -> None:
    log = KvEventLog()
    events = VllmKvEvents(log)
    events.receive(0, positional(["BlockStored", [11], None, TOKENS[:4], BLOCK, None, None]))
    events.receive(5, positional(["BlockStored", [21], None, TOKENS[4:8], BLOCK, None, None]))
    assert events.gaps == 1
    index = KvIndex(BLOCK)
    index.apply("w", log.read(-1))
    assert index.overlaps(prompt_hashes(TOKENS[:4], BLOCK)) == {}  # forgotten
    assert index.overlaps(prompt_hashes(TOKENS[4:8], BLOCK)) == {"w": 1}  # stored after
    events.restarted()  # vLLM restarted: empty, numbered from 0 again
    events.receive(0, positional(["BlockStored", [31], None, TOKENS[:4], BLOCK, None, None]))
    assert events.gaps == 1
    index.apply("w", log.read(-1))
    assert index.overlaps(prompt_hashes(TOKENS[4:8], BLOCK)) == {}
    assert index.overlaps(prompt_hashes(TOKENS[:4], BLOCK)) == {"w": 1}


async def test_the_subscriber_listens_for_a_zmq_publisher_until_cancelled() -> None:
    zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
    events = VllmKvEvents(KvEventLog())
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                endpoint = await nursery.start(subscribe, events)
                assert endpoint.startswith("tcp://127.0.0.1:")
                pub.connect(endpoint)  # as vLLM does with an endpoint that names a host
                seq = 0
                while events.batches == 0:  # a connection joins late: send until heard
                    payload = positional(
                        ["BlockStored", [seq + 1], None, TOKENS[:4], BLOCK, None, None]
                    )
                    pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
                    seq += 1
                    await trio.sleep(0.05)
                pub.send_multipart((b"kv", b"short", b""))  # a bad frame: counted
                while events.bad == 0:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()  # leaves within one receive's wait
    finally:
        pub.close(linger=0)
    assert events.log.published >= 1
