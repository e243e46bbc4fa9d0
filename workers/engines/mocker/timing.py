"""Dynamo's default mocker timing model, as pure functions.

The polynomials are Dynamo's fit of a real GPU (docs/architecture.md, "The interfaces":
the figures and Dynamo's defaults): a step that prefills ``T`` new prompt tokens costs
``prefill_ms(T)``; a pure decode step costs ``decode_ms(u)`` where ``u`` is the share of
the KV cache the running batch occupies (attention reads grow with it). Keeping the model
identical to the peer makes side-by-side benchmarks measure the frontends, not two
different simulators.
"""

from __future__ import annotations

# prefill_ms = A·T² + B·T + C
PREFILL_A = 4.209989e-07
PREFILL_B = 1.518344e-02
PREFILL_C = 16.50142

# decode_ms = max(DECODE_FLOOR, A·u² + B·u + C)
DECODE_A = -25.74
DECODE_B = 54.01
DECODE_C = 5.74
DECODE_FLOOR = 1.0


def prefill_ms(new_tokens: int) -> float:
    """Milliseconds for a step that computes *new_tokens* prompt tokens (at real speed)."""
    t = float(new_tokens)
    return PREFILL_A * t * t + PREFILL_B * t + PREFILL_C


def decode_ms(kv_utilization: float) -> float:
    """Milliseconds for a decode step when *kv_utilization* (0..1) of the KV cache is active."""
    u = kv_utilization
    return max(DECODE_FLOOR, DECODE_A * u * u + DECODE_B * u + DECODE_C)


def step_seconds(prefill_tokens: int, kv_utilization: float, speedup_ratio: float) -> float:
    """Duration of one scheduler step in seconds, after the speedup.

    A step that prefills anything costs ``prefill_ms(prefill_tokens)`` (decode tokens
    riding in the same batch are absorbed); otherwise ``decode_ms(kv_utilization)``.
    """
    ms = prefill_ms(prefill_tokens) if prefill_tokens > 0 else decode_ms(kv_utilization)
    return ms / 1000.0 / speedup_ratio
