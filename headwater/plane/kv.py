"""KV transfer on the request plane: both halves of a pull, and the decode side's pool.

A prefill worker holds the KV it computed under a transfer id and hands a
:class:`~headwater.wire.KvHandle` to the frontend; the decode worker named on the
next leg pulls the KV straight from the prefill worker::

    decode worker                                   prefill worker
    TcpKvTransfer.pull(handle)                      PlaneServer
      pull_kv(conn, transfer_id) ── kv_pull ──▶       serve_pull(source, transfer_id, send)
                                 ◀── kv_prompt ─        source.held_prompt(transfer_id)
                                 ◀── kv_data* ──        source.release_transfer(transfer_id)
                                 ◀── error ─────        (unknown or expired transfer)

``kv_prompt`` comes only when the pull asked for it (``pull_with_prompt``): the decode
leg's request came without its prompt (``GenerateRequest.prompt_in_kv``), which the
prefill worker kept with the KV, so the frontend sent the prompt over the plane once.

* :class:`KvSource` is what a prefill engine offers the plane (``release_transfer``);
  :class:`KvTransfer` what a decode engine pulls through (``pull``). In-process the
  pull is a method call on the source (``workers.runtime.kv_transfer``).
* :func:`pull_kv` and :func:`serve_pull` are the two halves of one pull on a
  connection; :class:`TcpKvTransfer` keeps one connection per prefill worker, opened
  on first use, shared by concurrent pulls, heartbeated like the frontend's, and
  dropped when it breaks (the next pull opens a new one). Its tasks live in the
  nursery of :func:`open_kv_transfer`.
* :class:`KvPeers` is where it may pull from: a handle names an address, which the
  decode worker dials, so without a check whoever can send it a request could make it
  connect anywhere its network reaches (SSRF). It dials only the prefill workers it
  knows: registered in etcd (``workers.runtime.registration.follow_prefill_workers``),
  listed in ``--kv-peers``, or, with neither, for a worker that itself listens on
  loopback (a one-host cluster), on loopback.
"""

from __future__ import annotations

import abc
import logging
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio

from headwater.plane.base import Disconnected, PlaneError, WorkerError
from headwater.plane.connection import (
    Connector,
    PlaneConfig,
    PlaneConnection,
    dial,
    tcp_connector,
)
from headwater.wire import Error, ErrorCode, KvHandle
from headwater.wire.addresses import is_loopback, parse_tcp_address
from headwater.wire.frames import Frame, KvData, KvPrompt, KvPull
from headwater.wire.tokens import token_array

log = logging.getLogger(__name__)


@runtime_checkable
class KvSource(Protocol):
    """What a prefill engine offers: the KV it holds, handed over once per transfer."""

    async def release_transfer(self, transfer_id: str) -> int:
        """Hand over and free the KV held under *transfer_id*; return its payload bytes.

        Raises :class:`~headwater.plane.base.WorkerError` (``kv_transfer_failed``) when
        the id is unknown, already pulled or expired.
        """
        ...

    def held_prompt(self, transfer_id: str) -> Sequence[int] | None:
        """The prompt's token ids held with *transfer_id* (its handle ``holds_prompt``),
        or None (unknown, released, or a source that keeps no prompts). Never blocks."""
        ...


class KvTransfer(abc.ABC):
    """How a decode engine fetches the KV a prefill worker holds for it.

    In-process this is a method call on the prefill engine; across processes it is a
    worker-to-worker stream. Both return the number of bytes moved.
    """

    @abc.abstractmethod
    async def pull(self, handle: KvHandle) -> int:
        """Fetch and release the KV behind *handle*; raise WorkerError on failure."""

    async def pull_with_prompt(self, handle: KvHandle) -> tuple[int, array[int]]:
        """:meth:`pull`, and the prompt's token ids the holder kept with the KV (for a
        request that came without them: ``GenerateRequest.prompt_in_kv``). Raises
        WorkerError (``kv_transfer_failed``) as :meth:`pull` does, or when the holder
        has no prompt of *handle*'s ``num_tokens`` tokens."""
        raise WorkerError(
            ErrorCode.KV_TRANSFER_FAILED, f"{type(self).__name__} cannot fetch a prompt"
        )


def check_prompt(handle: KvHandle, prompt: Sequence[int] | None) -> array[int]:
    """*prompt* as a token array, if it is the prompt *handle* names (its
    ``num_tokens`` tokens); else raise WorkerError (``kv_transfer_failed``)."""
    if prompt is None or len(prompt) != handle.num_tokens or not prompt:
        got = "none" if prompt is None else f"{len(prompt)} tokens"
        raise WorkerError(
            ErrorCode.KV_TRANSFER_FAILED,
            f"KV {handle.transfer_id} from {handle.worker_id}: expected the prompt's "
            f"{handle.num_tokens} tokens with it, got {got}",
        )
    return token_array(prompt)


# ---- one pull on a connection: the two halves --------------------------------------------


async def pull_kv(
    conn: PlaneConnection, transfer_id: str, *, prompt: bool = False
) -> tuple[int, array[int] | None]:
    """The client half: fetch the KV held under *transfer_id*; return the bytes received
    and, with *prompt*, the prompt's token ids the worker sent before them (None if it
    sent none: the caller decides what that means).

    Raises WorkerError (unknown or expired transfer), Disconnected. Cancellation
    sends a cancel, so the worker stops sending the payload.
    """
    async with conn.route(transfer_id, KvPull(transfer_id, prompt)) as route:
        received = 0
        ids: array[int] | None = None
        while True:
            msg = await route.next()
            if isinstance(msg, KvData):
                received += len(msg.data)
                last = msg.last
                # Its data may be a view of the connection's payload buffer, which the
                # next piece reuses only once nothing holds it (FrameDecoder).
                del msg
                if last:
                    route.done = True
                    return received, ids
            elif isinstance(msg, KvPrompt) and prompt and ids is None and not received:
                ids = token_array(msg.token_ids)
            elif isinstance(msg, Error):
                route.done = True
                raise WorkerError(msg.code, msg.message)
            else:
                raise Disconnected(f"unexpected {type(msg).__name__} in a KV transfer")


#: Queues one frame of a pull's answer on the server's connection (waits for budget).
SendFrame = Callable[[Frame], Awaitable[None]]


async def serve_pull(
    source: KvSource | None,
    transfer_id: str,
    send: SendFrame,
    *,
    piece: memoryview,
    prompt: bool = False,
) -> int:
    """The server half: release the KV and send it as ``kv_data`` pieces of at most
    ``len(piece)`` bytes (*piece* is a buffer of zeros: the simulated payload), or an
    error frame if *source* does not hold it. With *prompt*, the prompt's token ids held
    with it go first, in a ``kv_prompt`` (none held: an error, and the KV is freed).
    Returns the bytes sent (0 on a refusal).

    Raises ClosedResourceError when the connection closes meanwhile.
    """
    try:
        if source is None:
            raise WorkerError(ErrorCode.KV_TRANSFER_FAILED, "this worker holds no KV")
        # Read before the release, which forgets the hold; the ids stay the request's.
        ids = source.held_prompt(transfer_id) if prompt else None
        size = await source.release_transfer(transfer_id)
        if prompt and ids is None:
            raise WorkerError(
                ErrorCode.KV_TRANSFER_FAILED, f"no prompt held with transfer {transfer_id!r}"
            )
    except WorkerError as exc:
        await send(Error(transfer_id, ErrorCode.KV_TRANSFER_FAILED, exc.message))
        return 0
    if ids is not None:
        await send(KvPrompt(transfer_id, ids))
    sent = 0
    while True:
        n = min(len(piece), size - sent)
        sent += n
        await send(KvData(transfer_id, piece[:n], sent >= size))
        if sent >= size:
            return size


# ---- where a decode worker may pull from ------------------------------------------------


class KvPeers:
    """The prefill workers a decode worker may pull KV from.

    A handle passes when its (worker id, address) is registered (:meth:`register`, from
    etcd), or its address is in *static* (``--kv-peers``), or *loopback* is set (this
    worker listens on loopback: a one-host cluster) and its host is a loopback address.
    The worker id is checked again by the handshake (``expect_worker_id``), and the peer
    must prove the secret; a refused handle is a failed pull, nothing is dialled.
    """

    def __init__(self, static: Sequence[str] = (), *, loopback: bool = False) -> None:
        self.static = frozenset(static)
        self.loopback = loopback
        self._registered: dict[str, str] = {}  # worker id → address
        self.refused_total = 0

    def register(self, worker_id: str, address: str) -> None:
        self._registered[worker_id] = address

    def unregister(self, worker_id: str) -> None:
        self._registered.pop(worker_id, None)

    def check(self, handle: KvHandle) -> None:
        """Raise WorkerError (``kv_transfer_failed``) unless *handle* names a known peer."""
        if self._registered.get(handle.worker_id) == handle.address:
            return
        if handle.address in self.static:
            return
        if self.loopback:
            try:
                if is_loopback(parse_tcp_address(handle.address)[0]):
                    return
            except ValueError:
                pass
        self.refused_total += 1
        raise WorkerError(
            ErrorCode.KV_TRANSFER_FAILED,
            f"refusing to pull KV from {handle.address} ({handle.worker_id}): not a known "
            "prefill worker (registered in etcd, or in --kv-peers)",
        )


# ---- the decode worker's connections to prefill workers ---------------------------------


@dataclass(frozen=True, slots=True)
class KvTransferStats:
    pulls_total: int
    pull_failures_total: int
    bytes_total: int
    connections: int


class TcpKvTransfer(KvTransfer):
    """Pulls KV from prefill workers over TCP; made by :func:`open_kv_transfer`.

    *peer_id* and *role* identify this worker in the handshake; *secret* must match
    the prefill workers', and so must the CA of ``config.tls`` (mutual TLS, the prefill
    workers' advertised hosts checked). *pull_timeout* bounds one pull, connect included.
    *peers* says which prefill workers it may dial (None: any, for tests and tools
    that dial what they started themselves).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        peer_id: str,
        role: str = "decode",
        secret: bytes | None = None,
        config: PlaneConfig | None = None,
        pull_timeout: float = 30.0,
        peers: KvPeers | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.peers = peers
        self.role = role
        self.pull_timeout = pull_timeout
        self.config = config or PlaneConfig()
        self._secret = secret
        self._nursery = nursery
        self._connections: dict[str, PlaneConnection] = {}
        self._dialing: dict[str, trio.Lock] = {}
        self._pulls = 0
        self._failures = 0
        self._bytes = 0

    async def pull(self, handle: KvHandle) -> int:
        """Fetch and release the KV behind *handle*; return the payload bytes.

        Raises ``WorkerError("kv_transfer_failed")`` if the prefill worker cannot be
        reached, refuses the transfer, breaks off, or takes over ``pull_timeout``.
        """
        received, _ = await self._pull(handle, prompt=False)
        return received

    async def pull_with_prompt(self, handle: KvHandle) -> tuple[int, array[int]]:
        """:meth:`pull`, with the prompt the prefill worker kept (one ``kv_prompt``
        frame before the payload)."""
        received, ids = await self._pull(handle, prompt=True)
        assert ids is not None  # _pull checked it
        return received, ids

    async def _pull(self, handle: KvHandle, *, prompt: bool) -> tuple[int, array[int] | None]:
        try:
            if self.peers is not None:
                self.peers.check(handle)
            with trio.fail_after(self.pull_timeout):
                conn = await self._connection(handle)
                received, ids = await pull_kv(conn, handle.transfer_id, prompt=prompt)
            if prompt:
                ids = check_prompt(handle, ids)
        except (PlaneError, trio.TooSlowError, ValueError) as exc:
            self._failures += 1
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            raise WorkerError(
                ErrorCode.KV_TRANSFER_FAILED,
                f"pulling KV {handle.transfer_id} from {handle.worker_id} at "
                f"{handle.address}: {reason}",
            ) from exc
        self._pulls += 1
        self._bytes += received
        return received, ids

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
                connector = tcp_connector(address, self.config.tls)
                conn = await self._dial(address, handle.worker_id, connector)
            return conn

    async def _dial(self, address: str, worker_id: str, connector: Connector) -> PlaneConnection:
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


@asynccontextmanager
async def open_kv_transfer(
    *,
    peer_id: str,
    role: str = "decode",
    secret: bytes | None = None,
    config: PlaneConfig | None = None,
    pull_timeout: float = 30.0,
    peers: KvPeers | None = None,
) -> AsyncIterator[TcpKvTransfer]:
    """A :class:`TcpKvTransfer` whose connections live until the block ends."""
    async with trio.open_nursery() as nursery:
        yield TcpKvTransfer(
            nursery,
            peer_id=peer_id,
            role=role,
            secret=secret,
            config=config,
            pull_timeout=pull_timeout,
            peers=peers,
        )
        nursery.cancel_scope.cancel()
