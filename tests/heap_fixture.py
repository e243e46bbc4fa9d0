"""``frozen_heap``: the test session's heap kept out of the cyclic collector's way.

Late in the suite the session holds hundreds of megabytes of objects, and a collection
of them in the middle of a test is a real stall of that test's event loop (0.14-0.56 s
seen, in hypothesis' own gc callback). The stall-detector tests measure stalls they
make themselves, so they freeze what exists before they start: collections then visit
only the objects a test allocates.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
