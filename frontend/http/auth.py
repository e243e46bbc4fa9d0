"""API keys: who may use this frontend, checked before anything else runs.

Off unless keys are given (``--api-key``, repeatable; ``HEADWATER_API_KEYS``, comma-
separated; ``--api-keys-file``, one per line). With keys, every request but the probes a
load balancer or an orchestrator sends (``/live``, ``/health``) and, unless
``--metrics-auth``, ``/metrics``, must carry ``Authorization: Bearer <key>`` with one of
them, or ``x-api-key: <key>`` (Anthropic's header, which Claude Code and the ``anthropic``
SDK send); anything else gets OpenAI's answer to a bad key: 401, ``{"error": {"message":
..., "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}`` and a
``WWW-Authenticate: Bearer`` header (RFC 6750), in Anthropic's shape on its Messages
API's paths. That covers ``/v1/*``, the token-in API, ``/tokenize``, ``/dashboard`` and
``/debug/*``.

Keys rotate without a restart: ``--api-keys-file`` is watched (:func:`watch_keys_file`,
its status checked every ``KEYS_FILE_POLL`` seconds in a thread) and re-read when it
changes; a file that cannot be read or holds a bad key keeps the keys in force, and so
does an emptied one when no other key is set, so that no edit of the file opens the API.
Keys from ``--api-key`` and ``HEADWATER_API_KEYS`` are fixed for the process's life.

The comparison takes the same time whichever key matched, or whether one did: the
presented key is compared with every configured key with :func:`hmac.compare_digest`
(constant time for equal lengths) and the results are combined without stopping early,
so timing reveals neither a key nor which one is close. Keys are compared as their
SHA-256 digests, which also makes the lengths equal.

ASGI middleware, outermost but for the server's own: a refused request costs no slot
of admission control, no Quart request, no JSON decode, and not one byte of its body read:
the 401 leaves before the body (and the server sends no ``100 Continue`` for a body the app
does not read). The server then closes the connection, lingering a bounded time first
(:mod:`frontend.http.serving`): a client sending the body slowly holds nothing. Any scope
but ``http`` and ``lifespan`` (a ``websocket`` one, which the server never makes) is refused
outright.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Sized
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from frontend.http.dashboard import PAGE_PATHS
from frontend.http.errors import ApiError
from frontend.http.middleware import send_error
from frontend.metrics import FrontendMetrics
from headwater.wire.addresses import is_loopback

if TYPE_CHECKING:
    from hypercorn.typing import (
        ASGIFramework,
        ASGIReceiveCallable,
        ASGISendCallable,
        Scope,
        WebsocketCloseEvent,
    )

#: The environment variable of comma-separated keys (``headwater serve``).
API_KEYS_ENV = "HEADWATER_API_KEYS"
#: Paths that never need a key: an orchestrator's liveness and readiness probes.
OPEN_PATHS = frozenset({"/live", "/health"})
METRICS_PATH = "/metrics"
#: Seconds between two looks at ``--api-keys-file``'s status: a new key works, and a
#: removed one stops working, within this long of the file's change.
KEYS_FILE_POLL = 2.0

log = logging.getLogger(__name__)


def load_api_keys(
    keys: Iterable[str] = (), *, env: str | None = None, file: str | Path | None = None
) -> tuple[str, ...]:
    """Every key given: *keys* (``--api-key``), *env* (``HEADWATER_API_KEYS``, comma-
    separated) and *file* (one per line; blank lines and ``#`` comments skipped).

    Surrounding whitespace is stripped; duplicates are kept once. Raises OSError for an
    unreadable file and ValueError for an empty key or a key with whitespace inside.
    """
    found: list[str] = [*keys]
    if env:
        found += env.split(",")
    if file is not None:
        for line in Path(file).read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(line)
    out: dict[str, None] = {}
    for raw in found:
        key = raw.strip()
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be a non-empty string without whitespace")
        out[key] = None
    return tuple(out)


class ApiKeys:
    """The accepted keys, and the constant-time check of an ``Authorization`` header."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def replace(self, keys: Iterable[str]) -> None:
        """Accept *keys* from now on, and only them (a reloaded keys file)."""
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allows(self, authorization: bytes | None) -> bool:
        """Whether *authorization* (the header's value) is ``Bearer <an accepted key>``."""
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        return self.matches(token)

    def matches(self, key: bytes | None) -> bool:
        """Whether *key* (an ``x-api-key`` header's value, Anthropic's way to send one)
        is an accepted key."""
        if not key:
            return False
        digest = hashlib.sha256(key.strip()).digest()
        matched = False
        for accepted in self._digests:  # every key, every time: no early exit
            matched |= hmac.compare_digest(digest, accepted)
        return matched


async def watch_keys_file(
    keys: ApiKeys,
    fixed: Iterable[str],
    path: str,
    *,
    period: float = KEYS_FILE_POLL,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load *path*'s keys (with the *fixed* ones) into *keys*, then keep them in step
    with the file: re-read whenever its status (inode, size, mtime) changes, which an
    edit in place and an atomic rename both change. Started with ``nursery.start``: a
    file unreadable at start raises then; later, a bad file keeps the keys in force."""
    fixed = tuple(fixed)
    seen = await _status(path)  # before the read: a change during it is seen next time
    keys.replace(await trio.to_thread.run_sync(partial(load_api_keys, fixed, file=path)))
    task_status.started()
    while True:
        await trio.sleep(period)
        status = await _status(path)
        if status == seen:
            continue
        seen = status
        try:
            loaded = await trio.to_thread.run_sync(partial(load_api_keys, fixed, file=path))
        except (OSError, ValueError) as exc:
            log.error("API keys file %s not reloaded (%s); the keys in force stay", path, exc)
            continue
        if not loaded:
            log.error(
                "API keys file %s holds no key, and no other key is set; the keys in "
                "force stay (no key at all would serve anyone)",
                path,
            )
            continue
        keys.replace(loaded)
        log.info("API keys reloaded from %s: %d keys", path, len(loaded))


async def _status(path: str) -> tuple[int, int, int] | None:
    try:
        st: os.stat_result = await trio.Path(path).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def exposure_warning(host: str, keys: Sized) -> str | None:
    """The loud warning for a frontend bound beyond loopback with no API key, else None."""
    if len(keys) or is_loopback(host):
        return None
    bar = "!" * 78
    return (
        f"\n{bar}\nSERVING ON {host} WITHOUT API KEYS: anyone who can reach this port can "
        "use it.\nSet --api-key (or HEADWATER_API_KEYS, --api-keys-file), or bind 127.0.0.1 "
        f"behind a proxy that authenticates (docs/security.md).\n{bar}"
    )


def unauthorized(key_sent: bool) -> ApiError:
    """OpenAI's answer to a missing or wrong key."""
    message = (
        "Incorrect API key provided."
        if key_sent
        else "You didn't provide an API key. You need to provide your API key in an "
        "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), "
        "or in an x-api-key header."
    )
    return ApiError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="headwater"'},
    )


class RequireApiKey:
    """Wraps an ASGI app so that, with *keys*, every request outside the open paths (the
    probes, the dashboard's page without its data, and /metrics unless *metrics_open* is
    False) needs one; a refused request is answered here, before its body is read, and
    counted in ``rejected_requests_total{reason="unauthorized"}``. *max_body_bytes* is
    kept for the callers' sake: nothing of a refused body is read now."""

    def __init__(
        self,
        app: ASGIFramework,
        keys: ApiKeys,
        *,
        metrics: FrontendMetrics,
        metrics_open: bool = True,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.open = OPEN_PATHS | PAGE_PATHS | ({METRICS_PATH} if metrics_open else frozenset())
        self.max_body_bytes = max_body_bytes
        metrics.rejected_requests_total.labels("unauthorized")

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: this server serves none
            close: WebsocketCloseEvent = {"type": "websocket.close", "code": 1008, "reason": None}
            await send(close)  # 1008: policy violation
            return
        if not self.keys or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        authorization = api_key = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-api-key":
                api_key = value
        if self.keys.allows(authorization) or self.keys.matches(api_key):
            await self.app(scope, receive, send)
            return
        sent = authorization is not None or api_key is not None
        self.metrics.rejected_requests_total.labels("unauthorized").inc()
        await send_error(send, unauthorized(sent), scope["path"])
