"""A small etcd v3 client on trio: KV, leases and watches over the JSON gateway.

It speaks etcd's **JSON gateway** (``POST /v3/...``, present in every etcd v3.4+
server) with ``httpx``, which runs on trio; the gRPC client libraries are
asyncio-only. The gateway uses the proto3 JSON mapping: keys and values are base64,
64-bit integers are strings, and zero values are left out.

Shared by the frontend's discovery (``frontend.discovery.etcd``, which watches) and
the workers' registration (``workers.runtime.registration``, which holds a lease);
what they store is :mod:`headwater.etcd.records`.

Authentication (:class:`EtcdCredentials`): a user and password (etcd's ``auth
enable``; the client asks ``/v3/auth/authenticate`` for a token, sends it with every
request and asks again when etcd says it expired), and/or TLS with a client certificate
(``etcds://`` or ``https://`` endpoints; the server checked against a CA file of the
operator's, or the system's store). The password comes from a file or the
environment, never a command line. Without credentials etcd must be open to whoever
reaches it: keep it on a private network (docs/security.md).

Errors, grouped by what the caller can do::

    EtcdError               root; the server refused (``code`` = gRPC status, if any)
    ├── EtcdUnavailable     unreachable, timed out, connection broke, no leader: retry later
    ├── EtcdLeaseNotFound   the lease expired or was revoked: grant a new one
    └── EtcdCompacted       the watch's start revision is compacted: range again
"""

from __future__ import annotations

import base64
import collections
import enum
import json
import os
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

# gRPC status codes the gateway passes through.
_DEADLINE_EXCEEDED = 4
_NOT_FOUND = 5
_UNAVAILABLE = 14


# -- errors ----------------------------------------------------------------------


class EtcdError(Exception):
    """Root of etcd failures; a plain ``EtcdError`` means etcd refused the request."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """etcd could not be reached or did not answer in time; the request may be retried."""


class EtcdLeaseNotFound(EtcdError):
    """The lease is gone (expired or revoked); keys attached to it are deleted."""


class EtcdCompacted(EtcdError):
    """A watch asked for history older than ``compact_revision``, which etcd discarded."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; oldest available is {compact_revision}")
        self.compact_revision = compact_revision


def _error(where: str, status: int | None, payload: object) -> EtcdError:
    """Turn a gateway error (unary ``{"code", "message"}`` or streamed ``{"error": {...}}``)."""
    code: int | None = None
    message = f"HTTP {status}" if status else "error"
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            payload = err
            code = _int(err.get("grpc_code")) or None
        else:
            code = _int(payload.get("code")) or None
        message = str(payload.get("message") or err or message)
    text = f"etcd {where}: {message}"
    if code in (_DEADLINE_EXCEEDED, _UNAVAILABLE) or status in (502, 503, 504):
        return EtcdUnavailable(text, code=code)
    if code == _NOT_FOUND and "lease not found" in message:
        return EtcdLeaseNotFound(text, code=code)
    return EtcdError(text, code=code)


# -- wire helpers ----------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _int(value: object) -> int:
    """An int64 from the gateway: a decimal string (or a number); absent means 0."""
    return int(str(value)) if value not in (None, "") else 0


def _bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes ``[prefix, range_end)`` every key starting with *prefix*."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # all keys


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int  # 0: no lease

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KeyValue:
        return cls(
            key=_unb64(d.get("key")),
            value=_unb64(d.get("value")),
            create_revision=_int(d.get("create_revision")),
            mod_revision=_int(d.get("mod_revision")),
            version=_int(d.get("version")),
            lease=_int(d.get("lease")),
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    revision: int  # the store's revision when the range was served
    kvs: tuple[KeyValue, ...]
    count: int


class EventType(enum.StrEnum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    kv: KeyValue  # on DELETE only key and mod_revision are set


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int  # seconds, as granted (etcd may raise a too-short TTL)


# -- credentials -----------------------------------------------------------------

#: The environment variables :meth:`EtcdCredentials.from_env` reads (each also a
#: ``--etcd-*`` option of ``headwater worker`` and ``headwater serve``).
USERNAME_ENV = "HEADWATER_ETCD_USERNAME"
PASSWORD_ENV = "HEADWATER_ETCD_PASSWORD"  # the password itself
PASSWORD_FILE_ENV = "HEADWATER_ETCD_PASSWORD_FILE"
CA_FILE_ENV = "HEADWATER_ETCD_CA_FILE"
CERT_FILE_ENV = "HEADWATER_ETCD_CERT_FILE"
KEY_FILE_ENV = "HEADWATER_ETCD_KEY_FILE"


@dataclass(frozen=True, slots=True)
class EtcdCredentials:
    """How to authenticate to etcd: a user and password, a client certificate, the CA
    that signs the server's certificate; any of them, or none."""

    username: str = ""
    password: str = field(default="", repr=False)
    #: PEM of the CA the servers' certificates chain to (default: the system's store).
    ca_file: str = ""
    #: This end's client certificate and key (etcd's ``--client-cert-auth``).
    cert_file: str = ""
    key_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.username) != bool(self.password):
            raise ValueError("etcd credentials need both a username and a password")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("an etcd client certificate needs both its file and its key")

    @classmethod
    def load(
        cls,
        username: str | None = None,
        password_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> EtcdCredentials | None:
        """Credentials from the options given, each else its ``HEADWATER_ETCD_*``
        variable; the password from *password_file*, else ``$HEADWATER_ETCD_PASSWORD``.
        None when nothing is set. Raises ValueError (half a pair), OSError (unreadable
        password file). Reads files: call at start-up."""
        env = os.environ.get
        password_file = password_file or env(PASSWORD_FILE_ENV)
        if password_file:
            with open(password_file, encoding="utf-8") as f:
                password = f.read().strip()
        else:
            password = env(PASSWORD_ENV, "")
        credentials = cls(
            username=username or env(USERNAME_ENV, ""),
            password=password,
            ca_file=ca_file or env(CA_FILE_ENV, ""),
            cert_file=cert_file or env(CERT_FILE_ENV, ""),
            key_file=key_file or env(KEY_FILE_ENV, ""),
        )
        return credentials if credentials != cls() else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``https`` endpoints when a CA or a client certificate is
        given (None: httpx's default, the system's store). Raises OSError, ssl.SSLError."""
        if not (self.ca_file or self.cert_file):
            return None
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


# -- client ----------------------------------------------------------------------


class EtcdClient:
    """A minimal etcd v3 client: KV, leases and watches over the JSON gateway.

    *endpoints* is one URL or several (a list or comma-separated), e.g.
    ``http://127.0.0.1:2379``; after a connection failure the next request goes to
    the next endpoint. Every unary call is bounded by *timeout* seconds and raises
    :class:`EtcdUnavailable` past it. Cancellation is safe at any await: a
    cancelled write may or may not have been applied. Close with :meth:`aclose`
    (or ``async with``) unless an *http* client was passed in, which stays the
    caller's to close. *credentials* (default: :meth:`EtcdCredentials.load` from the
    environment) authenticate it.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 5.0,  # seconds per unary request
        http: httpx.AsyncClient | None = None,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        urls = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        self.endpoints = [_normalize_url(u) for u in urls if u.strip()]
        if not self.endpoints:
            raise ValueError("no etcd endpoint given")
        self.timeout = timeout
        self.credentials = credentials or EtcdCredentials.load()
        self._token = ""  # etcd's auth token, once authenticated with a password
        self._current = 0
        self._owns_http = http is None
        verify = self.credentials.ssl_context() if self.credentials else None
        self._http = http or httpx.AsyncClient(
            timeout=timeout, verify=verify if verify is not None else True
        )

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    @property
    def endpoint(self) -> str:
        """The endpoint the next request goes to."""
        return self.endpoints[self._current]

    def _failover(self) -> None:
        self._current = (self._current + 1) % len(self.endpoints)

    async def _headers(self, *, renew: bool = False) -> dict[str, str]:
        """The auth header for the next request: a token from ``/v3/auth/authenticate``
        when there is a password (asked once, and again with *renew*)."""
        credentials = self.credentials
        if credentials is None or not credentials.username:
            return {}
        if renew or not self._token:
            d = await self._post(
                "/v3/auth/authenticate",
                {"name": credentials.username, "password": credentials.password},
                {},
            )
            token = d.get("token")
            if not isinstance(token, str) or not token:
                raise EtcdError("etcd /v3/auth/authenticate: no token in the answer")
            self._token = token
        return {"Authorization": self._token}

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._post(path, body, await self._headers())
        except EtcdError as exc:
            if not (self._token and _token_expired(exc)):
                raise
        # The token expired (etcd's --auth-token-ttl) or etcd restarted: authenticate again.
        return await self._post(path, body, await self._headers(renew=True))

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        url = self.endpoint + path
        try:
            resp = await self._http.post(url, json=body, headers=headers)
        except httpx.RequestError as exc:
            self._failover()
            raise EtcdUnavailable(f"etcd {path} at {url}: {exc!r}") from exc
        try:
            payload = resp.json()
        except ValueError:
            payload = None
        if resp.status_code != 200:
            raise _error(path, resp.status_code, payload)
        if not isinstance(payload, dict):
            raise EtcdError(f"etcd {path}: malformed answer {resp.text[:200]!r}")
        return payload

    # -- KV --

    async def range(
        self,
        key: str | bytes,
        *,
        prefix: bool = False,
        count_only: bool = False,
    ) -> RangeResult:
        """Read *key*, or every key starting with it when *prefix* is set."""
        k = _bytes(key)
        body: dict[str, Any] = {"key": _b64(k)}
        if prefix:
            body["range_end"] = _b64(prefix_range_end(k))
        if count_only:
            body["count_only"] = True
        d = await self._call("/v3/kv/range", body)
        return RangeResult(
            revision=_int(d.get("header", {}).get("revision")),
            kvs=tuple(KeyValue.from_json(kv) for kv in d.get("kvs", ())),
            count=_int(d.get("count")),
        )

    async def get(self, key: str | bytes) -> KeyValue | None:
        """The current value of *key*, or None."""
        result = await self.range(key)
        return result.kvs[0] if result.kvs else None

    async def put(self, key: str | bytes, value: bytes, *, lease: int = 0) -> int:
        """Write *key*; returns the new revision. Raises EtcdLeaseNotFound for a dead lease."""
        body: dict[str, Any] = {"key": _b64(_bytes(key)), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        d = await self._call("/v3/kv/put", body)
        return _int(d.get("header", {}).get("revision"))

    async def delete(self, key: str | bytes, *, prefix: bool = False) -> int:
        """Delete *key* (or every key under it); returns how many were deleted."""
        k = _bytes(key)
        body: dict[str, Any] = {"key": _b64(k)}
        if prefix:
            body["range_end"] = _b64(prefix_range_end(k))
        d = await self._call("/v3/kv/deleterange", body)
        return _int(d.get("deleted"))

    async def compact(self, revision: int) -> None:
        """Discard history before *revision* (watches below it get EtcdCompacted)."""
        await self._call("/v3/kv/compaction", {"revision": str(revision)})

    # -- leases --

    async def lease_grant(self, ttl: int) -> Lease:
        """Grant a lease of *ttl* seconds; it lives while kept alive (see lease_keepalive)."""
        d = await self._call("/v3/lease/grant", {"TTL": str(ttl)})
        if d.get("error"):
            raise EtcdError(f"etcd /v3/lease/grant: {d['error']}")
        return Lease(id=_int(d.get("ID")), ttl=_int(d.get("TTL")))

    async def lease_keepalive(self, lease_id: int) -> int:
        """Renew the lease; returns its TTL in seconds, 0 when it has already expired."""
        d = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        if "error" in d:
            raise _error("/v3/lease/keepalive", None, d)
        return _int(d.get("result", {}).get("TTL"))

    async def lease_revoke(self, lease_id: int) -> bool:
        """Revoke the lease, deleting its keys; False when it was already gone."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdLeaseNotFound:
            return False
        return True

    # -- watch --

    @asynccontextmanager
    async def watch(
        self, key: str | bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[WatchStream]:
        """Watch *key* (or the keys under it) from *start_revision* (0: from now on).

        Entering returns once etcd confirmed the watch, so every later change is
        seen; raises EtcdCompacted when *start_revision* is no longer available and
        EtcdUnavailable when etcd does not confirm within *timeout*. Leaving closes
        the stream. See :class:`WatchStream` for what iteration raises.
        """
        k = _bytes(key)
        create: dict[str, Any] = {"key": _b64(k)}
        if prefix:
            create["range_end"] = _b64(prefix_range_end(k))
        if start_revision:
            create["start_revision"] = str(start_revision)
        url = self.endpoint + "/v3/watch"
        # The stream is idle until something changes: no read timeout on it.
        request = self._http.build_request(
            "POST",
            url,
            json={"create_request": create},
            headers=await self._headers(),
            timeout=httpx.Timeout(self.timeout, read=None),
        )
        response: httpx.Response | None = None
        stream: WatchStream | None = None
        try:
            with trio.move_on_after(self.timeout) as setup:
                try:
                    response = await self._http.send(request, stream=True)
                except httpx.RequestError as exc:
                    self._failover()
                    raise EtcdUnavailable(f"etcd /v3/watch at {url}: {exc!r}") from exc
                if response.status_code != 200:
                    await response.aread()
                    try:
                        payload = response.json()
                    except ValueError:
                        payload = None
                    raise _error("/v3/watch", response.status_code, payload)
                stream = WatchStream(response)
                await stream._wait_created()
            if setup.cancelled_caught:
                raise EtcdUnavailable(f"etcd /v3/watch at {url}: no answer in {self.timeout:g} s")
            assert stream is not None
            yield stream
        finally:
            with trio.move_on_after(1, shield=True):
                if stream is not None:
                    await stream._aclose()
                if response is not None:
                    await response.aclose()


class WatchStream:
    """The events of one watch, in revision order; iterate with ``async for``.

    Iteration never ends on its own: ``__anext__`` raises EtcdUnavailable when the
    connection breaks or etcd closes the stream, EtcdCompacted when etcd cancels
    the watch for compaction, and EtcdError for any other cancellation.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()
        self._pending: collections.deque[WatchEvent] = collections.deque()
        self.revision = 0  # of the last message received

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            result = await self._message()
            for e in result.get("events", ()):
                kind = EventType.DELETE if e.get("type") == "DELETE" else EventType.PUT
                self._pending.append(WatchEvent(kind, KeyValue.from_json(e.get("kv", {}))))
        return self._pending.popleft()

    async def _aclose(self) -> None:
        aclose = getattr(self._lines, "aclose", None)  # an async generator in practice
        if aclose is not None:
            await aclose()

    async def _wait_created(self) -> None:
        result = await self._message()
        if not result.get("created"):
            raise EtcdError(f"etcd /v3/watch: expected the created message, got {result!r}")

    async def _message(self) -> dict[str, Any]:
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                raise EtcdUnavailable("etcd closed the watch stream") from None
            except httpx.HTTPError as exc:
                raise EtcdUnavailable(f"etcd watch stream broke: {exc!r}") from exc
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                raise EtcdError(f"etcd /v3/watch: malformed message {line[:200]!r}") from None
            if not isinstance(msg, dict):
                raise EtcdError(f"etcd /v3/watch: malformed message {line[:200]!r}")
            if "error" in msg:
                raise _error("/v3/watch", None, msg)
            result = msg.get("result", {})
            self.revision = _int(result.get("header", {}).get("revision")) or self.revision
            if result.get("canceled"):
                compacted = _int(result.get("compact_revision"))
                if compacted:
                    raise EtcdCompacted(compacted)
                reason = result.get("cancel_reason") or "no reason given"
                raise EtcdError(f"etcd canceled the watch: {reason}")
            if not isinstance(result, dict):
                raise EtcdError(f"etcd sent a watch result that is not an object: {result!r}")
            return result


def _token_expired(exc: EtcdError) -> bool:
    """Whether *exc* is etcd refusing a token it no longer knows."""
    return "invalid auth token" in str(exc) or ("token" in str(exc) and exc.code == 16)


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


_SCHEMES = {"etcd": "http", "etcds": "https", "http": "http", "https": "https"}


def etcd_endpoints(url: str) -> list[str]:
    """``etcd://h1:2379,h2:2379`` → ``["http://h1:2379", "http://h2:2379"]``.

    The form ``--discovery`` takes, for frontends and workers alike. ``etcds://``
    means https; ``http(s)://`` URLs and bare ``host:port`` are accepted too.
    Raises ValueError for anything else.
    """
    scheme = "etcd"
    out: list[str] = []
    for item in (i.strip() for i in url.split(",")):
        if not item:
            continue
        if "://" in item:
            scheme, _, item = item.partition("://")
        if scheme not in _SCHEMES:
            raise ValueError(f"--discovery {url!r}: unknown scheme {scheme!r} (use etcd://)")
        hostport = item.rstrip("/")
        if not hostport or "/" in hostport:
            raise ValueError(f"--discovery {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
        out.append(f"{_SCHEMES[scheme]}://{hostport}")
    if not out:
        raise ValueError(f"--discovery {url!r}: no etcd endpoint")
    return out
