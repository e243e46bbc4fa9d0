"""Children that stop when their supervisor is gone.

A supervisor (``headwater launch``, a frontend group, a worker with its vLLM) stops its
children itself, unless it is killed outright (SIGKILL, the OOM killer). Then they are
re-parented and would go on serving, holding their ports and registrations, with
nobody to stop them. The kernel's ``PR_SET_PDEATHSIG`` would tell them, but it fires
when the parent *thread* that started the child exits, and trio starts processes from
worker threads that come and go. So a child polls ``getppid()`` once a second and, once
its supervisor is gone, takes the path a SIGTERM takes (it drains and stops).

The supervisor names itself in the child's environment (:data:`SUPERVISOR_ENV`, set by
:func:`headwater.cluster.children.spawn`, by the zygote before it forks and by the vLLM
engine for its server): a child that looks only after its supervisor died still knows
whom it had. A program that cannot watch (etcd) runs under
:mod:`headwater.cluster.guard`, which watches for it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

import trio

log = logging.getLogger(__name__)

#: The pid of the process that started this one and stops it.
SUPERVISOR_ENV = "HEADWATER_SUPERVISOR_PID"

#: Seconds between two looks at the parent.
POLL_S = 1.0


def supervisor_env() -> dict[str, str]:
    """What a supervisor adds to its child's environment: its own pid."""
    return {SUPERVISOR_ENV: str(os.getpid())}


def supervisor_pid(environ: Mapping[str, str] = os.environ) -> int | None:
    """The supervisor this process must not outlive, or None (not started by one)."""
    value = environ.get(SUPERVISOR_ENV, "")
    return int(value) if value.isdigit() else None


def orphaned(supervisor: int) -> bool:
    """Whether *supervisor* is no longer this process's parent."""
    return os.getppid() != supervisor


async def terminate_when_orphaned(
    supervisor: int, shutdown: trio.Event | None = None, poll_s: float = POLL_S
) -> None:
    """Send ourselves SIGTERM once our parent is no longer *supervisor*; return then,
    or on *shutdown* (without it: run until cancelled)."""
    if shutdown is None:
        shutdown = trio.Event()
    while not shutdown.is_set():
        if orphaned(supervisor):
            log.warning("supervisor (pid %d) is gone: shutting down", supervisor)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        with trio.move_on_after(poll_s):
            await shutdown.wait()
