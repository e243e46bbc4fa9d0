"""headwater's ``serve``: hypercorn-trio's ``worker_serve``, trimmed, serving
:class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` connections."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.tcp_server import HeadwaterTCPServer


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
    (``fd://N``), served as HTTP/1.1 (h2c upgrades as in hypercorn); no TLS, QUIC,
    statsd or ``max_requests`` (a config that asks for one raises ValueError before
    anything is bound). The app's lifespan runs around serving: startup before the
    first bind, shutdown after the last connection.

    ``task_status.started`` reports the ``http://`` URLs once every listener is
    bound. When *shutdown_trigger* returns, accepting stops, idle connections close,
    and in-flight requests get ``config.graceful_timeout`` seconds before they are
    cancelled. Cancelling the caller cancels everything at once.
    """
    _refuse_unsupported(config)
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
                HeadwaterTCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy())
            )
            task_status.started(urls)
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        partial(trio.serve_listeners, handler_nursery=connections),
                        connection,
                        listeners,
                    )
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                # Idle connections close on this (IdleDeadline), busy ones finish their
                # request and are not recycled; what is left is cancelled at the deadline.
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _listen(config: ServerConfig) -> tuple[list[trio.SocketListener], list[str]]:
    """A listener per bind, and its URL."""
    listeners: list[trio.SocketListener] = []
    urls: list[str] = []
    for sock in config.create_sockets().insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    return listeners, urls


def _refuse_unsupported(config: ServerConfig) -> None:
    asked = [
        name for name, wanted in (
            ("TLS (certfile, keyfile)", config.ssl_enabled),
            ("QUIC (quic_bind)", bool(config.quic_bind)),
            ("statsd (statsd_host)", config.statsd_host is not None),
            ("max_requests", config.max_requests is not None),
        ) if wanted
    ]  # fmt: skip
    if asked:
        raise ValueError(f"headwater's serve does not support {', '.join(asked)}")
