"""headwater: a trio-based, structured-concurrency frontend for LLM inference serving.

This package holds what the frontend and the workers share: the command line
(:mod:`headwater.cli`) and the request-plane wire types (:mod:`headwater.wire`).
"""

__version__ = "0.1.0"
