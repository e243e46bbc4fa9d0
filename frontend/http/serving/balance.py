"""Balanced accepts: the processes of a frontend group take turns at their shared socket.

Why: the processes of a group (:mod:`headwater.cluster.frontend_group`) all wait on one
listening socket, and the kernel wakes every one of them for a new connection: the
first to call ``accept()`` gets it. With few clients that is a coin toss per connection,
and keep-alive makes each toss last as long as the client: four clients came out 3:1 or
4:0 in most runs (one process serving three or four while the other idled, at up to
half the group's speed) and 2:2 in the rest.

How: each process counts the connections it holds open in a slot of memory the group
shares (:class:`AcceptShares`, an anonymous shared mapping the supervisor makes before
it forks; a process writes its own slot only). A process that holds more connections
than the least loaded one does not accept at once: when a connection is pending it gives
the others :data:`GRACE_S` to take it, and takes it itself only if nobody did. So a
process that holds no more than any other accepts as before, and a stalled or saturated
process never keeps a connection waiting longer than the grace: one slow process does
not hold up the rest (the kernel's "a busy process accepts later" still works, bounded).

A slot reads :data:`ABSENT` while its process is not serving (starting, stopped, or
restarting after a crash: the supervisor marks it), so that the others never wait for a
process that is not there.
"""

from __future__ import annotations

import errno
import mmap
import select
import socket
import ssl

import trio

from frontend.http.serving.tcp_server import HttpStream

#: Seconds an over-share process leaves a pending connection to the others. A healthy
#: loop accepts within one batch of its tasks (a few ms when saturated).
GRACE_S = 0.02
#: Seconds between looks at the socket during the grace.
POLL_S = 0.001
#: A slot's value while its process is not serving.
ABSENT = 2**62

_SLOT = 8  # bytes: one signed 64-bit count per process


class AcceptShares:
    """One connection count per process of a group, in memory the group shares.

    Made before the processes fork (they inherit the mapping); every slot starts
    :data:`ABSENT`. Each count has one writer, its process (and the supervisor while
    the process is gone); readers may see a count a moment old, which only makes a turn
    a little less fair.
    """

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self._map = mmap.mmap(-1, processes * _SLOT)  # MAP_SHARED | MAP_ANONYMOUS
        self.counts = memoryview(self._map).cast("q")
        for i in range(processes):
            self.counts[i] = ABSENT

    def mark_absent(self, slot: int) -> None:
        """*slot*'s process is gone (the supervisor saw it exit)."""
        self.counts[slot] = ABSENT

    def balance(self, slot: int, fd: int) -> AcceptBalance:
        """The view of process *slot*, which accepts on the shared socket *fd*."""
        if not 0 <= slot < len(self.counts):
            raise ValueError(f"slot {slot} outside 0..{len(self.counts) - 1}")
        return AcceptBalance(self, slot, fd)


class AcceptBalance:
    """One process's share: its count, and whether it should wait its turn."""

    def __init__(self, shares: AcceptShares, slot: int, fd: int) -> None:
        self.shares = shares
        self.slot = slot
        #: The shared listening socket's descriptor (other listeners are not balanced).
        self.fd = fd

    def join(self) -> None:
        """This process serves from now on, holding no connection."""
        self.shares.counts[self.slot] = 0

    def leave(self) -> None:
        self.shares.counts[self.slot] = ABSENT

    def opened(self) -> None:
        self.shares.counts[self.slot] += 1

    def closed(self) -> None:
        self.shares.counts[self.slot] -= 1

    def ahead(self) -> bool:
        """True if another serving process holds fewer connections than this one."""
        counts = self.shares.counts
        mine = counts[self.slot]
        return any(c < mine for c in counts)

    async def wait_turn(self, sock: trio.socket.SocketType) -> None:
        """Return once a connection is pending on *sock* and this process should take
        it: at once if it is not :meth:`ahead`; else when it no longer is, or once the
        connection has waited :data:`GRACE_S` with nobody else taking it.

        The turn is decided when a connection is there, not before: counts change while
        a process waits (a connection of the other process closes)."""
        while True:
            await trio.lowlevel.wait_readable(sock)
            if not self.ahead():
                return
            deadline = trio.current_time() + GRACE_S
            while _pending(sock):
                if not self.ahead() or trio.current_time() >= deadline:
                    return
                await trio.sleep(POLL_S)


class BalancedListener(trio.abc.Listener[HttpStream]):
    """Connections from the listening *sock* (a non-blocking stdlib socket), accepted
    only on this process's turn (:meth:`AcceptBalance.wait_turn`), over TLS with
    *ssl_context* (the handshake is the caller's, as with ``trio.SSLListener``).

    Why not a wrapper around ``trio.SocketListener``: its ``accept()``, once called,
    waits for the next connection whoever's turn it is; a turn lost in that wait would
    take a connection out of turn. Here each attempt is one non-blocking ``accept()``.
    A connection counts from its accept, so that two arriving together are counted
    before the next turn; whoever serves it calls :meth:`AcceptBalance.closed`.
    """

    def __init__(
        self, sock: socket.socket, balance: AcceptBalance, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._sock = sock
        self.socket = trio.socket.from_stdlib_socket(sock)  # what turns wait on
        self.balance = balance
        self.ssl_context = ssl_context

    async def accept(self) -> HttpStream:
        while True:
            await self.balance.wait_turn(self.socket)
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                continue  # another process took it
            except OSError as exc:  # as trio.SocketListener sorts them
                if exc.errno in _CLOSED:
                    raise trio.ClosedResourceError from None
                if exc.errno in _IGNORABLE:
                    continue
                raise
            self.balance.opened()
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
            if self.ssl_context is None:
                return stream
            return trio.SSLStream(stream, self.ssl_context, server_side=True, https_compatible=True)

    async def aclose(self) -> None:
        self.socket.close()
        await trio.lowlevel.checkpoint()


#: accept() errors that mean the listener is closed, and those that are the one
#: connection's (trio.SocketListener's lists).
_CLOSED = frozenset({errno.EBADF, errno.ENOTSOCK})
_IGNORABLE = frozenset(
    getattr(errno, name)
    for name in (
        "EPERM",
        "ECONNABORTED",
        "EPROTO",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
    )
    if hasattr(errno, name)
)


def _pending(sock: trio.socket.SocketType) -> bool:
    """True if a connection waits on the listening *sock* (a non-blocking poll)."""
    readable, _, _ = select.select([sock.fileno()], [], [], 0)
    return bool(readable)
