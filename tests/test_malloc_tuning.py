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
