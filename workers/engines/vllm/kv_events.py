"""vLLM's KV cache events, read from its ZMQ publisher and republished as headwater's.

A vLLM started by the worker publishes what its prefix cache stores and evicts
(``--kv-events-config``: its ZMQ PUB socket connects to the worker's SUB socket, bound on
a free loopback port).
Each message is three frames: the topic, an 8-byte big-endian sequence number, and a
msgpack ``EventBatch``: ``[ts, events, data_parallel_rank]``. vLLM has encoded its events
two ways, and both are read here:

- **positional** (older vLLM): each event an array, its type's name first:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- **keyed** (newer vLLM, the pinned one): each event a map tagged by ``type``:
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``.

A block hash is an integer or bytes (vLLM's ``ExternalBlockHash``); either is only an
identifier here: headwater's router hashes the blocks' tokens itself
(``headwater.wire.kv_events``), so a stored run keeps its tokens, and an engine id maps to
nothing else. :class:`VllmKvEvents` keeps what the cache holds (for a reader's dump) and
publishes into the engine's :class:`~headwater.wire.kv_events.KvEventLog`. A message that
does not decode is counted and skipped; a gap in vLLM's numbers (its PUB socket dropped
messages: ZMQ's high-water mark) clears what is known, so the router forgets this worker's
blocks rather than believe stale ones, and learns them again from the next stores.

:func:`subscribe` is the I/O: a thread blocked in ZMQ's receive, handing each decoded
batch to the trio loop; it leaves within a poll interval of its cancellation. No other
I/O here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import trio

from headwater.wire.kv_events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventLog

log = logging.getLogger(__name__)

#: How long the subscriber thread waits in one receive before it checks for cancellation.
POLL_MS = 100


class EventDecodeError(ValueError):
    """A message is not a vLLM event batch."""


@dataclass(frozen=True, slots=True)
class _Held:
    parent: int | None
    position: int
    tokens: tuple[int, ...]
    block_size: int


def block_id(h: Any) -> int:
    """vLLM's block hash (an int, or the bytes of a digest) as a signed 64-bit id, what
    the request plane carries (``headwater.wire``): a digest's first 8 bytes, an integer
    folded to 64 bits. A block's id only names it; a collision among one worker's blocks
    is a 2**-64 chance per pair."""
    if isinstance(h, bool):
        raise EventDecodeError(f"not a block hash: {h!r}")
    if isinstance(h, int):
        value = h & _MASK
    elif isinstance(h, bytes | bytearray):
        value = int.from_bytes(bytes(h[:8]).rjust(8, b"\0"), "big")
    else:
        raise EventDecodeError(f"not a block hash: {h!r}")
    return value - (1 << 64) if value >> 63 else value


_MASK = (1 << 64) - 1


def decode_batch(payload: bytes) -> list[KvEvent]:
    """One ``EventBatch`` (either encoding; module docstring) as headwater's events, with
    positions left at 0 (:class:`VllmKvEvents` sets them). Raises EventDecodeError."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventDecodeError("not an event batch: [ts, events, ...]")
    return [_event(raw) for raw in batch[1]]


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):  # keyed
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):  # positional
        kind = raw[0]
        names = _POSITIONAL.get(kind)
        if names is None:
            raise EventDecodeError(f"unknown event {kind!r}")
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError(f"not an event: {raw!r:.80}")
    try:
        if kind == "BlockStored":
            ids = tuple(block_id(h) for h in fields["block_hashes"])
            parent = fields.get("parent_block_hash")
            tokens = fields["token_ids"]
            size = fields["block_size"]
            if not isinstance(size, int) or size < 1 or len(tokens) != len(ids) * size:
                raise EventDecodeError("a stored run's tokens are not its blocks'")
            if not all(isinstance(t, int) for t in tokens):
                raise EventDecodeError("token ids must be integers")
            return BlockStored(ids, None if parent is None else block_id(parent), 0, tokens, size)
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(block_id(h) for h in fields["block_hashes"]))
        if kind == "AllBlocksCleared":
            return AllCleared()
    except (KeyError, TypeError) as exc:
        raise EventDecodeError(f"{kind}: {exc!r}") from None
    raise EventDecodeError(f"unknown event {kind!r}")


#: The positional encoding's fields after the tag, in order.
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


class VllmKvEvents:
    """vLLM's events, republished into *log* (module docstring). Every method runs on
    the worker's trio loop and is cheap: a dictionary update per block."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        log.snapshot = self.snapshot
        self._held: dict[int, _Held] = {}
        self._next_seq: int | None = None
        self.batches = 0
        self.bad = 0  # messages that did not decode
        self.gaps = 0  # gaps in vLLM's sequence numbers

    def receive(self, seq: int, payload: bytes) -> None:
        """One message of vLLM's publisher: its sequence number and its batch."""
        if self._next_seq is not None and seq != self._next_seq:
            self.gaps += 1
            log.warning("vLLM's KV events skipped from %d to %d: forgetting", self._next_seq, seq)
            self.apply([AllCleared()])
        self._next_seq = seq + 1
        try:
            events = decode_batch(payload)
        except EventDecodeError as exc:
            self.bad += 1
            log.warning("a KV event batch from vLLM did not decode (%s): skipped", exc)
            return
        self.batches += 1
        self.apply(events)

    def restarted(self) -> None:
        """vLLM started again: its cache is empty, its numbers start over."""
        self._next_seq = None
        self.apply([AllCleared()])

    def apply(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                event = self._stored(event)
            elif isinstance(event, BlockRemoved):
                for i in event.block_ids:
                    self._held.pop(i, None)
            else:
                self._held.clear()
            self.log.publish(event)

    def _stored(self, event: BlockStored) -> BlockStored:
        parent = self._held.get(event.parent) if event.parent is not None else None
        position = 0 if event.parent is None else (parent.position + 1 if parent else -1)
        size = event.block_size
        previous = event.parent
        for k, i in enumerate(event.block_ids):
            tokens = tuple(event.token_ids[k * size : (k + 1) * size])
            self._held[i] = _Held(previous, position + k if position >= 0 else -1, tokens, size)
            previous = i
        return BlockStored(
            event.block_ids, event.parent, max(position, 0), event.token_ids, event.block_size
        )

    def snapshot(self) -> Iterator[BlockStored]:
        """What vLLM's cache holds, one stored block each, parents first where known."""
        for i, held in list(self._held.items()):
            yield BlockStored(
                (i,), held.parent, max(held.position, 0), held.tokens, held.block_size
            )


async def subscribe(
    events: VllmKvEvents, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Listen for vLLM's publisher on a free loopback port until cancelled, each batch
    handed to *events* on this trio loop; ``task_status.started`` with the endpoint to
    give vLLM (``tcp://127.0.0.1:PORT``: vLLM connects to an endpoint with a host, and a
    bound SUB socket keeps the port across vLLM's restarts). The socket lives in a
    thread of its own, blocked in a receive of at most :data:`POLL_MS`; cancelling this
    leaves within that."""
    import zmq  # vLLM's dependency: only a vLLM worker imports this module

    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()

    def read() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            trio.from_thread.run_sync(
                task_status.started, f"tcp://127.0.0.1:{port}", trio_token=token
            )
            while not stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    trio.from_thread.run_sync(_bad, trio_token=token)
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                trio.from_thread.run_sync(events.receive, seq, frames[2], trio_token=token)
        finally:
            sock.close(linger=0)

    def _bad() -> None:
        events.bad += 1

    async with trio.open_nursery() as nursery:
        # The thread is not abandoned (its socket must close): on cancellation it is
        # told to stop, and leaves within one receive's wait.
        nursery.start_soon(partial(trio.to_thread.run_sync, read, abandon_on_cancel=False))
        try:
            await trio.sleep_forever()
        finally:
            stop.set()
