"""headwater.sessions: a child in a session of its own keeps its parent's niceness."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import os, subprocess, sys
from headwater.sessions import keep_niceness
os.nice(int(sys.argv[1]))
child = subprocess.Popen(["sleep", "30"], start_new_session=True)
try:
    before = open(f"/proc/{child.pid}/autogroup").read().split()[-1]
    keep_niceness(child.pid)
    after = open(f"/proc/{child.pid}/autogroup").read().split()[-1]
    print(before, after)
finally:
    child.kill()
    child.wait()
"""


def _autogroups() -> None:
    if not Path("/proc/self/autogroup").exists():
        why = "this kernel schedules without autogroups (kernel.sched_autogroup_enabled)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI's machine has them")
        pytest.skip(why)


@pytest.mark.slow
@pytest.mark.parametrize(("nice", "want"), [(7, "7"), (0, "0")])
def test_a_new_sessions_group_gets_the_parents_nice(nice: int, want: str) -> None:
    _autogroups()
    argv = [sys.executable, "-c", CHILD, str(nice)]
    repo = Path(__file__).parent.parent
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30, cwd=repo)
    before, after = out.stdout.split()
    assert before == "0"  # what a new session gets, whatever its processes' nice
    assert after == want
