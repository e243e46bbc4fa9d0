"""The frontend's errors: one tree, grouped by what the caller does about them.

The pipeline and everything below it raise these; only the HTTP layer
(:mod:`frontend.http.errors`) turns them into statuses and OpenAI error bodies::

    FrontendError
    ├── InvalidRequest          the request itself is wrong: resending it cannot help (400)
    │   └── LimitExceeded       over one of the configured request limits (400)
    │       └── ContextTooLong  prompt + completion over the context length (400)
    ├── UnknownModel            this frontend does not serve that model (404)
    ├── NoCapacity              no worker can take it now: retry later (503)
    │   └── NoWorkers           none is routable for a role the request needs
    ├── WorkerFailed            a worker failed it and retries are spent (502)
    └── RequestTimeout          its deadline (--request-timeout) passed first (504)

``message`` is written for the client; ``param`` names the request field at fault
(OpenAI's ``param``); ``code`` is OpenAI's machine-readable ``code`` when there is
one (``context_length_exceeded``, ``no_workers``, ...). ``limit`` names the configured
limit a refusal is (``max_messages``, ``request_timeout``, ...; None for any other
error): the HTTP layer counts it in ``rejected_requests_total{reason=<limit>}``.
"""

from __future__ import annotations


class FrontendError(Exception):
    """Root of the frontend's request failures."""

    default_code: str | None = None
    #: The configured limit this failure is, by name (see the module docstring).
    limit: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidRequest(FrontendError):
    """The request cannot be served as sent (bad field, bad prompt, refused by the worker
    as invalid). Never a worker's fault: routing health is not touched."""


class LimitExceeded(InvalidRequest):
    """The request is over one of the frontend's configured limits
    (:class:`~frontend.limits.RequestLimits`), named by *limit*; OpenAI's ``code`` for
    the kind of bound (``array_above_max_length``, ``integer_above_max_value``, ...)."""

    def __init__(self, message: str, *, limit: str, param: str | None, code: str) -> None:
        super().__init__(message, param=param, code=code)
        self.limit = limit


class ContextTooLong(LimitExceeded):
    """Prompt plus requested completion exceed the model's context length."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(
            message, limit="context_length", param=param, code="context_length_exceeded"
        )


class UnknownModel(FrontendError):
    """The request names a model this frontend does not serve."""

    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")
        self.model = model


class NoCapacity(FrontendError):
    """No worker could take the request now (none routable, or every one tried refused
    or could not be reached). Nothing was generated; the client may retry."""


class NoWorkers(NoCapacity):
    """No routable worker of a role the request needs, for this model."""

    default_code = "no_workers"


class WorkerFailed(FrontendError):
    """A worker failed the request (an internal error, a broken stream after every
    migration, a reply the protocol does not allow)."""


class RequestTimeout(FrontendError):
    """The request's deadline (``--request-timeout`` seconds from its arrival) passed
    before its response was complete. Its work was cancelled, on the worker too; the
    client may retry, with a shorter request or later."""

    default_code = "request_timeout"
    limit = "request_timeout"

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"The request did not complete within this server's limit of {timeout:g} seconds"
        )
        self.timeout = timeout
