"""headwater's HTTP server: hypercorn-trio, with the fixes it needs, owned in one place.

hypercorn-trio serves the Quart app, but four of its behaviours were measured to cost
(docs/architecture.md, docs/performance.md), and fixed here. Nothing in hypercorn is assigned
to: the fixes are overrides in :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer`
(a ``TCPServer`` subclass) and its HTTP/1.1 protocol, and :func:`serve` (hypercorn's
trio ``worker_serve``, trimmed) is the one place that names that class. Their settings
come from the :class:`ServerConfig` each server is given, so two servers in one process
may differ, and a server started with hypercorn's own ``serve`` gets hypercorn as it is.
hypercorn is pinned to the minor version these copies were taken from, and
``tests/test_hypercorn_seam.py`` fingerprints every upstream function they replace or
rely on, so an upgrade fails there, naming what to re-check.

2. The idle timer is a task hypercorn cancels and spawns afresh, behind a lock, each
   time a connection goes idle (and cancels when its next request arrives): a task
   spawn and about five scheduler passes per request.
   :class:`~frontend.http.serving.tcp_server.IdleDeadline` makes it one task per
   connection whose deadline moves, by plain assignment.
3. hypercorn writes to sockets inside a shielded scope with no deadline, so a client
   that stops reading pins its connection and blocks graceful shutdown forever. Each
   write is bounded by ``write_timeout``; a client that does not take the bytes in
   that time is disconnected. On the way writes get a fast path: one non-blocking
   ``write(2)`` first, the bounded send only for what is left.
4. hypercorn reads 64 KiB at a time, and each read is a pass through hypercorn, h11 and
   Quart's body task: a long prompt's body (40k tokens, ~240 kB) took four or five. A
   connection's reads grow to ``read_size_large`` once one of them fills ``read_size``.
5. hypercorn writes a response's head as soon as the app starts the response, and its
   body in a second write. The head of a response whose length is known goes out with
   its body, in one ``write(2)``
   (:class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`).

Two parsers read HTTP/1.1 requests, chosen by ``ServerConfig.http_parser``:
``"httptools"`` (the default, llhttp, compiled,
:class:`~frontend.http.serving.httptools_protocol.HttptoolsProtocol`, which writes its
responses itself) and ``"h11"`` (hypercorn's pure-Python parser,
:class:`~frontend.http.serving.h11_protocol.HeadWithBodyH11Protocol`). Both carry the
same policy, from the same code (:mod:`~frontend.http.serving.policy`,
:mod:`~frontend.http.serving.limits`), and give a client the same answers (a head llhttp
refuses is read again by h11); neither serves HTTP/2 or websockets.

Fix 1, the shielded final body send, is ASGI middleware
(:class:`frontend.http.middleware.ShieldFinalSend`): it wraps the app, not the server.

Besides the fixes, the seam serves TLS (``certfile``/``keyfile``, as hypercorn does) and
enforces the transport's limits on slow and greedy clients
(:mod:`~frontend.http.serving.limits`: head size and time, body stalls, write stalls,
connections per client address), reporting each refusal to ``ServerConfig.on_refusal``
with one of :data:`REFUSAL_REASONS`. The seam knows nothing of the frontend: the
frontend counts them.
"""

from frontend.http.serving.config import ServerConfig
from frontend.http.serving.limits import REFUSAL_REASONS
from frontend.http.serving.run import serve

__all__ = ["REFUSAL_REASONS", "ServerConfig", "serve"]
