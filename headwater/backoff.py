"""Exponential backoff with full jitter, for reconnect and retry loops.

Shared by the frontend's discovery (re-watching etcd, reconnecting to workers) and
the workers' etcd registration (re-granting a lease).
"""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with full jitter.

    ``next()`` returns how long to wait before the next attempt: a uniform draw from
    ``[0, min(maximum, initial * factor**n)]`` after the n-th consecutive failure
    (never less than ``initial / 2``, so a hot loop is impossible). ``reset()`` after
    a success. Jitter keeps a fleet of workers from reconnecting in lockstep.
    """

    def __init__(
        self,
        initial: float = 0.1,  # seconds
        maximum: float = 10.0,  # seconds
        factor: float = 2.0,
        *,
        rng: random.Random | None = None,
    ) -> None:
        if initial <= 0 or maximum < initial or factor < 1:
            raise ValueError("need 0 < initial <= maximum and factor >= 1")
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.failures = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        cap = min(self.maximum, self.initial * self.factor ** min(self.failures, 64))
        self.failures += 1
        return max(self.initial / 2, self._rng.uniform(0, cap))

    def reset(self) -> None:
        self.failures = 0
