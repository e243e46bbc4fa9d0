"""``python -m headwater.cluster.guard PROGRAM [ARGS...]``: run a program that cannot
watch its supervisor (etcd) and stop it once the supervisor is gone.

headwater's own children notice a dead supervisor themselves (:mod:`headwater.orphans`);
etcd does not, and would keep its ports and data directory after ``headwater launch``
was killed outright. The guard runs it as its child, passes SIGTERM, SIGINT and SIGHUP
on, and polls ``getppid()`` as the others do; once its supervisor is gone it sends the
program SIGTERM, and SIGKILL after :data:`KILL_AFTER` seconds. It exits as the program
did (a program killed by a signal: the guard kills itself with the same signal), so
its supervisor reads the program's own exit status.

The program is started from this single-threaded process's main thread, so its
``PR_SET_PDEATHSIG`` is safe to set: if the guard itself is killed (SIGKILL from its
supervisor, which then restarts it on the same ports), the kernel kills the program
too, as if the supervisor had killed it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from headwater.orphans import POLL_S, orphaned, supervisor_pid

#: Seconds the program gets to exit after SIGTERM once its supervisor is gone.
KILL_AFTER = 10.0

_PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


#: Looked up before the fork: the forked child only calls it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_the_guard() -> None:
    """In the forked program, before exec: killed when the guard's thread exits."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m headwater.cluster.guard PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    supervisor = supervisor_pid()
    try:
        program = subprocess.Popen(argv, preexec_fn=_die_with_the_guard)
    except OSError as exc:
        print(f"guard: cannot run {argv[0]}: {exc}", file=sys.stderr)
        return 127

    def forward(signum: int, _frame: FrameType | None) -> None:
        program.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    kill_at: float | None = None
    while True:
        try:
            status = program.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if kill_at is None and supervisor is not None and orphaned(supervisor):
            print(
                f"guard: supervisor (pid {supervisor}) is gone: stopping {argv[0]}",
                file=sys.stderr,
                flush=True,
            )
            program.terminate()
            kill_at = time.monotonic() + KILL_AFTER
        elif kill_at is not None and time.monotonic() > kill_at:
            program.kill()
    if status < 0:  # killed by a signal: so are we, for the supervisor to read
        if -status in FORWARDED:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status  # a signal whose default is not to die
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
