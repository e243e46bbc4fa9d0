"""One-off measurements behind figures in docs/, each run as ``python -m scripts.measure.X``
(``--help`` for its options; the doc that quotes a figure gives the command that made it).
``tests/test_scripts_smoke.py`` runs each at its smallest so that none rots.

- ``answer_parse``: the parse stage's cost per token of an agentic answer (docs/performance.md)
- ``cancel``: how long a cancelled request takes to free its worker (docs/fault-tolerance.md)
- ``exposition``: the cost of rendering /metrics (docs/observability.md)
- ``frame_mac``: the request plane's frame authentication per frame (docs/request-plane.md)
- ``idle_cpu``: an idle frontend's and worker's CPU (docs/observability.md)
- ``instrument_overhead``: the stall detector's cost per task step (docs/observability.md)
- ``parse``: a request body's parse into the request model (docs/performance.md)
- ``plane``: memory against TCP plane, one process, one loop (docs/request-plane.md)
- ``startup``: a frontend's and a worker's time to ready (docs/performance.md)
- ``steady``: a server's steady-state req/s, CPU and loop delay under load (docs/performance.md)
- ``tokenizer``: fastokens against HF tokenizers, exactness and speed (docs/tokenization.md)
- ``virtual_time``: what MockClock saves the tests (docs/testing.md)
- ``worker_heap``: a prefill and decode worker's Python heap over thousands of requests
  (docs/reliability.md)
"""
