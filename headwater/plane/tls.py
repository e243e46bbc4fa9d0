"""Mutual TLS on the request plane: whose certificate, which CA, which host.

Off unless configured. With a :class:`TlsConfig` every plane connection is a
``trio.SSLStream`` on which both ends present a certificate the other verifies against
one CA (the cluster's own, not the system's trust store):

* a worker's listener (:class:`~headwater.plane.server.PlaneServer`) presents its
  certificate and requires one from every client (``CERT_REQUIRED``);
* every client (a frontend's :class:`~headwater.plane.client.TcpWorkerClient`, a decode
  worker's KV pulls, :class:`~headwater.plane.kv.TcpKvTransfer`) presents its own and
  checks the worker's against the host it dialled: the worker's *advertised* host (the
  one in its READY line, its KV handles and its etcd record) must be in its certificate,
  as a DNS name or an IP address. A worker checks that at start
  (:func:`check_certificate`) rather than be refused by every peer.

A worker's certificate serves both sides (it listens, and a decode worker also dials
prefill workers), so it must allow TLS server and client use (no extended key usage, or
both ``serverAuth`` and ``clientAuth``). TLS 1.3 only: both ends are headwater.

The HMAC secret handshake (:mod:`headwater.wire.handshake`) still runs, inside TLS:
defence in depth. TLS encrypts the plane and proves which certificate each end holds;
the secret proves that the peer is part of this cluster even if a certificate leaks, or
the CA also signs for others. A worker off loopback still needs the secret.

Certificates and keys are read once per process (:meth:`TlsConfig.client_context`,
:meth:`TlsConfig.server_context` are cached): new files take effect at a restart.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """One end's TLS files (PEM): what it presents and what it trusts.

    Raises ValueError if a path is empty; the files are read when a context is first
    made (OSError, ``ssl.SSLError``, which is an OSError, if they cannot be).
    """

    #: This end's certificate chain: its own certificate first, then any intermediates.
    certfile: str
    #: The private key of that certificate (unencrypted).
    keyfile: str
    #: The CA certificate(s) a peer's certificate must chain to; nothing else is trusted.
    ca_file: str

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile", "ca_file"):
            if not getattr(self, name):
                raise ValueError(f"TlsConfig.{name} is empty")

    def client_context(self) -> ssl.SSLContext:
        """The context a client dials with: verifies the worker's certificate and its
        host name (``server_hostname`` of each connection), presents this end's."""
        return _context(self, server_side=False)

    def server_context(self) -> ssl.SSLContext:
        """The context a worker listens with: presents this end's certificate and
        requires a client certificate from the CA."""
        return _context(self, server_side=True)


def tls_config(certfile: str | None, keyfile: str | None, ca_file: str | None) -> TlsConfig | None:
    """A :class:`TlsConfig` from the three options; None when none is given. Raises
    ValueError when only some are."""
    if not (certfile or keyfile or ca_file):
        return None
    if not (certfile and keyfile and ca_file):
        raise ValueError(
            "plane TLS needs all three of --plane-tls-certfile, --plane-tls-keyfile and "
            "--plane-tls-ca-file"
        )
    return TlsConfig(certfile, keyfile, ca_file)


@functools.lru_cache(maxsize=16)
def _context(config: TlsConfig, *, server_side: bool) -> ssl.SSLContext:
    purpose = ssl.Purpose.CLIENT_AUTH if server_side else ssl.Purpose.SERVER_AUTH
    try:
        context = ssl.create_default_context(purpose, cafile=config.ca_file)
    except OSError as exc:
        raise _unloadable("CA file", config.ca_file, exc) from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        context.load_cert_chain(config.certfile, config.keyfile)
    except OSError as exc:
        paths = f"{config.certfile}, {config.keyfile}"
        raise _unloadable("certificate and key", paths, exc) from exc
    if server_side:
        context.verify_mode = ssl.CERT_REQUIRED
    # A client context verifies the certificate and the host name by default
    # (create_default_context: CERT_REQUIRED, check_hostname).
    return context


def _unloadable(what: str, paths: str, exc: OSError) -> OSError:
    """ssl's errors name no file (``[Errno 2] No such file or directory``): this one does."""
    reason = exc.strerror or getattr(exc, "reason", None) or str(exc)
    return OSError(exc.errno, f"plane TLS {what} ({paths}): {reason}")


def tls_reason(exc: BaseException) -> str | None:
    """What TLS said, if an ``ssl.SSLError`` is among the causes of *exc* (trio raises
    ``BrokenResourceError`` from it), else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"{seen.verify_message or seen.reason} (certificate verify failed)"
        if isinstance(seen, ssl.SSLError):
            return str(seen.reason or seen)
        seen = seen.__cause__ or seen.__context__
    return None


def check_certificate(config: TlsConfig, host: str) -> None:
    """Raise ValueError unless a peer would accept this end's certificate: that it
    chains to ``ca_file`` as a server certificate for *host* (what clients check)
    and as a client certificate (what workers check), and that the key matches.

    A TLS handshake between this end and itself, in memory (no socket, no event
    loop), the way every peer will make one; raises OSError if a file is unreadable.
    """
    client = _Side(config.client_context(), server_side=False, host=host)
    server = _Side(config.server_context(), server_side=True)
    try:
        for _ in range(8):  # TLS 1.3 needs two flights each way, a ticket a third
            client.step(server)
            server.step(client)
            if client.done and server.done:
                return
    except ssl.SSLError as exc:
        raise ValueError(
            f"the plane's peers would refuse this certificate ({config.certfile}) for host "
            f"{host!r}: {tls_reason(exc)}"
        ) from exc
    raise ValueError(f"a TLS handshake with this certificate ({config.certfile}) did not end")


class _Side:
    """One end of an in-memory TLS handshake."""

    def __init__(self, context: ssl.SSLContext, *, server_side: bool, host: str = "") -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(
            self.incoming,
            self.outgoing,
            server_side=server_side,
            server_hostname=None if server_side else host,
        )
        self.done = False

    def step(self, peer: _Side) -> None:
        """Go on with the handshake on what arrived; hand *peer* what it wrote."""
        try:
            self.tls.do_handshake()
            self.done = True
        except ssl.SSLWantReadError:
            pass
        data = self.outgoing.read()
        if data:
            peer.incoming.write(data)
