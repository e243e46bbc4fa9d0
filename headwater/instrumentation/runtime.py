"""What a running process holds right now: trio tasks, open descriptors, threads, memory.

A leak is something a process keeps after the work that needed it ended: a task left
waiting in some nursery, a socket nobody closes, memory that only grows. Three of
those four can be read from outside (``/proc/PID/fd``, ``/proc/PID/status``), but the
trio tasks cannot: they are objects inside the process. :func:`runtime_snapshot`
reads all four from inside, so that ``GET /debug/runtime`` (the frontend's and a
worker's metrics endpoint) answers them together, and the soak (``scripts/soak``)
compares them before and after a long mixed load.

Tasks are counted by walking the task tree from trio's root task through every
nursery (:func:`count_tasks`): every live task is in exactly one nursery of exactly
one parent, so the walk sees each once, trio's own system tasks included. The walk
is a few microseconds per hundred tasks and reads only attributes, so it runs on the
loop; the ``/proc`` reads are of pseudo-files that never block.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

#: Names beyond this many in ``tasks_by_name`` are summed under ``"<other>"``, so the
#: answer stays small whatever leaks.
MAX_TASK_NAMES = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    """One process at one moment, as ``GET /debug/runtime`` answers it."""

    pid: int
    #: Live trio tasks, the root task and trio's system tasks included.
    trio_tasks: int
    #: Live tasks by name (``Task.name``: the function's qualified name), the most
    #: common first; a leak shows up as one name whose count grows.
    tasks_by_name: dict[str, int] = field(default_factory=dict)
    #: Entries of ``/proc/self/fd`` (sockets, pipes, files, the epoll descriptor...);
    #: ``None`` where there is no ``/proc``.
    open_fds: int | None = None
    #: OS threads of the process (the loop, the tokenizer pool, trio's thread cache,
    #: the stall watchdog).
    threads: int = 0
    #: Resident set size, bytes (``/proc/self/statm``); ``None`` where there is no ``/proc``.
    rss_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "trio_tasks": self.trio_tasks,
            "tasks_by_name": dict(self.tasks_by_name),
            "open_fds": self.open_fds,
            "threads": self.threads,
            "rss_bytes": self.rss_bytes,
        }


def count_tasks(root: trio.lowlevel.Task) -> Counter[str]:
    """Every task in the tree under *root* (itself included), counted by name.

    Iterative, so a deep tree cannot hit the recursion limit. Call it on the loop
    thread: the tree is only consistent between two scheduling steps.
    """
    names: Counter[str] = Counter()
    stack = [root]
    while stack:
        task = stack.pop()
        names[task.name] += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return names


def open_fd_count(pid: int | str = "self") -> int | None:
    """Open file descriptors of *pid* (``/proc/PID/fd``), or ``None`` without ``/proc``.

    Raises ProcessLookupError if the process does not exist.
    """
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError as exc:
        if os.path.isdir("/proc/self/fd"):
            raise ProcessLookupError(pid) from exc
        return None


def rss_bytes() -> int | None:
    """This process's resident set size in bytes, or ``None`` without ``/proc``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def runtime_snapshot() -> RuntimeSnapshot:
    """This process now. Must be called from inside ``trio.run`` (on the loop thread)."""
    root = trio.lowlevel.current_root_task()
    names = count_tasks(root) if root is not None else Counter[str]()
    common = names.most_common()
    by_name = dict(common[:MAX_TASK_NAMES])
    if len(common) > MAX_TASK_NAMES:
        by_name["<other>"] = sum(n for _, n in common[MAX_TASK_NAMES:])
    return RuntimeSnapshot(
        pid=os.getpid(),
        trio_tasks=sum(names.values()),
        tasks_by_name=by_name,
        open_fds=open_fd_count(),
        threads=_thread_count(),
        rss_bytes=rss_bytes(),
    )


def _thread_count() -> int:
    """OS threads, from ``/proc/self/task``: ``threading`` does not see threads started
    outside Python (a Rust tokenizer's pool), the kernel does."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
