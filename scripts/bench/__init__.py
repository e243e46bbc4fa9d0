"""Benchmark tooling: synthetic prompts, an out-of-process load generator, statistics.

Modules, one job each:

- :mod:`scripts.bench.prompts`: prompts with a measured DeepSeek-V4 token count, and
  pre-encoded request bodies for the chat and completions endpoints.
- :mod:`scripts.bench.loadgen`: :func:`~scripts.bench.loadgen.run_load` drives a server
  from a child process (aiohttp) and returns a :class:`~scripts.bench.loadgen.LoadResult`.
- :mod:`scripts.bench.stats`: percentiles and the one-line summary of a run.
- :mod:`scripts.bench.scrape`: event-loop metrics from ``/metrics`` and a process's CPU and
  peak RSS from ``/proc``.
- :mod:`scripts.bench.cli`: ``python -m scripts.bench.loadgen ...`` (also ``python -m
  scripts.bench``).

The suite behind ``make bench`` (:mod:`scripts.bench.run`) builds on them:

- :mod:`scripts.bench.suite`: the phases (calibration, main with Dynamo alternating,
  backend × mode matrix, profile) and the results they add up to.
- :mod:`scripts.bench.measure`: one run, sampled, reduced to a JSON record.
- :mod:`scripts.bench.machine`: machine facts and the encoders' single-thread rate.
- :mod:`scripts.bench.servers`: headwater and Dynamo servers, started and always stopped.
- :mod:`scripts.bench.timeline`: loop delay, RSS and CPU at 4 Hz during a run.
- :mod:`scripts.bench.profile`: CPU per request by pipeline stage (pyinstrument + /proc).
- :mod:`scripts.bench.report` and :mod:`scripts.bench.plots`: markdown and PNG charts.

Nothing is re-exported here on purpose: ``python -m scripts.bench.loadgen`` must be able to
run that module as ``__main__`` without the package having imported it first.
"""
