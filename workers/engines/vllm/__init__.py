"""The vLLM engine: a worker serves its requests with a vLLM server's token API.

The worker starts and supervises its own vLLM server (``--model PATH``) or attaches to
one (``--vllm-url``); prefill and decode workers hand vLLM's ``kv_transfer_params`` on
and vLLM moves the KV over NIXL. See docs/engines.md.
"""

from workers.engines.vllm.config import VllmConfig
from workers.engines.vllm.engine import VllmCounters, VllmEngine

__all__ = ["VllmConfig", "VllmCounters", "VllmEngine"]
