"""A process's memory as the kernel accounts it: RSS, PSS and USS.

RSS counts every page a process has mapped, its own and those it shares, so the RSS
of processes that share pages (a zygote's children, ``headwater serve --processes N``)
adds up to more than they use. Linux also says, per process
(``/proc/<pid>/smaps_rollup``):

* **PSS** (proportional set size): each page divided by the number of processes that
  map it. The PSS of a group adds up to the memory the group really holds.
* **USS** (unique set size): the pages this process alone maps (private clean +
  private dirty). What the machine would get back if it exited.

Reading ``smaps_rollup`` walks the process's page tables in the kernel: a millisecond
or a few for a frontend-sized process, with the GIL released. Read it in a thread from
an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

_FIELDS = {"Rss", "Pss", "Private_Clean", "Private_Dirty", "Shared_Clean", "Shared_Dirty"}


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """One process's memory, in bytes."""

    pid: int
    rss: int
    pss: int
    uss: int  # private clean + private dirty

    @property
    def shared(self) -> int:
        """What RSS counts that others map too."""
        return self.rss - self.uss

    def to_mb(self) -> dict[str, float | int]:
        """``{"pid", "rss_mb", "pss_mb", "uss_mb"}``, MB rounded to 0.1 (JSON-ready)."""
        return {
            "pid": self.pid,
            "rss_mb": round(self.rss / 2**20, 1),
            "pss_mb": round(self.pss / 2**20, 1),
            "uss_mb": round(self.uss / 2**20, 1),
        }


def parse_smaps_rollup(text: str, pid: int) -> MemoryUsage:
    """The figures of one ``smaps_rollup`` text (pure). Raises ValueError without them."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            kb[key] = int(rest.split()[0])
    if "Rss" not in kb or "Pss" not in kb:
        raise ValueError(f"no Rss/Pss in smaps_rollup of {pid}")
    return MemoryUsage(
        pid=pid,
        rss=kb["Rss"] * 1024,
        pss=kb["Pss"] * 1024,
        uss=(kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024,
    )


def read_memory(pid: int | str = "self") -> MemoryUsage:
    """*pid*'s memory now (``"self"``: this process). Blocking (see the module docstring).

    Raises ProcessLookupError if the process does not exist, PermissionError if it is
    not ours to read, ValueError where the kernel has no ``smaps_rollup`` (before 4.14).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    return parse_smaps_rollup(text, pid if isinstance(pid, int) else os.getpid())


def trim_heap() -> None:
    """Give the memory malloc holds free back to the OS (glibc's ``malloc_trim``; a
    no-op elsewhere). Blocking: it walks every arena, ~1 ms.

    Why: glibc keeps what is freed for reuse, in every thread's arena. A frontend's
    tokenizer warm-up (one encode per pool thread, then the loop's) leaves ~30-50 MB of
    such buffers per process: RSS and USS that nothing uses until the next long prompt.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
