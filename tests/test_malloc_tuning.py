"""glibc keeps a worker's freed plane buffers instead of faulting them in per request."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: A child that frees and allocates 3 MiB 100 times (a worker's large plane buffers,
#: per request) and prints its minor page faults meanwhile.
_CHURN = textwrap.dedent("""
    import resource, sys
    from headwater.malloc_tuning import keep_freed_heap
    if sys.argv[1] == "tuned":
        assert keep_freed_heap()
    def churn():
        buffers = [bytearray(1 << 20) for _ in range(3)]
        del buffers
    churn(); churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return int(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_heap_is_kept_for_the_next_request() -> None:
    # Untuned, glibc trims the 3 MiB it got back and faults them in again: ~768 pages
    # per round. Tuned, the rounds after the first reuse the same pages.
    assert _faults("plain") > 100 * 256
    assert _faults("tuned") < 100


#: A child whose six threads allocate at once, then prints glibc's arenas (malloc_stats
#: writes an "Arena N:" block per arena to stderr).
_THREADS = textwrap.dedent("""
    import ctypes, sys, threading
    from headwater.malloc_tuning import limit_arenas
    if sys.argv[1] == "limited":
        print(limit_arenas(2))
    start = threading.Barrier(6)
    def allocate():
        start.wait()
        kept = [bytearray(4096) for _ in range(2000)]  # above pymalloc's sizes: malloc's
        start.wait()
    threads = [threading.Thread(target=allocate) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    sys.stderr.flush()
    ctypes.CDLL("libc.so.6").malloc_stats()
""")


def _arenas(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    """(what limit_arenas said, if called; the arenas the threads used)."""
    out = subprocess.run(
        [sys.executable, "-c", _THREADS, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )
    return out.stdout.strip(), out.stderr.count("Arena ")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_frontends_threads_share_two_arenas() -> None:
    # Untuned, each thread that allocates gets an arena of its own (up to 8 per core).
    assert _arenas("plain")[1] >= 4
    assert _arenas("limited") == ("True", 2)
    # An operator's MALLOC_ARENA_MAX wins over the frontend's default.
    assert _arenas("limited", {"MALLOC_ARENA_MAX": "3"}) == ("False", 3)
