"""Network namespaces for partition tests: a host on the other end of a cable we can cut.

Each :class:`Netns` is a namespace of its own with one veth pair to the root namespace,
addressed from a /30 that nothing else on this machine uses (picked at random inside
the private ``10.213.0.0/16``, skipping any /30 an interface address or a route
already covers). ``outer`` is the root end's address, ``inner`` the namespace end's.
Nothing routes beyond the pair: the namespace has no default route, and only its
loopback and its veth are up. A command runs inside with ``ns.prefix`` (``ip netns
exec NAME``) before its argv.

:meth:`Netns.partition` drops every packet on the namespace's veth, both ways, with
iptables inside the namespace (the root namespace's tables are never touched);
:meth:`Netns.heal` removes the two rules. A dropped packet is silently gone, as on a
network that lost a host: no reset, no ICMP, so only timeouts notice.

Needs root, ``ip`` (iproute2) and ``iptables``. Without them the tests that need a
namespace are skipped with the reason — except under CI (``CI=true``), where that is a
failure, as for etcd (``etcd_fixture.require_etcd``).

Fixture: ``make_netns`` — a factory; every namespace, veth and rule it made is removed
when the test ends, pass or fail. Namespaces and veths carry the creating process's
pid in their names (``hwpart-<pid>-<n>``, ``hw<pid>x<n>``); one left by a process
that no longer exists (a run killed with SIGKILL) is removed the next time.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import trio

NETWORK = ipaddress.IPv4Network("10.213.0.0/16")
MAX_NAMESPACES = 4  # per test: bounded, like everything a test makes
_COMMAND_TIMEOUT = 10.0  # s for one ip / iptables command
_NAME = re.compile(r"^hwpart-(\d+)-\d+$")
_VETH = re.compile(r"^hw(\d+)[xy]\d+$")


def require_netns() -> None:
    """Skip the test unless namespaces can be made here (fail under CI=true)."""
    why = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif shutil.which("ip") is None or shutil.which("iptables") is None:
        why = "needs ip (Debian package iproute2) and iptables"
    if why is not None:
        _unavailable(why)


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI must provide it")
    pytest.skip(why)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
    )


def _check(*argv: str) -> None:
    done = _run(*argv)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


@dataclass
class Netns:
    """One namespace and its veth pair; made by the ``make_netns`` fixture."""

    name: str
    outer: str  # address of the veth end in the root namespace
    inner: str  # address of the veth end inside the namespace
    outer_dev: str
    inner_dev: str
    partitioned: bool = field(default=False, init=False)
    _port: int | None = field(default=None, init=False)  # partitioned from this port only

    @property
    def prefix(self) -> tuple[str, ...]:
        """Put before an argv to run it inside the namespace (``ip`` execs it)."""
        return ("ip", "netns", "exec", self.name)

    def _rules(self) -> list[list[str]]:
        if self._port is None:
            return [
                ["INPUT", "-i", self.inner_dev, "-j", "DROP"],
                ["OUTPUT", "-o", self.inner_dev, "-j", "DROP"],
            ]
        port = str(self._port)
        return [
            ["INPUT", "-i", self.inner_dev, "-p", "tcp", "--sport", port, "-j", "DROP"],
            ["OUTPUT", "-o", self.inner_dev, "-p", "tcp", "--dport", port, "-j", "DROP"],
        ]

    async def _iptables(self, op: str) -> None:
        for rule in self._rules():
            with trio.fail_after(_COMMAND_TIMEOUT):
                await trio.run_process([*self.prefix, "iptables", op, *rule], capture_stderr=True)

    async def partition(self, port: int | None = None) -> None:
        """Drop every packet in and out of the namespace's veth from now on; with
        *port*, only the TCP packets to and from that port on the other side (cut off
        from one service, say etcd, and not from the rest)."""
        if not self.partitioned:
            self.partitioned = True  # before: a half-applied partition is still healed
            self._port = port
            await self._iptables("-I")

    async def heal(self) -> None:
        """Let packets through again."""
        if self.partitioned:
            await self._iptables("-D")
            self.partitioned = False


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _sweep_stale() -> None:
    """Remove namespaces and veths left by test processes that no longer exist."""
    for line in _run("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if (m := _NAME.match(name)) and not _alive(int(m.group(1))):
            _run("ip", "netns", "delete", name)
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        parts = line.split(":")
        dev = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if (m := _VETH.match(dev)) and not _alive(int(m.group(1))):
            _run("ip", "link", "delete", dev)


def _taken() -> list[ipaddress.IPv4Network]:
    """Every network an IPv4 address or route of this machine covers."""
    taken = [
        ipaddress.IPv4Interface(word).network
        for line in _run("ip", "-o", "-4", "addr", "show").stdout.splitlines()
        for prev, word in itertools.pairwise(line.split())
        if prev == "inet"
    ]
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        words = [w for w in line.split() if w not in ("local", "broadcast", "unicast")]
        try:
            taken.append(ipaddress.IPv4Network(words[0] if words else "", strict=False))
        except ValueError:  # "default", a multicast or blackhole entry
            continue
    return taken


def _free_slot(rng: random.Random) -> ipaddress.IPv4Network:
    """A /30 of :data:`NETWORK` that no address or route on this machine covers."""
    taken = _taken()
    subnets = list(NETWORK.subnets(new_prefix=30))
    for _ in range(100):
        net = rng.choice(subnets)
        if not any(other.overlaps(net) for other in taken):
            return net
    raise RuntimeError(f"no free /30 in {NETWORK}")


def _create(index: int, rng: random.Random, cleanups: list[Callable[[], object]]) -> Netns:
    pid = os.getpid()
    net = _free_slot(rng)
    outer, inner = (str(a) for a in net.hosts())
    ns = Netns(f"hwpart-{pid}-{index}", outer, inner, f"hw{pid}x{index}", f"hw{pid}y{index}")
    done = _run("ip", "netns", "add", ns.name)
    if done.returncode != 0:
        _unavailable(f"cannot create a network namespace: {done.stderr.strip()}")
    cleanups.append(lambda: _check("ip", "netns", "delete", ns.name))
    _check("ip", "link", "add", ns.outer_dev, "type", "veth", "peer", "name", ns.inner_dev)
    # Deleting either end deletes the pair; the root end is the one sure to exist.
    cleanups.append(partial(_run, "ip", "link", "delete", ns.outer_dev))
    _check("ip", "link", "set", ns.inner_dev, "netns", ns.name)
    _check("ip", "addr", "add", f"{outer}/30", "dev", ns.outer_dev)
    _check("ip", "link", "set", ns.outer_dev, "up")
    inside = ("ip", "netns", "exec", ns.name)
    _check(*inside, "ip", "addr", "add", f"{inner}/30", "dev", ns.inner_dev)
    _check(*inside, "ip", "link", "set", ns.inner_dev, "up")
    _check(*inside, "ip", "link", "set", "lo", "up")
    return ns


@pytest.fixture
def make_netns() -> Iterator[Callable[[], Netns]]:
    """``make_netns()`` → a fresh :class:`Netns` (up to :data:`MAX_NAMESPACES` per test).

    Everything is removed when the test ends, whatever happened; start the processes
    that run inside in the test's nursery, so that they are gone by then.
    """
    require_netns()
    _sweep_stale()
    rng = random.Random()
    made: list[Netns] = []
    cleanups: list[Callable[[], object]] = []

    def make() -> Netns:
        if len(made) >= MAX_NAMESPACES:
            raise RuntimeError(f"at most {MAX_NAMESPACES} namespaces per test")
        ns = _create(len(made), rng, cleanups)
        made.append(ns)
        return ns

    try:
        yield make
    finally:
        errors = []
        for ns in made:
            if ns.partitioned:  # the rules would go with the namespace; be explicit
                for rule in ns._rules():
                    cleanups.append(partial(_run, *ns.prefix, "iptables", "-D", *rule))
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception as exc:  # keep removing the rest
                errors.append(exc)
        if errors:
            raise errors[0]
