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

Nothing is re-exported here on purpose: ``python -m scripts.bench.loadgen`` must be able to
run that module as ``__main__`` without the package having imported it first.
"""
