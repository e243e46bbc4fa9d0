"""The simulated ("mocker") engine: Dynamo's timing model over a paged KV cache.

Lets the whole serving stack run, and be benchmarked, without a GPU.
"""

from workers.engines.mocker.config import MockerConfig
from workers.engines.mocker.engine import MockerEngine
from workers.engines.mocker.scheduler import MockerCounters

__all__ = ["MockerConfig", "MockerCounters", "MockerEngine"]
