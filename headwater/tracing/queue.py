"""A span processor that never makes the event loop wait on an export.

Ending a span puts it in a bounded queue (4096 spans) and returns; a daemon thread
takes batches of up to 512 every second (sooner when a batch is full) and exports
them. A full queue drops the span and a failed export drops its batch, both counted:
a collector that is down or slow costs spans, never the requests' time. (The SDK's
own batch processor also drops on a full queue, but counts nothing a metric can read.)
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

MAX_QUEUE = 4096
MAX_BATCH = 512
INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class TraceStatistics:
    """Spans handed to the exporter and accepted, and spans lost, by cause."""

    exported: int
    dropped_queue_full: int
    dropped_export_failed: int
    queued: int


class QueueSpanProcessor(SpanProcessor):
    """See the module docstring. Thread-safe: spans end on the loop thread and on
    worker threads alike; the counters are only written under the lock or by the
    export thread."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = MAX_QUEUE,
        max_batch: int = MAX_BATCH,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._exporter = exporter
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._interval = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._exported = self._full = self._failed = 0
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._stopping or len(self._queue) >= self._max_queue:
                self._full += 1
                return
            self._queue.append(span)
            if len(self._queue) >= self._max_batch:
                self._wake.set()

    def statistics(self) -> TraceStatistics:
        return TraceStatistics(self._exported, self._full, self._failed, len(self._queue))

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._export_all()
            if self._stopping:
                return

    def _export_all(self) -> None:
        while True:
            with self._lock:
                n = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
            if not batch:
                return
            try:
                ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
            except Exception:  # an exporter bug must not end the thread
                log.debug("span export raised", exc_info=True)
                ok = False
            if ok:
                self._exported += len(batch)
            else:
                self._failed += len(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now (from the calling thread). Blocks: never on the loop."""
        self._export_all()
        return True

    def shutdown(self) -> None:
        """Export what is queued, stop the thread, shut the exporter. Blocks: never on
        the loop (open_tracing calls it from a thread)."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join()
        self._exporter.shutdown()
