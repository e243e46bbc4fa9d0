"""The vLLM engine: a worker serves its requests with a vLLM server's token API.

The worker starts and supervises its own vLLM server (``--model PATH``) or attaches to
one (``--vllm-url``); prefill and decode workers hand vLLM's ``kv_transfer_params`` on
and vLLM moves the KV over NIXL. See docs/engines.md.

The names below load on first use: ``python -m workers.engines.vllm.launcher`` runs
inside every vLLM server a worker starts, and must not import the engine (httpx, trio)
there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engines.vllm.config import VllmConfig
    from workers.engines.vllm.engine import VllmCounters, VllmEngine

__all__ = ["VllmConfig", "VllmCounters", "VllmEngine"]

_WHERE = {
    "VllmConfig": "workers.engines.vllm.config",
    "VllmCounters": "workers.engines.vllm.engine",
    "VllmEngine": "workers.engines.vllm.engine",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
