"""Worker-side runtime: serves an engine to whichever transport delivers requests."""

from workers.runtime.runtime import RuntimeStats, WorkerRuntime, load_of, open_runtime

__all__ = ["RuntimeStats", "WorkerRuntime", "load_of", "open_runtime"]
