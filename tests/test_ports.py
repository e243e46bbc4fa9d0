"""headwater.ports: ports for children, chosen where client connections never land."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest

from headwater import ports


def test_ports_come_from_below_the_ephemeral_range_and_bind() -> None:
    low, high = ports.ephemeral_range()
    assert 1024 < low <= high
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == 50  # never the same port twice in one process
    for port in chosen:
        assert ports.LOWEST_PORT <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", chosen[0]))


def test_a_port_somebody_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            other = probe.getsockname()[1]
        picks: Iterator[int] = iter([taken, other])
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65535))
        monkeypatch.setattr(random, "randrange", lambda a, b: next(picks))
        assert not ports.port_free(taken)
        assert ports.free_port() == other


def test_a_low_ephemeral_range_leaves_the_choice_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 10, 60999))
    port = ports.free_port()
    assert port >= ports.LOWEST_PORT + 10  # the kernel's range, not below it
    assert ports.port_free(port)
