"""What the soak reads of each process from outside: memory, descriptors, threads.

From ``/proc/PID``: ``status`` (RSS, threads), ``smaps_rollup`` (PSS, and USS as the
private pages: what the process alone holds, the figure a leak moves) and ``fd``.
Everything is a pseudo-file the kernel fills on read: quick, never blocking. The trio
tasks cannot be read from outside; they come from each process's own
``/debug/runtime`` (:mod:`headwater.instrumentation.runtime`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcReading:
    pid: int
    rss_bytes: int
    #: ``None`` where ``smaps_rollup`` cannot be read (an old kernel, another user's process).
    pss_bytes: int | None
    uss_bytes: int | None
    fds: int
    threads: int


def parse_status(text: str) -> tuple[int, int]:
    """(RSS bytes, threads) from ``/proc/PID/status``."""
    rss = threads = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            rss = int(value.split()[0]) * 1024
        elif key == "Threads":
            threads = int(value.split()[0])
    return rss, threads


def parse_smaps_rollup(text: str) -> tuple[int, int]:
    """(PSS bytes, USS bytes) from ``/proc/PID/smaps_rollup``; USS is the private pages,
    clean and dirty."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[key] = int(parts[0])
    if "Pss" not in kb:
        raise ValueError("no Pss line: not an smaps_rollup")
    return kb["Pss"] * 1024, (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024


def read_process(pid: int) -> ProcReading:
    """Read *pid* now. Raises ProcessLookupError if it no longer exists."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss, threads = parse_status(f.read())
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    pss = uss = None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            pss, uss = parse_smaps_rollup(f.read())
    except (OSError, ValueError):
        pass
    return ProcReading(pid, rss, pss, uss, fds, threads)


def alive(pid: int) -> bool:
    """Whether *pid* runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
