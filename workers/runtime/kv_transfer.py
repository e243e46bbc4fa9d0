"""KV transfer between engines in one process: the in-memory twin of the TCP plane.

A decode engine's :meth:`KvTransfer.pull` becomes a method call on the prefill
engine that holds the KV, followed by a sleep of ``bytes / bandwidth`` so that
disaggregated timings include the transfer. Workers register under the id they put
in their :class:`~headwater.wire.KvHandle`.
"""

from __future__ import annotations

from array import array

import trio

from headwater.plane.base import WorkerError
from headwater.plane.kv import KvSource, KvTransfer, check_prompt
from headwater.wire import ErrorCode, KvHandle
from headwater.wire.tokens import copy_tokens
from workers.engines.base import EngineError


class InProcessKvTransfer(KvTransfer):
    """Routes pulls to registered engines by ``handle.worker_id``.

    *bandwidth* is in bytes per second (``MockerConfig.kv_transfer_bandwidth``).
    """

    def __init__(self, bandwidth: float = 10e9) -> None:
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
        self.bandwidth = bandwidth
        self._engines: dict[str, KvSource] = {}

    def register(self, worker_id: str, engine: KvSource) -> None:
        """Make *engine*'s held transfers pullable as *worker_id* (replaces any previous)."""
        self._engines[worker_id] = engine

    def unregister(self, worker_id: str) -> None:
        """Forget *worker_id*; later pulls from it fail. Unknown ids are ignored."""
        self._engines.pop(worker_id, None)

    async def pull(self, handle: KvHandle) -> int:
        """Release the KV behind *handle* on its owner and wait out the copy time.

        Returns the payload size in bytes. Raises ``EngineError("kv_transfer_failed")``
        if the worker is not registered or no longer holds the transfer. The owner
        frees its blocks before the copy delay, so cancelling during the delay
        loses the KV (as a broken stream would).
        """
        engine = self._engines.get(handle.worker_id)
        if engine is None:
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"KV transfer {handle.transfer_id!r}: worker {handle.worker_id!r} is not reachable",
            )
        nbytes = await engine.release_transfer(handle.transfer_id)
        await trio.sleep(nbytes / self.bandwidth)
        return nbytes

    async def pull_with_prompt(self, handle: KvHandle) -> tuple[int, array[int]]:
        """:meth:`pull`, and a copy of the prompt its owner kept (the plane in-process
        passes requests whole, so only a caller of its own asks)."""
        engine = self._engines.get(handle.worker_id)
        prompt = engine.held_prompt(handle.transfer_id) if engine is not None else None
        nbytes = await self.pull(handle)
        try:
            ids = check_prompt(handle, prompt)
        except WorkerError as exc:
            raise EngineError(exc.code, exc.message) from exc
        return nbytes, copy_tokens(ids)
