"""Children in sessions of their own keep this process's priority.

headwater starts its children with ``start_new_session`` (a Ctrl-C at the terminal
reaches the supervisor alone, and a child's whole process group can be stopped). On
Linux with ``kernel.sched_autogroup_enabled`` (the default on desktop and most server
kernels) every session is also a scheduling group of its own, and the CPU is shared
equally between groups at the groups' own nice value, 0, whatever the nice values of
the processes inside. So ``nice headwater worker`` used to start a vLLM that competed
with everything else at full weight (seen: two idle CPU vLLM workers spinning a whole
core each beside the test suite, their ``nice 10`` without effect). :func:`keep_niceness`
gives a started child's group this process's nice value.
"""

from __future__ import annotations

import os


def keep_niceness(pid: int) -> None:
    """Give the scheduling group of *pid* (a child that started a session of its own,
    or this process after ``setsid``) this process's nice value. Nothing to do at nice
    0, or without autogroups."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:  # 0 is the group's default already; raising a priority needs privileges
        set_session_nice(pid, nice)


def set_session_nice(pid: int, nice: int) -> None:
    """Set the nice value of *pid*'s session's scheduling group (Linux autogroups);
    nothing without them, or once *pid* has exited."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # not Linux, autogroups off, or the child has exited already
