"""Balanced accepts (:mod:`frontend.http.serving.balance`): the processes of a group take
turns at their shared socket.

Two "processes" here are two listeners in one trio run, each on its own descriptor of
one listening socket (``dup``), each with its slot in one :class:`AcceptShares`: the
kernel wakes both for a connection, as it wakes two processes. Real loopback sockets,
real time, generous bounds. The group itself is tested in test_frontend_processes.py.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from frontend.http.serving.balance import (
    ABSENT,
    GRACE_S,
    AcceptBalance,
    AcceptShares,
    BalancedListener,
)
from frontend.http.serving.tcp_server import HttpStream


def test_slots_start_absent_and_only_a_lower_count_makes_a_process_wait() -> None:
    shares = AcceptShares(3)
    assert list(shares.counts) == [ABSENT] * 3
    first, second = shares.balance(0, fd=3), shares.balance(1, fd=3)
    first.join()
    assert not first.ahead()  # the others are not serving: nobody to wait for
    first.opened()
    assert not first.ahead()
    second.join()
    assert first.ahead()  # 1 against 0
    assert not second.ahead()
    second.opened()
    assert not first.ahead()  # a tie: both accept
    assert not second.ahead()
    first.leave()
    assert shares.counts[0] == ABSENT
    second.opened()
    assert not second.ahead()  # an absent process holds nothing back
    shares.mark_absent(1)
    assert list(shares.counts) == [ABSENT] * 3
    with pytest.raises(ValueError):
        shares.balance(3, fd=3)
    with pytest.raises(ValueError):
        AcceptShares(0)


class Process:
    """One side: a balanced listener on its own descriptor, holding what it accepts."""

    def __init__(self, sock: socket.socket, balance: AcceptBalance) -> None:
        self.listener = BalancedListener(sock, balance)
        self.balance = balance
        self.held: list[HttpStream] = []

    async def serve(self, *, join: bool = True) -> None:
        if join:
            self.balance.join()
        while True:
            self.held.append(await self.listener.accept())  # counted by the listener


@asynccontextmanager
async def group(slots: int) -> AsyncIterator[tuple[int, AcceptShares, list[Process]]]:
    """A listening socket on loopback and a :class:`Process` per slot, not started;
    every socket closed on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    shares = AcceptShares(slots)
    processes = [
        Process(sock if i == 0 else sock.dup(), shares.balance(i, sock.fileno()))
        for i in range(slots)
    ]
    try:
        yield sock.getsockname()[1], shares, processes
    finally:
        for p in processes:
            for stream in p.held:
                await trio.aclose_forcefully(stream)
            await p.listener.aclose()
        for client in CLIENTS:
            await trio.aclose_forcefully(client)
        CLIENTS.clear()


#: Every client connection a test opened, closed by :func:`group`.
CLIENTS: list[trio.SocketStream] = []


async def connect(port: int, clients: list[trio.SocketStream]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    CLIENTS.append(stream)
    clients.append(stream)


async def connect_in_turn(port: int, n: int, processes: list[Process]) -> None:
    """*n* clients one after the other, each once the last is held (as a request's
    round trip would have it)."""
    clients: list[trio.SocketStream] = []
    for _ in range(n):
        await connect(port, clients)
        while sum(len(p.held) for p in processes) < len(clients):
            await trio.sleep(0.001)


async def test_keep_alive_clients_are_shared_evenly() -> None:
    async with group(2) as (port, shares, processes), trio.open_nursery() as nursery:
        for p in processes:
            nursery.start_soon(p.serve)
        with trio.fail_after(10):
            await connect_in_turn(port, 6, processes)
        assert [len(p.held) for p in processes] == [3, 3]
        assert list(shares.counts) == [3, 3]
        nursery.cancel_scope.cancel()


async def test_connections_arriving_together_are_shared_too() -> None:
    async with group(2) as (port, _, processes), trio.open_nursery() as nursery:
        for p in processes:
            nursery.start_soon(p.serve)
        clients: list[trio.SocketStream] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as connecting:
                for _ in range(8):
                    connecting.start_soon(connect, port, clients)
            while sum(len(p.held) for p in processes) < 8:
                await trio.sleep(0.001)
        assert sorted(len(p.held) for p in processes) == [4, 4]
        nursery.cancel_scope.cancel()


async def test_a_process_ahead_takes_a_connection_nobody_else_takes() -> None:
    async with group(2) as (port, shares, processes), trio.open_nursery() as nursery:
        busy, stalled = processes
        stalled.balance.join()  # serving, holding nothing, but it never accepts
        busy.balance.join()
        busy.balance.opened()  # one connection ahead of it
        nursery.start_soon(partial(busy.serve, join=False))
        clients: list[trio.SocketStream] = []
        start = trio.current_time()
        with trio.fail_after(5):
            await connect(port, clients)
            while not busy.held:
                await trio.sleep(0.001)
        waited = trio.current_time() - start
        assert waited >= GRACE_S * 0.9  # it left the connection to the other first
        assert list(shares.counts) == [2, 0]
        nursery.cancel_scope.cancel()


async def test_a_process_ahead_accepts_at_once_when_the_others_are_absent() -> None:
    async with group(2) as (port, shares, processes), trio.open_nursery() as nursery:
        alone = processes[0]
        nursery.start_soon(alone.serve)
        with trio.fail_after(5):
            await connect_in_turn(port, 3, processes)
        assert shares.counts[1] == ABSENT
        assert len(alone.held) == 3
        nursery.cancel_scope.cancel()


async def test_a_process_that_falls_behind_accepts_again() -> None:
    async with group(2) as (port, _, processes), trio.open_nursery() as nursery:
        first = processes[0]
        for p in processes:
            nursery.start_soon(p.serve)
        clients: list[trio.SocketStream] = []
        with trio.fail_after(10):
            await connect_in_turn(port, 4, processes)
            # two of the first process's clients leave: it is behind now, and takes both
            # of the next two connections
            for stream in first.held[:2]:
                await stream.aclose()
                first.balance.closed()  # as the serving path does when a connection ends
            del first.held[:2]
            for _ in range(2):
                await connect(port, clients)
                await trio.sleep(0.05)
        assert [len(p.held) for p in processes] == [2, 2]
        nursery.cancel_scope.cancel()
