"""Reading every process of a target every few seconds, labelled with the soak's phase.

One task, one read of every process per tick: ``/proc`` (:mod:`scripts.soak.procs`)
and, for the processes that have one, ``/debug/runtime`` on a connection of its own
that is closed before the next read, so the soak's own polls hold nothing open
between two ticks (and hold the same, one connection being answered, in each read).
Each process's ``/proc`` is read before its endpoint is asked, so the descriptors
counted never include that poll's connection. The reads of one tick run side by
side; a process that cannot be read (gone, its
endpoint silent for 5 s) gets a sample with the missing fields ``None`` and the error,
never a skipped tick.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from scripts.soak.client import get_json, tokenizer_cache
from scripts.soak.judge import Sample
from scripts.soak.procs import read_process
from scripts.soak.targets import Watched


class Sampler:
    """Owns the list of :class:`Sample`; ``phase`` is set by whoever runs the soak and
    labels every sample taken while it holds."""

    def __init__(self, processes: Sequence[Watched], t0: float, host: str = "127.0.0.1") -> None:
        self.processes = list(processes)
        self.t0 = t0
        self.host = host
        self.phase = "start"
        self.samples: list[Sample] = []

    async def run(
        self, interval_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """A read every *interval_s* until cancelled (the first before reporting started)."""
        await self.take()
        task_status.started()
        tick = trio.current_time()
        while True:
            tick += interval_s
            await trio.sleep_until(max(tick, trio.current_time()))
            await self.take()

    async def take(self) -> list[Sample]:
        """Read every process once now; append and return the samples."""
        phase, t_s = self.phase, trio.current_time() - self.t0
        out: list[Sample | None] = [None] * len(self.processes)
        async with trio.open_nursery() as nursery:
            for i, process in enumerate(self.processes):
                nursery.start_soon(self._read, process, phase, t_s, out, i)
        taken = [s for s in out if s is not None]
        self.samples.extend(taken)
        return taken

    async def _read(
        self, process: Watched, phase: str, t_s: float, out: list[Sample | None], i: int
    ) -> None:
        errors: list[str] = []
        try:  # /proc first: the poll's own connection is not among the descriptors read
            p = read_process(process.pid)
        except ProcessLookupError:
            out[i] = Sample(t_s, phase, process.name, error="the process is gone")
            return
        tasks = names = cache = None
        if process.runtime_port is not None:
            try:
                snap = await get_json(self.host, process.runtime_port, "/debug/runtime")
                tasks, names = int(snap["trio_tasks"]), dict(snap["tasks_by_name"])
            except (OSError, ValueError, KeyError, TypeError, trio.TooSlowError) as exc:
                errors.append(f"/debug/runtime: {type(exc).__name__}: {exc}")
        if process.role == "frontend" and process.runtime_port is not None:
            try:
                cache, _ = await tokenizer_cache(self.host, process.runtime_port)
            except (OSError, ValueError, KeyError, TypeError, trio.TooSlowError) as exc:
                errors.append(f"/dashboard/data: {type(exc).__name__}: {exc}")
        out[i] = Sample(
            t_s,
            phase,
            process.name,
            rss_bytes=p.rss_bytes,
            pss_bytes=p.pss_bytes,
            uss_bytes=p.uss_bytes,
            fds=p.fds,
            threads=p.threads,
            tasks=tasks,
            tasks_by_name=names,
            cache_bytes=cache,
            error="; ".join(errors) or None,
        )
