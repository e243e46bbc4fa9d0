"""Worker-to-worker KV transfer over the TCP request plane.

A decode engine holding a :class:`~headwater.wire.KvHandle` pulls the KV straight
from the prefill worker named in it: ``kv_pull(transfer_id)`` on a plane connection
to ``handle.address``, answered by ``kv_data`` pieces (or an error frame when the
transfer is unknown or expired). Connections are opened on first use, one per prefill
worker, shared by concurrent pulls, heartbeated like the frontend's, and dropped when
they break; the next pull opens a new one. Their tasks live in :meth:`TcpKvTransfer.run`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from headwater.plane.base import PlaneError
from headwater.plane.connection import (
    Connector,
    PlaneConfig,
    PlaneConnection,
    dial,
    tcp_connector,
)
from headwater.wire import ErrorCode, KvHandle
from workers.engines.base import EngineError, KvTransfer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvTransferStats:
    pulls_total: int
    pull_failures_total: int
    bytes_total: int
    connections: int


class TcpKvTransfer(KvTransfer):
    """Pulls KV from prefill workers over TCP. Start :meth:`run` in a nursery first.

    *peer_id* and *role* identify this worker in the handshake; *secret* must match
    the prefill workers'. *pull_timeout* bounds one pull, connect included.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        role: str = "decode",
        secret: bytes | None = None,
        config: PlaneConfig | None = None,
        pull_timeout: float = 30.0,
    ) -> None:
        self.peer_id = peer_id
        self.role = role
        self.pull_timeout = pull_timeout
        self.config = config or PlaneConfig()
        self._secret = secret
        self._nursery: trio.Nursery | None = None
        self._connections: dict[str, PlaneConnection] = {}
        self._dialing: dict[str, trio.Lock] = {}
        self._pulls = 0
        self._failures = 0
        self._bytes = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the connections until cancelled (which closes them)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def pull(self, handle: KvHandle) -> int:
        """Fetch and release the KV behind *handle*; return the payload bytes.

        Raises ``EngineError("kv_transfer_failed")`` if the prefill worker cannot be
        reached, refuses the transfer, breaks off, or takes over ``pull_timeout``.
        """
        try:
            with trio.fail_after(self.pull_timeout):
                conn = await self._connection(handle)
                received = await conn.pull_kv(handle.transfer_id)
        except (PlaneError, trio.TooSlowError, ValueError) as exc:
            self._failures += 1
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            raise EngineError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"pulling KV {handle.transfer_id} from {handle.worker_id} at "
                f"{handle.address}: {reason}",
            ) from exc
        self._pulls += 1
        self._bytes += received
        return received

    async def _connection(self, handle: KvHandle) -> PlaneConnection:
        address = handle.address
        lock = self._dialing.setdefault(address, trio.Lock())
        async with lock:  # one dial per prefill worker, however many pulls wait
            conn = self._connections.get(address)
            if conn is not None and (
                conn.unusable.is_set() or conn.peer.worker_id != handle.worker_id
            ):
                conn.close("replaced")
                conn = None
            if conn is None:
                conn = await self._dial(address, handle.worker_id, tcp_connector(address))
            return conn

    async def _dial(self, address: str, worker_id: str, connector: Connector) -> PlaneConnection:
        if self._nursery is None:
            raise EngineError(ErrorCode.KV_TRANSFER_FAILED, "TcpKvTransfer.run() is not running")
        conn = await dial(
            connector,
            role=self.role,
            peer_id=self.peer_id,
            secret=self._secret,
            expect_worker_id=worker_id,
            config=self.config,
        )
        self._connections[address] = conn
        await self._nursery.start(self._run_connection, address, conn)
        return conn

    async def _run_connection(
        self, address: str, conn: PlaneConnection, *, task_status: trio.TaskStatus[None]
    ) -> None:
        try:
            await conn.run(task_status=task_status)
        finally:
            if self._connections.get(address) is conn:
                del self._connections[address]
            log.debug("KV connection to %s ended: %s", address, conn.reason)

    def statistics(self) -> KvTransferStats:
        return KvTransferStats(
            pulls_total=self._pulls,
            pull_failures_total=self._failures,
            bytes_total=self._bytes,
            connections=len(self._connections),
        )
