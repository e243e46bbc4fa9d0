"""Where a frontend's CPU goes per request, by pipeline stage.

Two sources, combined by :func:`stage_costs`:

- **Per-thread CPU** from ``/proc/<pid>/task/*/stat`` (:func:`read_threads`): the loop
  thread (the main thread) apart from the tokenizer threads (trio's ``Trio thread N``
  and the encoders' own pools, ``fastokens-*`` / rayon) and the rest (the stall
  watchdog). Exact, cheap, taken in every headwater run.
- **Stage shares of the loop thread** from a pyinstrument session of the frontend
  (:func:`attribute`): each stack sample is given to the *innermost* frame that belongs
  to a stage (:func:`stage_of`): ``frontend/http/*`` → receive+parse or stream out,
  ``frontend/preprocess/{template,messages,jinja,deepseek_v4}`` → template,
  ``frontend/preprocess/{pool,tokenizer}`` → tokenize, ``frontend/router`` +
  ``headwater/plane`` → route, ``frontend/postprocess`` → stream out (detokenize),
  ``workers/*`` → the in-process mocker. Samples of the loop
  idling in ``epoll`` are dropped; hypercorn/h11/Quart frames with no stage frame inside
  them are split by function name (reads → receive+parse, writes → stream out).

pyinstrument samples wall time on the main thread, so the shares are of the loop
thread's busy time; the milliseconds come from multiplying them by its measured CPU.
The profiler slows the process down (its overhead is reported next to the figures).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

#: Stage names in report order.
STAGES: tuple[str, ...] = (
    "receive+parse",
    "template",
    "tokenize",
    "route",
    "engine (in-process mocker)",
    "stream out",
    "observability",
    "HTTP server + trio (other)",
)
IDLE = "idle"

# (path fragment, stage): the first fragment found in a frame's file path decides.
_STAGE_FILES: tuple[tuple[str, str], ...] = (
    ("/frontend/preprocess/template", "template"),
    ("/frontend/preprocess/messages", "template"),
    ("/frontend/preprocess/jinja", "template"),
    ("/frontend/preprocess/deepseek_v4", "template"),
    ("/frontend/preprocess/pool", "tokenize"),
    ("/frontend/preprocess/tokenizer", "tokenize"),
    ("/frontend/router/", "route"),
    ("/headwater/plane/", "route"),
    ("/frontend/postprocess/", "stream out"),
    ("/frontend/http/responses", "stream out"),
    ("/frontend/http/schema", "receive+parse"),
    ("/frontend/http/errors", "receive+parse"),
    ("/frontend/http/observability", "observability"),
    ("/frontend/metrics", "observability"),
    ("/headwater/instrumentation/", "observability"),
    ("/prometheus_client/", "observability"),
    ("/workers/", "engine (in-process mocker)"),
)
# Functions of the files that hold more than one stage.
_STAGE_FUNCTIONS: Mapping[str, Mapping[str, str]] = {
    "/frontend/http/app": {
        "_parse": "receive+parse",
        "_serve": "receive+parse",
        "chat": "receive+parse",
        "completions": "receive+parse",
        "generate": "receive+parse",
        "_serve_openai": "receive+parse",
        "_unary": "stream out",
        "_stream": "stream out",
        "json_response": "stream out",
        "error_response": "stream out",
    },
    "/frontend/http/serving/tcp_server": {
        "_read_data": "receive+parse",
        "protocol_send": "stream out",
    },
    "/frontend/pipeline": {
        "preprocess": "template",
        "_render": "template",
        "preprocess_tokens": "receive+parse",
        "_sampling": "receive+parse",
        "generate": "stream out",
        "tokens": "stream out",
        "_token_stream": "route",
        "_one_attempt": "route",
        "_prefill": "route",
        "_stream_on": "route",
        "_pick": "route",
    },
}
_FRAMEWORK = re.compile(r"/(hypercorn|h11|quart|quart_trio|werkzeug|wsproto|h2)/")
_WRITE = re.compile(r"send|write|flush|respon", re.IGNORECASE)
_READ = re.compile(r"recv|receive|read|data_received|next_event|request|body", re.IGNORECASE)
_IDLE_FUNCTIONS = frozenset({"get_events"})  # trio's epoll/kqueue wait...
_IDLE_LEAVES = frozenset({"epoll.poll", "kqueue.control", "select.select"})  # ...its C call


def _split(frame_id: str) -> tuple[str, str]:
    """pyinstrument frame identifier ``function\\x00path\\x00line...`` → (function, path)."""
    parts = frame_id.split("\x00")
    return parts[0], parts[1] if len(parts) > 1 else ""


def stage_of(stack: Sequence[str]) -> str:
    """The stage of one sample; *stack* holds frame identifiers, outermost first."""
    if not stack:
        return IDLE
    for frame_id in stack[-2:]:
        function, path = _split(frame_id)
        if function in _IDLE_LEAVES or (function in _IDLE_FUNCTIONS and "/trio/" in path):
            return IDLE
    framework: str | None = None
    for frame_id in reversed(stack):
        function, path = _split(frame_id)
        for fragment, functions in _STAGE_FUNCTIONS.items():
            if fragment in path and function in functions:
                return functions[function]
        for fragment, stage in _STAGE_FILES:
            if fragment in path:
                return stage
        if framework is None and _FRAMEWORK.search(path):
            if _WRITE.search(function):
                framework = "stream out"
            elif _READ.search(function):
                framework = "receive+parse"
    return framework or "HTTP server + trio (other)"


@dataclass(frozen=True, slots=True)
class StageShares:
    """Busy samples of the loop thread by stage (seconds of samples) in one window."""

    seconds: Mapping[str, float]
    idle_s: float

    @property
    def busy_s(self) -> float:
        return sum(self.seconds.values())

    def share(self, stage: str) -> float:
        busy = self.busy_s
        return self.seconds.get(stage, 0.0) / busy if busy > 0 else 0.0


def attribute(
    records: Iterable[tuple[Sequence[str], float]],
    *,
    window: tuple[float, float] | None = None,
) -> StageShares:
    """Sum sample times by :func:`stage_of` over pyinstrument ``frame_records``.

    Samples are in time order and each carries the time since the previous one, so the
    running sum is the offset from the session start; *window* (offsets in seconds)
    keeps only the samples inside it (e.g. the measured run, not start-up).
    """
    seconds: dict[str, float] = {}
    idle = 0.0
    clock = 0.0
    for stack, duration in records:
        clock += duration
        if window is not None and not window[0] <= clock <= window[1]:
            continue
        stage = stage_of(stack)
        if stage == IDLE:
            idle += duration
        else:
            seconds[stage] = seconds.get(stage, 0.0) + duration
    return StageShares(seconds, idle)


def load_session(path: Path) -> tuple[float, list[tuple[list[str], float]]]:
    """A ``.pyisession`` file → (start unix time, frame records). Raises OSError/ValueError."""
    from pyinstrument.session import Session

    session = Session.load(str(path))
    return session.start_time, [(list(stack), float(t)) for stack, t in session.frame_records]


# --- per-thread CPU -----------------------------------------------------------------

_TOKENIZER_THREADS = re.compile(r"^(Trio thread|fastokens|tokenizers|rayon)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ThreadCpu:
    """CPU seconds by thread group (of a process so far, or used over an interval)."""

    loop_s: float  # the main thread, which runs the trio loop
    tokenizer_s: float  # tokenizer pool threads and the encoders' own threads
    other_s: float  # everything else (stall watchdog, ...)

    @property
    def total_s(self) -> float:
        return self.loop_s + self.tokenizer_s + self.other_s


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """One process's threads at one moment: thread id → (group, CPU seconds so far)."""

    threads: Mapping[int, tuple[str, float]]

    def since(self, earlier: ThreadSample) -> ThreadCpu:
        """CPU each thread used since *earlier*, summed by group.

        Per thread, because pool threads come and go (trio retires idle ones): a thread
        that started in between counts from zero; one that ended in between is missing
        from this sample, so its last moments are lost (an underestimate, never negative).
        """
        totals = {"loop": 0.0, "tokenizer": 0.0, "other": 0.0}
        for tid, (group, cpu) in self.threads.items():
            before = earlier.threads.get(tid)
            totals[group] += cpu - (before[1] if before and before[0] == group else 0.0)
        return ThreadCpu(totals["loop"], totals["tokenizer"], totals["other"])


def read_threads(pid: int) -> ThreadSample:
    """Sample *pid*'s threads' CPU time. Raises ProcessLookupError if *pid* is gone."""
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # the thread ended while we looked
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        if int(tid) == pid:
            group = "loop"
        elif _TOKENIZER_THREADS.match(comm):
            group = "tokenizer"
        else:
            group = "other"
        threads[int(tid)] = (group, cpu)
    return ThreadSample(threads)


# --- the combination ------------------------------------------------------------------


def stage_costs(shares: StageShares, cpu: ThreadCpu, requests: int) -> dict[str, float]:
    """Milliseconds of CPU per request by stage.

    The loop thread's CPU is split by *shares*; the tokenizer threads' CPU is added to
    ``tokenize``; other threads are reported as ``other threads``. Raises ValueError
    for ``requests < 1``.
    """
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    per_req = 1e3 / requests
    costs = {stage: shares.share(stage) * cpu.loop_s * per_req for stage in STAGES}
    costs["tokenize"] += cpu.tokenizer_s * per_req
    costs["other threads"] = cpu.other_s * per_req
    return costs
