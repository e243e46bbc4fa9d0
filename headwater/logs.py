"""Log lines that say which request they are about, as text or as JSON.

Every process (``serve``, ``worker``, ``launch``) logs through :func:`configure_logging`.
A log record made while a request is being served carries that request's id and trace
id, and every record carries the process's worker id (set once by a worker), whatever
logger made it: a record factory adds them from context variables, so no call site
passes them. trio copies context variables into the tasks a task starts, so a request's
context set in its task reaches every task it starts.

Formats: ``text`` (today's line, with ``request_id=… trace_id=…`` appended when set) and
``json`` (one object a line: time, level, logger, message, request_id, trace_id, worker,
and the exception's text), for a log pipeline to index (docs/observability.md, "Logs").
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class RequestContext:
    """The request a piece of work is for: its id (the client's ``X-Request-Id`` or a
    generated one; on a worker, the plane's id) and its trace id ("" untraced)."""

    request_id: str
    trace_id: str = ""


_request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "headwater_request", default=None
)
_worker = ""  # this process's worker id, if it is a worker


@contextmanager
def request_context(request_id: str, trace_id: str = "") -> Iterator[RequestContext]:
    """Log lines made inside the block (and in tasks started there) name this request."""
    ctx = RequestContext(request_id, trace_id)
    token = _request.set(ctx)
    try:
        yield ctx
    finally:
        _request.reset(token)


def current_request() -> RequestContext | None:
    """The request the current task serves, or None."""
    return _request.get()


def set_process_worker(worker_id: str) -> None:
    """Every log line of this process names *worker_id* from now on."""
    global _worker
    _worker = worker_id


def install_context() -> None:
    """Give every log record ``request_id``, ``trace_id`` and ``worker`` attributes
    (empty strings outside a request / a worker). Idempotent."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_headwater", False):
        return

    def make(*args: object, **kwargs: object) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        ctx = _request.get()
        record.request_id = ctx.request_id if ctx else ""
        record.trace_id = ctx.trace_id if ctx else ""
        record.worker = _worker
        return record

    make._headwater = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)


class TextFormatter(logging.Formatter):
    """The text line, plus the request's id and trace id when the record has them."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = [
            f"{key}={value}"
            for key in ("worker", "request_id", "trace_id")
            if (value := getattr(record, key, ""))
        ]
        if not extra:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the line
        return f"{head} {' '.join(extra)}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a traceback goes in ``exception``, never across lines."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "worker"):
            if value := getattr(record, key, ""):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure_logging(level: str, fmt: str = "text") -> None:
    """One handler on stderr for the whole process, at *level*, in *fmt* (LOG_FORMATS).

    httpx logs every request at INFO (each etcd call, each health poll): that stays out
    of a process's INFO output unless debug was asked for.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    install_context()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)
