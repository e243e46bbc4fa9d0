"""The configuration of headwater's HTTP server: hypercorn's, plus the settings of its fixes
and of its transport limits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hypercorn.config import BYTES, SECONDS, Config

if TYPE_CHECKING:
    from frontend.http.serving.balance import AcceptBalance

log = logging.getLogger(__name__)

#: The parsers a :class:`ServerConfig` may name in ``http_parser``.
HTTP_PARSERS = ("h11", "httptools")


class ServerConfig(Config):
    """hypercorn's :class:`~hypercorn.config.Config` with the fields that
    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` and
    :func:`~frontend.http.serving.serve` read.

    Like hypercorn's own fields these are class-level defaults that an instance
    overrides by assignment (``Config.from_mapping`` works too); each server reads them
    from the config it was given, so two servers in one process may differ.

    Of hypercorn's own fields, the limits read two: ``h11_max_incomplete_size`` is the
    largest request head (bytes, 16 KiB; over it: 431), and ``certfile``/``keyfile``
    turn TLS on for every ``bind`` (``insecure_bind`` stays plain).
    """

    #: Seconds a socket write may wait for the client to take its bytes; a client that
    #: takes none of them in that time is treated as gone and its connection dropped
    #: (refusal ``write_timeout``).
    write_timeout: float = 30 * SECONDS
    #: Bytes asked of the socket per read: hypercorn's ``MAX_RECV``, enough for a
    #: request head and a short body.
    read_size: int = 2**16 * BYTES
    #: Bytes asked per read once a read of a connection has filled :attr:`read_size`:
    #: the connection carries large bodies (a 40k-token prompt is ~240 kB). Kept under
    #: 1 MiB for glibc's sake (see ``HeadwaterTCPServer._read_data``).
    read_size_large: int = 2**18 * BYTES
    #: Seconds a request head may take from its first byte to its end; then 408 and
    #: the connection closes (refusal ``header_timeout``). Also bounds a TLS handshake,
    #: from the connection's accept (``tls_handshake_timeout``). A slowloris client
    #: dribbles a head to hold a connection: progress does not extend this.
    header_timeout: float = 10 * SECONDS
    #: Seconds a request body may go without a byte while the server waits for it; then
    #: the connection closes (refusal ``read_timeout``). Unlike hypercorn's own
    #: ``read_timeout`` (every read, None by default), it never applies while a response
    #: streams to a client that has sent all it had to: such a client is silent by right.
    body_read_timeout: float = 30 * SECONDS
    #: Seconds a connection may linger before it closes while its client still sends a
    #: request body that nobody reads (a refusal answered before it): the body is read
    #: and dropped meanwhile, so that closing does not reset the connection under the
    #: answer. Not a refusal: the answer has left.
    linger_timeout: float = 2 * SECONDS
    #: Connections one client IP address may hold open at once; one more is closed as
    #: soon as it is accepted (refusal ``too_many_connections``). Loopback counts like
    #: any other address. Behind a proxy every connection comes from the proxy's
    #: address: raise it, or 0 for no limit.
    max_connections_per_client: int = 256
    #: Called with the reason (:data:`~frontend.http.serving.limits.REFUSAL_REASONS`)
    #: each time a limit turns a connection or a request away; the frontend counts them.
    #: A hook that raises is logged and dropped. None: not reported.
    on_refusal: Callable[[str], None] | None = None
    #: Called with the status of each answer the server writes itself, the app never
    #: seeing the request: a request it cannot parse (400), a head over the limit (431)
    #: or too slow (408). A hook that raises is logged and dropped. None: not reported.
    on_answer: Callable[[int], None] | None = None
    #: The parser of HTTP/1.1 requests: ``"httptools"`` (llhttp, compiled;
    #: :mod:`frontend.http.serving.httptools_protocol` says what it hands to h11) or
    #: ``"h11"`` (hypercorn's, pure Python). Both carry the same policy and limits.
    http_parser: str = "httptools"
    #: A process of a frontend group: its share of the group's connection counts, and
    #: the shared socket (``fd://N``) whose accepts take turns with the other processes
    #: (:mod:`frontend.http.serving.balance`). None: accept as the kernel hands out.
    accept_balance: AcceptBalance | None = None

    def refused(self, reason: str) -> None:
        """Report a refusal to :attr:`on_refusal`. Never raises: reporting must not take
        the connection down, so a hook that raises is logged and not called again."""
        hook = self.on_refusal
        if hook is None:
            return
        try:
            hook(reason)
        except Exception:
            log.exception("on_refusal hook %r failed; disabled", hook)
            self.on_refusal = None

    def answered(self, status: int) -> None:
        """Report an answer of the server's own to :attr:`on_answer`; never raises (a
        hook that raises is logged and not called again)."""
        hook = self.on_answer
        if hook is None:
            return
        try:
            hook(status)
        except Exception:
            log.exception("on_answer hook %r failed; disabled", hook)
            self.on_answer = None
