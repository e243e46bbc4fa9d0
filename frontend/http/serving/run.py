"""headwater's ``serve``: hypercorn-trio's ``worker_serve``, trimmed, serving
:class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` connections, over TLS or not,
at most ``max_connections_per_client`` per client address."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr

from frontend.http.serving.balance import AcceptBalance, BalancedListener
from frontend.http.serving.config import HTTP_PARSERS, ServerConfig
from frontend.http.serving.limits import (
    TLS_HANDSHAKE_TIMEOUT,
    TOO_MANY_CONNECTIONS,
    ClientConnections,
)
from frontend.http.serving.tcp_server import HeadwaterTCPServer, HttpStream

log = logging.getLogger(__name__)

#: What serve_listeners accepts connections from: plain, TLS, either balanced.
Listener = trio.abc.Listener[HttpStream]


async def serve(
    app: ASGIFramework,
    config: ServerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI *app* on every address of ``config.bind`` until *shutdown_trigger*
    returns, then shut down gracefully.

    As hypercorn's ``hypercorn.trio.serve``, less what headwater does not use: binds
    are TCP ``host:port`` (``unix:`` works too) or an inherited listening socket
    (``fd://N``), served as HTTP/1.1 (h2c upgrades as in hypercorn); no QUIC, statsd or
    ``max_requests`` (a config that asks for one raises ValueError before anything is
    bound). With ``config.certfile`` and ``config.keyfile`` every bind is served over
    TLS, as hypercorn does (``trio.SSLListener``, hypercorn's ``create_ssl_context``),
    offering only ``http/1.1`` by ALPN: the fixes are HTTP/1.1's; ``insecure_bind``
    stays plain. The app's lifespan runs around serving: startup before the first bind,
    shutdown after the last connection.

    Each accepted connection from an address that already holds
    ``config.max_connections_per_client`` is closed at once; a TLS handshake must end
    within ``config.header_timeout``; both are reported to ``config.refused``. With
    ``config.accept_balance`` (a process of a group) the shared socket's connections
    are accepted in turn with the group's other processes and counted
    (:mod:`frontend.http.serving.balance`); other binds are not.

    ``task_status.started`` reports the ``http://`` (``https://``) URLs once every
    listener is bound. When *shutdown_trigger* returns, accepting stops, idle
    connections close, and in-flight requests get ``config.graceful_timeout`` seconds
    before they are cancelled. Cancelling the caller cancels everything at once.
    """
    _refuse_unsupported(config)
    clients = ClientConnections(config.max_connections_per_client)
    wrapped = ASGIWrapper(app)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()

        async with trio.open_nursery() as connections:
            listeners, urls = _listen(config)
            for url in urls:
                await config.log.info(f"Running on {url}")
            connection = partial(
                _serve_connection,
                partial(
                    HeadwaterTCPServer,
                    wrapped,
                    config,
                    context,
                    ConnectionState(lifespan_state.copy()),
                ),
                config,
                clients,
            )
            balance = config.accept_balance
            balanced = [lst for lst in listeners if isinstance(lst, BalancedListener)]
            others = [lst for lst in listeners if not isinstance(lst, BalancedListener)]
            task_status.started(urls)
            try:
                async with trio.open_nursery() as accepting:
                    serve_listeners = partial(trio.serve_listeners, handler_nursery=connections)
                    if others:
                        accepting.start_soon(serve_listeners, connection, others)
                    if balanced:
                        assert balance is not None  # only a balance makes them
                        balance.join()
                        accepting.start_soon(
                            serve_listeners, partial(_counted, balance, connection), balanced
                        )
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                if balance is not None:
                    balance.leave()  # the others stop waiting for this process
                # Idle connections close on this (IdleDeadline), busy ones finish their
                # request and are not recycled; what is left is cancelled at the deadline.
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _serve_connection(
    server: Callable[[HttpStream], HeadwaterTCPServer],
    config: ServerConfig,
    clients: ClientConnections,
    stream: HttpStream,
) -> None:
    """One accepted connection: counted under its client's address (closed at once
    over the limit), its TLS handshake bounded, then served by *server*."""
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    address = _client_address(transport)
    if not clients.acquire(address):
        config.refused(TOO_MANY_CONNECTIONS)
        log.debug("closing a connection from %s: %d already open", address, clients.limit)
        await trio.aclose_forcefully(transport)
        return
    try:
        if isinstance(stream, trio.SSLStream) and not await _tls_handshake(stream, config):
            return
        # hypercorn's TCPServer.run calls do_handshake too: a no-op once it is done.
        await server(stream).run()
    except Exception:
        # A fault stays in its connection: raised out of here, it would cancel the
        # listener's nursery, every other connection with it, and stop the process.
        log.exception("a connection from %s failed; closing it alone", address)
        await trio.aclose_forcefully(transport)
    finally:
        clients.release(address)


async def _counted(
    balance: AcceptBalance,
    serve_one: Callable[[HttpStream], Awaitable[None]],
    stream: HttpStream,
) -> None:
    """*serve_one* the connection that *balance*'s listener counted as it accepted it."""
    try:
        await serve_one(stream)
    finally:
        balance.closed()


async def _tls_handshake(stream: trio.SSLStream[trio.SocketStream], config: ServerConfig) -> bool:
    """Whether the handshake completed within ``header_timeout``; else *stream* is closed
    (also when the server shuts down meanwhile)."""
    done = False
    try:
        with trio.move_on_after(config.header_timeout) as scope:
            try:
                await stream.do_handshake()
                done = True
            except trio.BrokenResourceError as exc:
                # Not TLS, a client that does not trust the certificate, a scanner.
                log.debug("TLS handshake failed: %r", exc.__cause__ or exc)
        if scope.cancelled_caught:
            config.refused(TLS_HANDSHAKE_TIMEOUT)
    finally:
        if not done:  # it will not be served: nobody else closes it
            await trio.aclose_forcefully(stream)
    return done


def _client_address(stream: trio.SocketStream) -> str | None:
    """The client's IP address; None for a Unix socket (not limited) or a peer gone."""
    sock = stream.socket
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return str(sock.getpeername()[0])
    except OSError:  # already disconnected
        return None


def _listen(config: ServerConfig) -> tuple[list[Listener], list[str]]:
    """A listener per bind, and its URL: TLS ones for ``bind`` when TLS is on (and plain
    ones for ``insecure_bind``), plain ones for ``bind`` otherwise."""
    sockets = config.create_sockets()
    ssl_context = config.create_ssl_context()
    if ssl_context is not None:
        # The seam's fixes and limits are HTTP/1.1's: h2 over TLS would go around them.
        ssl_context.set_alpn_protocols(["http/1.1"])
    balance = config.accept_balance
    listeners: list[Listener] = []
    urls: list[str] = []

    def add(sock: socket.socket, tls: bool) -> None:
        sock.listen(config.backlog)
        assert ssl_context is not None or not tls  # secure sockets only when TLS is on
        context = ssl_context if tls else None
        listener: Listener
        if balance is not None and sock.fileno() == balance.fd:
            listener = BalancedListener(sock, balance, context)
        else:
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
            if context is not None:
                listener = trio.SSLListener(listener, context, https_compatible=True)
        listeners.append(listener)
        scheme = "https" if tls else "http"
        urls.append(f"{scheme}://{repr_socket_addr(sock.family, sock.getsockname())}")

    for sock in sockets.secure_sockets:
        add(sock, tls=True)
    for sock in sockets.insecure_sockets:
        add(sock, tls=False)
    return listeners, urls


def _refuse_unsupported(config: ServerConfig) -> None:
    asked = [
        name
        for name, wanted in (
            ("QUIC (quic_bind)", bool(config.quic_bind)),
            ("statsd (statsd_host)", config.statsd_host is not None),
            ("max_requests", config.max_requests is not None),
        )
        if wanted
    ]
    if asked:
        raise ValueError(f"headwater's serve does not support {', '.join(asked)}")
    if config.http_parser not in HTTP_PARSERS:
        raise ValueError(f"http_parser must be one of {HTTP_PARSERS}, got {config.http_parser!r}")
    if (config.certfile is None) != (config.keyfile is None):
        raise ValueError("TLS needs both a certfile and a keyfile")
