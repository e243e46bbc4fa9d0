"""The host's CPU pressure: how much of the time some task waited for a CPU.

Linux's pressure stall information (PSI, ``/proc/pressure/cpu``) keeps, since boot, the
microseconds during which at least one runnable task had no CPU (its ``some`` line's
``total``). Sampled before and after a stall, the difference over the time between says
whether the whole machine was short of CPUs then: the stall detector records it beside the
loop thread's own wait (:mod:`headwater.instrumentation.watchdog`), so a stall made by
another process's load is told apart from one of this process's making.

Read with ``pread`` on a descriptor kept open (a few µs); absent where the kernel has no
PSI (not Linux, before 4.20, or ``psi=0``): then :meth:`CpuPressure.total` is None.
"""

from __future__ import annotations

import os
from contextlib import suppress
from typing import Final

PSI_CPU: Final = "/proc/pressure/cpu"


class CpuPressure:
    """The ``some`` total of ``/proc/pressure/cpu``, in seconds, read on demand.

    Any thread may call :meth:`total`; :meth:`close` releases the descriptor.
    """

    def __init__(self, path: str = PSI_CPU) -> None:
        self._fd: int | None = None
        with suppress(OSError):
            self._fd = os.open(path, os.O_RDONLY)
        if self.total() is None:
            self.close()

    def total(self) -> float | None:
        """Seconds during which some task waited for a CPU, since boot; None if unknown."""
        if self._fd is None:
            return None
        try:
            text = os.pread(self._fd, 256, 0)
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(b"some "):
                for field in line.split():
                    if field.startswith(b"total=") and field[6:].isdigit():
                        return int(field[6:]) / 1e6
        return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
