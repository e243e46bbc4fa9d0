"""A vLLM plugin: vLLM's engine core stops once the worker that hosts it is gone.

A worker running vLLM in-process (:mod:`.in_process`) is the parent of vLLM's engine
core. Stopped, it stops the core; killed outright (SIGKILL, the OOM killer) it cannot,
and the core would go on holding its memory and cores with nobody to serve. vLLM loads
its ``vllm.general_plugins`` entry points in every process it starts (headwater's
``pyproject.toml`` declares this one), so the core runs :func:`register` early: if its
parent is the worker named in :data:`HOST_ENV`, a daemon thread polls ``getppid()``
and, once the worker is gone, sends the core SIGTERM (vLLM's own shutdown), then
SIGKILL after :data:`GRACE_S`. The same reason and the same poll as
:mod:`headwater.orphans` (the kernel's parent-death signal follows the parent
*thread*); the standard library only, since this runs inside vLLM's processes.

The core also leaves the worker's session for one of its own (``setsid``), at the
worker's nice value (:func:`headwater.sessions.keep_niceness`). On Linux with
autogroups, a session is a scheduling group and the CPU is shared between groups: in
the worker's own group, the core's compute threads would outnumber the worker's loop
and starve it (the probe of docs/performance-vllm.md); in a group of its own the loop
gets its share whatever the core does, as beside a ``vllm serve`` started in its own
session.

Anywhere else (the worker itself, a ``vllm serve`` the worker started, whose launcher
watches on its own) it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from headwater.sessions import keep_niceness

#: The pid of the worker hosting vLLM in-process, set in its environment before vLLM
#: starts its engine core (which inherits it).
HOST_ENV = "HEADWATER_VLLM_HOST_PID"
POLL_S = 1.0  # seconds between two looks at the parent
GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL

_watching = False


def register() -> None:
    """vLLM's plugin hook: start the watch in a child of the hosting worker."""
    global _watching
    host = os.environ.get(HOST_ENV, "")
    if _watching or not host.isdigit() or os.getppid() != int(host):
        return
    _watching = True
    _own_scheduling_group()
    threading.Thread(
        target=_stop_when_orphaned, args=(int(host),), name="headwater-host-watch", daemon=True
    ).start()


def _own_scheduling_group() -> None:
    """A session of the core's own, so a scheduling group of its own, at the worker's
    nice value (the core inherited it); nothing if it leads a session already."""
    try:
        os.setsid()
    except OSError:
        return
    keep_niceness(os.getpid())


def _stop_when_orphaned(host: int) -> None:
    """Blocking sleeps on purpose: a daemon thread of vLLM's process, no trio here."""
    while os.getppid() == host:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
