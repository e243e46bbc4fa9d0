"""headwater: a trio-based, structured-concurrency frontend for LLM inference serving.

This package holds what the frontend (:mod:`frontend`) and the workers (:mod:`workers`)
share, so that neither imports the other (``tests/test_layering.py`` checks it):

* :mod:`headwater.wire` — request-plane messages and the frame codec (no I/O);
* :mod:`headwater.plane` — the plane's shared types and its TCP connection layer;
* :mod:`headwater.etcd` — the etcd v3 client and the instance key layout (discovery);
* :mod:`headwater.instrumentation` — the stall detector and loop metrics;
* :mod:`headwater.cli`, :mod:`headwater.launch`, :mod:`headwater.bench` — the
  ``headwater`` command and its ``launch`` and ``bench`` subcommands.
"""

__version__ = "0.1.0"
