"""The soak: a bounded run of mixed traffic that fails on a leak or a lost request.

Against each target (``serve``: ``python -m headwater serve``, what ``make serve``
runs; ``launch``: ``python -m headwater launch`` with a prefill and a decode worker
process over the TCP request plane), for ``--duration`` seconds (30 minutes by
default): short and long prompts (up to 40k tokens), unary and streaming, streams the
client closes after a few events, connections it resets during the upload, the wait
or the stream, invalid requests, and every minute a storm that resets every
connection in flight. Every process of the target is read every few seconds: RSS,
PSS and USS, open descriptors, threads (from ``/proc``) and live trio tasks (from its
own ``GET /debug/runtime``).

It fails (exit status 1) if idle RSS rose more than 5% between the end of the
warm-up and the end of the load, if any descriptor, trio task or thread is held at
the end that was not at the start, if any request was lost (it ended in neither a
response, nor a clean OpenAI-shaped error, nor the client's own doing), or if the
target was left in a bad state (requests in flight, KV held, a process died, an error
logged, an unclean exit). The rules, and why idle points: :mod:`scripts.soak.judge`.

    python -m scripts.soak                                  # both targets, 30 min each
    make soak ARGS="--targets serve --duration 120"
    python -m scripts.soak --render bench-results/soak-.../results.json --docs

Writes ``bench-results/soak-<timestamp>/`` (``results.json``, ``soak.png``, every
process's log); ``--docs`` also ``docs/img/soak.png`` and ``docs/data/soak.json``.
Loopback only, ports picked free, every wait bounded. docs/reliability.md has the
figures of a full run.

Modules: ``client`` (one request over h11, ended as planned, and its verdict), ``mix``
(the traffic), ``load`` (clients and storms), ``targets`` (starting and finding the
processes), ``procs`` and ``sampler`` (reading them), ``judge`` (the verdict, pure),
``run`` (the phases), ``report`` (figure and tables), ``cli``.
"""
