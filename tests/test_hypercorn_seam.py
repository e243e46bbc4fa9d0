"""The hypercorn seam (frontend.http.serving) is pinned to the upstream code it was
written against, and is a seam: serving through it changes nothing in hypercorn.

Policy: fingerprints are sha256 digests of ``inspect.getsource`` of the installed
upstream code, compared with the table below; a mismatch names the function to
re-check and what the seam assumed of it. After re-checking, update the digest (and
the pins in pyproject.toml). Servers run on 127.0.0.1:0 inside the test's nursery;
fake connections run over lockstep memory streams with virtual time.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import importlib.metadata
import inspect
import socket
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import h11._receivebuffer
import httpx
import hypercorn.protocol
import hypercorn.protocol.h11
import hypercorn.trio
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import hypercorn.trio.worker_context
import orjson
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext

import frontend.http.serving
from frontend.http.serving import ServerConfig, limits, serve
from frontend.http.serving.h11_protocol import HeadWithBodyH11Protocol
from frontend.http.serving.tcp_server import HeadwaterTCPServer, IdleDeadline

from frontend_fixture import serve_frontend


class Fingerprint(NamedTuple):
    sha256: str  # of inspect.getsource(the object)
    assumes: str  # what frontend/http/serving (or the middleware) takes for granted of it


#: Taken on Hypercorn 0.18.0, Quart 0.22.0, quart-trio 0.12.0, h11 0.16.0, Werkzeug 3.1.9.
UPSTREAM: dict[str, Fingerprint] = {
    # -- serve: a trimmed copy of hypercorn's trio serve + worker_serve -------------------
    "hypercorn.trio.serve": Fingerprint(
        "9b117d42d6cfa7efb9bf5797e6a710ffe1711bab4241514f77fb038758ac440d",
        "serving.serve replaces it: an ASGI app wrapped as wrap_app does, then worker_serve",
    ),
    "hypercorn.trio.run.worker_serve": Fingerprint(
        "8dc8347a9fc357ca334f8c3e4bcf0368176510a96d434f21a5eb4c9ec4103726",
        "serving.serve is a trimmed copy: lifespan around serving, sockets from "
        "config.create_sockets() listened with config.backlog, TCPServer(app, config, "
        "context, ConnectionState(state)) per connection via trio.serve_listeners, then "
        "context.terminated and graceful_timeout on the connections' nursery",
    ),
    "hypercorn.utils.wrap_app": Fingerprint(
        "5d4461d4411659986ab363b57222d0afda512353589e788d3fc5836c8da97086",
        "an ASGI app is served wrapped in ASGIWrapper, which serving.serve does directly",
    ),
    "hypercorn.config.Config.create_sockets": Fingerprint(
        "3ba0bab3918e423892feb61b957284db8c1dbad94c4b03b07503e620d44c0191",
        "with certfile and keyfile (ssl_enabled) every bind is a secure socket and every "
        "insecure_bind an insecure one; without, every bind is insecure. serving.serve "
        "serves the secure ones through trio.SSLListener, as worker_serve does",
    ),
    "hypercorn.config.Config.create_ssl_context": Fingerprint(
        "66241a00f51671986aecac9b4e4e36311b47cabe2d0eb8d8fc0619980b975a35",
        "a server context (TLS 1.2 at least) with config.alpn_protocols and the cert chain, "
        "None without TLS; serving.serve sets its ALPN to http/1.1 only afterwards",
    ),
    "hypercorn.config.Config._create_sockets": Fingerprint(
        "f9db20c33480ad651c9a2bf440e47cdaaf79424157cd3c534daa9f7e946eb58d",
        "fd://N adopts an inherited socket without binding; host:port binds with "
        "TCP_NODELAY; each socket is non-blocking",
    ),
    "hypercorn.trio.lifespan.Lifespan": Fingerprint(
        "7c58a46fd071744280113d8af1448b72347441bfe0c359a7f68e94c791db9412",
        "serving.serve starts handle_lifespan with nursery.start, awaits wait_for_startup "
        "before binding and wait_for_shutdown after the last connection",
    ),
    "hypercorn.trio.worker_context.WorkerContext": Fingerprint(
        "45885f0c0bd5bc9d518c227f36f400e069f481c26a5ac6d1744f179d5a55ddbd",
        "WorkerContext(None) has no max_requests; terminated is the event that closes idle "
        "connections on shutdown (IdleDeadline waits on it)",
    ),
    # -- HeadwaterTCPServer: overrides and what they rely on ------------------------------
    "hypercorn.trio.tcp_server.TCPServer.__init__": Fingerprint(
        "4c1d42457bc197b22f41b54b7dd6a79e195cdc037f9cc55f50e3e4332ebf6988",
        "HeadwaterTCPServer.__init__ calls it, then replaces idle_task (a TrioSingleTask) "
        "with an IdleDeadline; config, context, stream and send_lock are set here",
    ),
    "hypercorn.trio.tcp_server.TCPServer.run": Fingerprint(
        "fd34b021d1a86c9859514de9472306ea47f4a6763732b26b7a5945278ded0e08",
        "builds self.protocol (a ProtocolWrapper) and calls only its initiate() and "
        "idle_task.restart(self._task_group, self._idle_timeout) before _read_data(), "
        "where the H11Protocol is replaced: nothing is sent before that. It tells a TLS "
        "stream by do_handshake (awaited again: a no-op once serving.serve did it) and "
        "reads the peer from its transport_stream",
    ),
    "hypercorn.trio.tcp_server.TCPServer.protocol_send": Fingerprint(
        "225856426bff7be02990c0badb90f51f801db14ac5db0f3d0c210cafbeb528ab",
        "the override copies its RawData branch (send_all under send_lock, Closed() to the "
        "protocol on a broken stream) and hands Closed/Updated events to it",
    ),
    "hypercorn.trio.tcp_server.TCPServer._read_data": Fingerprint(
        "7ca747d922c65cf1fb6bd7ceabe82b0b51bb9de218ce159d7b7e093ec279f728",
        "the override is a copy (read_timeout per read, RawData per read, Closed at EOF or "
        "error) with reads of config.read_size/read_size_large, idle_task.end(), and the "
        "deadlines of header_timeout and body_read_timeout",
    ),
    "hypercorn.trio.tcp_server.TCPServer._close": Fingerprint(
        "bc73c4ae25a1ceec1d535639443b57b3d3dea8b03c5375d58bf9702b8056ee15",
        "closes a TLS stream too (send_eof raises AttributeError there): aclose, which an "
        "https_compatible SSLStream does without a close_notify, so it cannot block. The "
        "override lingers first (send_eof, reads dropped) while a request body is unread",
    ),
    "hypercorn.trio.tcp_server.TCPServer._idle_timeout": Fingerprint(
        "210ce1014d98e1cba3c0e2218c53a1c1a1c361cd86457168cbb9391ebb139d1d",
        "IdleDeadline._watch does what it does: wait for context.terminated up to "
        "keep_alive_timeout, then a shielded _initiate_server_close()",
    ),
    "hypercorn.trio.tcp_server.TCPServer._initiate_server_close": Fingerprint(
        "7c1b548a65adc8b1b1358fdacbc860be3070fe99d5b1bdcfcde4c5c73a9cce03",
        "IdleDeadline._watch calls it to close an idle connection",
    ),
    "hypercorn.trio.worker_context.TrioSingleTask": Fingerprint(
        "aa59316c028b876ad16369d57fcf70a82969bfb76436df033de96541935c7212",
        "IdleDeadline stands in for it: restart(task_group, action) and stop() are the "
        "whole interface TCPServer uses",
    ),
    "hypercorn.trio.task_group.TaskGroup.__aenter__": Fingerprint(
        "38047eb0284cdaa65b826a9f2048c1567bd20f40c8bd43c94b4d6cceb7739874",
        "task_group._nursery is the connection's nursery, where IdleDeadline starts its task",
    ),
    # -- HeadWithBodyH11Protocol -----------------------------------------------------------
    "hypercorn.protocol.ProtocolWrapper.__init__": Fingerprint(
        "df25e181b9e2e64d6d5dbfee9e9a33108c1f04b966dd344899365f429806acbc",
        "for any ALPN protocol but h2 it builds .protocol = H11Protocol(app, config, "
        "context, task_group, state, ssl, client, server, send) from its own attributes "
        "of those names; HeadwaterTCPServer builds a HeadWithBodyH11Protocol from the same",
    ),
    "hypercorn.protocol.ProtocolWrapper.handle": Fingerprint(
        "b03e2962872c85e879a5a62968a507c4cceb8df21e8eecd467b0934206a26821",
        "replaces .protocol only by an H2Protocol (h2c, prior knowledge), never by a new "
        "H11Protocol that would miss the replacement",
    ),
    "hypercorn.protocol.h11.H11Protocol.__init__": Fingerprint(
        "c7c989fd6a352626afee9d339296d51b2db1dfa05ad75ccdc7080799d6d6a5a3",
        "building one has no effect beyond the object, so the one the wrapper built and "
        "HeadwaterTCPServer discards leaves nothing behind; its h11.Connection refuses "
        "an incomplete event over config.h11_max_incomplete_size (--max-header-bytes)",
    ),
    "hypercorn.protocol.h11.H11Protocol.initiate": Fingerprint(
        "26647521eaf1bc259a6592167ffedd82cf8a742cb070985e0dfc1c20ad6344e0",
        "sends nothing, so no response starts before the protocol is replaced",
    ),
    "hypercorn.protocol.h11.H11Protocol._send_h11_event": Fingerprint(
        "5e40283daa303ec7f910e95145a9edd2b835fb54675ba1b1a560fbd58f136e19",
        "the override is a copy that holds a known-length head until the next event",
    ),
    "hypercorn.protocol.h11.H11Protocol.stream_send": Fingerprint(
        "56a36254a368d71ab24ee76d72783226387f6ce3a82c52840a947b9d905ebf5b",
        "a Response is followed by its Body or EndBody, each sent through _send_h11_event "
        "(which releases a held head); Data goes around it (websocket) unaffected",
    ),
    "hypercorn.protocol.h11.H11Protocol._send_error_response": Fingerprint(
        "58c2b47ae295d000c65a2216fa6afd9efb1ea05363a40d5dbf427b1d2b41b4c7",
        "its head (content-length: 0) is held until its EndOfMessage, one write. The "
        "override sends 431 and 408 with a body and the same head fields, the rest as it is",
    ),
    "hypercorn.protocol.h11.H11Protocol._handle_events": Fingerprint(
        "bd4a76b2837e872273a69e31a827fbcfd6a74c31bfcc59ac6ece1976af9aaed1",
        "the override is a copy (an h11 RemoteProtocolError answered with "
        "_send_error_response(error_status_hint) while no response has started, then "
        "Closed; a Request stops the idle timer (Updated(idle=False))) with the head "
        "checks, no 100 Continue, and no _check_protocol (no h2c or HTTP/2 switch)",
    ),
    "hypercorn.protocol.h11.H11Protocol._create_stream": Fingerprint(
        "a2338a57ab343908f55d6a93b9d4a69aa6ccc39e49fc387e66b286f5cb274743",
        "keep_alive_requests grows by one per request head: _read_data sees by it that a "
        "head ended (even when its whole request was served in the same handle call)",
    ),
    # -- h11, under hypercorn's H11Protocol --------------------------------------------------
    "h11._connection.Connection.next_event": Fingerprint(
        "7d3288bcc261c49c5423dde1a02204cda592867cb286f2371abf8aa67cfa4648",
        "raises RemoteProtocolError(error_status_hint=431) for an event still incomplete "
        "with more than max_incomplete_event_size bytes buffered, and only then: "
        "limits.head_fault measures every head, whole or pipelined, before h11 reads it",
    ),
    "h11._receivebuffer.ReceiveBuffer.__iadd__": Fingerprint(
        "a03c95836758ab440617b9368192c4daa74979359781e91e6e4ffd1a11a3b832",
        "the bytes received and not yet parsed are ReceiveBuffer._data, in order, from "
        "its start (h11_protocol._buffered reads the next head's first bytes there)",
    ),
    "h11._receivebuffer.ReceiveBuffer._extract": Fingerprint(
        "9f46b67fb9e571647f3ab7f15d73e8ab631c559d850f969554242f6bef5c12cd",
        "what h11 parses is cut from the start of _data",
    ),
    "h11._receivebuffer.ReceiveBuffer.maybe_extract_lines": Fingerprint(
        "435e54e6db463e3195959055e6d7c544e29f1afe3daaa3785e3208ceb3401052",
        "a head ends at the first blank line (blank_line_regex, which limits._BLANK_LINE copies)",
    ),
    # -- ShieldFinalSend (frontend/http/middleware.py) ---------------------------------------
    "hypercorn.protocol.http_stream.HTTPStream.app_send": Fingerprint(
        "c806044b997369855904b5496ef44bd2bf273f599e686647500ce507c1b0250b",
        "the response finishes inside the last http.response.body send (EndBody, then "
        "StreamClosed: http.disconnect to the app, the idle timer restarted)",
    ),
    "quart.asgi.ASGIHTTPConnection.handle_messages": Fingerprint(
        "c69dd49dbf636109e9f22d5970782611bff650f840d3bfb24c2ec11c3b913ee6",
        "returns on http.disconnect, which hypercorn sends from inside the final send",
    ),
    "quart_trio.asgi.TrioASGIHTTPConnection": Fingerprint(
        "6393e71c2a5138be0f89e98c65444e2dfa41309ac2ed855fa36cad56cea4b38d",
        "cancels the request's nursery when handle_messages returns, i.e. during the final "
        "body send, which ShieldFinalSend therefore shields; RESPONSE_TIMEOUT bounds sends",
    ),
    # -- MemoMatcher (frontend/http/routing.py) ----------------------------------------------
    "werkzeug.routing.map.Map.__init__": Fingerprint(
        "4160b615dac66cef77aa5a4c1ed83beda1d78e9a002f4fc2761e0d54b1659a33",
        "the map's matcher is a StateMachineMatcher(merge_slashes) in self._matcher, which "
        "use_memo_matcher replaces",
    ),
    "werkzeug.routing.map.Map.add": Fingerprint(
        "2ab4650ad936e433a04dd783409374ee32e24b5290d77cbee7a7d93a28d72895",
        "every rule added reaches self._matcher.add (which forgets the memo)",
    ),
    "werkzeug.routing.map.MapAdapter.match": Fingerprint(
        "d60987ae51086935610beee328387d221cb5d2a5e8aecddd3f288cb2bcb3acd5",
        "routes by self.map._matcher.match(domain, path, method, websocket) -> (rule, values)",
    ),
    "werkzeug.routing.matcher.StateMachineMatcher.match": Fingerprint(
        "d88222f105f8fe693c40f4bd70db4a34b9979e4e35e0dc7e142e0853557bb4ad",
        "a match depends on (domain, path, method, websocket) and the rules alone, and a "
        "rule with no converters, defaults or alias matches as (rule, {}); its recursive "
        "_match closure is a reference cycle per call",
    ),
}


def _resolve(name: str) -> Any:
    """The object a dotted name denotes: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise LookupError(name)


def _versions() -> str:
    pinned = ("hypercorn", "quart", "quart-trio", "h11", "werkzeug")
    return ", ".join(f"{d} {importlib.metadata.version(d)}" for d in pinned)


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_code_is_the_code_the_seam_was_written_against(name: str) -> None:
    expected = UPSTREAM[name]
    digest = hashlib.sha256(inspect.getsource(_resolve(name)).encode()).hexdigest()
    if digest != expected.sha256:
        pytest.fail(
            f"{name} has changed upstream (installed: {_versions()}). Re-check the "
            f"seam (frontend/http/serving, frontend/http/middleware.py, "
            f"frontend/http/routing.py) against it; it "
            f"assumes: {expected.assumes}. "
            f"Then set its fingerprint to {digest}.",
            pytrace=False,
        )


def test_the_default_read_size_is_hypercorns() -> None:
    assert ServerConfig.read_size == MAX_RECV


@pytest.mark.parametrize(
    ("ours", "theirs"), [(HeadwaterTCPServer, TCPServer), (HeadWithBodyH11Protocol, H11Protocol)]
)
def test_every_override_is_fingerprinted_and_no_new_name_clashes(ours: type, theirs: type) -> None:
    # An upgrade that adds a method of the same name as one of ours would be overridden
    # silently; one that an override replaces must have a fingerprint to notice changes.
    upstream_source = inspect.getsource(inspect.getmodule(theirs))  # type: ignore[arg-type]
    for name, value in vars(ours).items():
        if name.startswith("__") and name != "__init__":
            continue
        if hasattr(theirs, name):
            assert callable(value), name
            assert f"{theirs.__module__}.{theirs.__qualname__}.{name}" in UPSTREAM, name
        else:
            assert name not in upstream_source, f"{theirs.__qualname__} now has {name}"


def test_the_config_fields_of_the_fixes_are_not_hypercorns() -> None:
    # hypercorn reads its own fields; one of the same name added upstream would be both.
    ours = {name for name in vars(ServerConfig) if not name.startswith("_")}
    assert ours == {
        "write_timeout",
        "read_size",
        "read_size_large",
        "header_timeout",
        "body_read_timeout",
        "max_connections_per_client",
        "on_refusal",
        "refused",
        "on_answer",
        "answered",
        "accept_balance",
        "linger_timeout",
    }
    assert not [name for name in ours if hasattr(Config, name)]


def test_the_head_ends_where_h11_ends_it() -> None:
    assert limits._BLANK_LINE.pattern == h11._receivebuffer.blank_line_regex.pattern


def test_the_public_names() -> None:
    assert frontend.http.serving.__all__ == ["REFUSAL_REASONS", "ServerConfig", "serve"]
    assert issubclass(ServerConfig, Config)


# -- Nothing in hypercorn changes ---------------------------------------------------------


_WATCHED: tuple[Any, ...] = (
    hypercorn.trio,
    hypercorn.trio.run,
    hypercorn.trio.tcp_server,
    hypercorn.trio.worker_context,
    hypercorn.protocol,
    hypercorn.protocol.h11,
    TCPServer,
    TrioSingleTask,
    WorkerContext,
    ProtocolWrapper,
    H11Protocol,
    Config,
)


def _snapshot() -> dict[str, dict[str, Any]]:
    return {
        obj.__name__: {k: v for k, v in vars(obj).items() if k != "__warningregistry__"}
        for obj in _WATCHED
    }


def _local_port(server: Any) -> int | None:
    try:
        return int(server.stream.socket.getsockname()[1])
    except (AttributeError, OSError):
        return None


def _instances(cls: type) -> Iterator[Any]:
    """The live instances of exactly *cls* (connections of earlier tests collected)."""
    gc.collect()
    return (o for o in gc.get_objects() if type(o) is cls)


@pytest.mark.slow
async def test_serving_through_the_seam_leaves_hypercorn_untouched() -> None:
    before = _snapshot()
    originals = (
        TCPServer.__init__,
        TCPServer.protocol_send,
        TCPServer._read_data,
        H11Protocol._send_h11_event,
        hypercorn.trio.tcp_server.TrioSingleTask,  # type: ignore[attr-defined]
    )
    # The keep-alive outlasts _instances()'s gc.collect() (0.3-0.4 s on a busy machine).
    async with serve_frontend(keep_alive_timeout=1.5) as (fe, url), httpx.AsyncClient() as client:
        body = {
            "model": fe.pipeline.model_name,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}],
        }
        assert (await client.post(url + "/v1/chat/completions", json=body)).status_code == 200
        # The connection being served is the seam's, its protocol the subclass. (Only
        # this frontend's: a connection of an earlier test may not be collected yet.)
        port = int(url.rsplit(":", 1)[1])
        (server,) = [s for s in _instances(HeadwaterTCPServer) if _local_port(s) == port]
        assert type(server.protocol.protocol) is HeadWithBodyH11Protocol
        assert type(server.idle_task) is IdleDeadline
        # A connection of its own: the first may have idled out during the collection.
        async with (
            httpx.AsyncClient() as second,
            second.stream(
                "POST", url + "/v1/completions", json={**body, "prompt": "hi", "stream": True}
            ) as r,
        ):
            assert [line async for line in r.aiter_lines()][-2] == "data: [DONE]"
        await trio.sleep(2.0)  # the connection idles out
    assert (
        TCPServer.__init__,
        TCPServer.protocol_send,
        TCPServer._read_data,
        H11Protocol._send_h11_event,
        hypercorn.trio.tcp_server.TrioSingleTask,  # type: ignore[attr-defined]
    ) == originals
    after = _snapshot()
    for owner, names in before.items():
        assert after[owner].keys() == names.keys(), owner
        assert [k for k, v in names.items() if after[owner][k] is not v] == [], owner


# -- serve ---------------------------------------------------------------------------------


class _App:
    """A bare ASGI app: a lifespan log, ``/`` answers at once, ``/slow`` after 0.3 s."""

    def __init__(self) -> None:
        self.lifespan: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                stage = message["type"].removeprefix("lifespan.")
                self.lifespan.append(stage)
                await send({"type": f"lifespan.{stage}.complete"})
                if stage == "shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            await trio.sleep(0.3)
        body = orjson.dumps({"path": scope["path"]})
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _config(*binds: str, **fields: Any) -> ServerConfig:
    config = ServerConfig.from_mapping(accesslog=None, errorlog=None, **fields)
    config.bind = list(binds or ["127.0.0.1:0"])
    return config  # type: ignore[return-value]


def _serving(app: _App, config: ServerConfig, stop: trio.Event) -> Callable[..., Awaitable[None]]:
    return partial(serve, app, config, shutdown_trigger=stop.wait)


async def test_serve_runs_the_lifespan_around_serving_and_shuts_down_gracefully() -> None:
    app, stop = _App(), trio.Event()
    slow: list[httpx.Response] = []
    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        (url,) = await nursery.start(_serving(app, _config(graceful_timeout=5.0), stop))
        assert app.lifespan == ["startup"]
        assert (await client.get(url + "/")).json() == {"path": "/"}  # then idle

        async def in_flight() -> None:
            slow.append(await client.get(url + "/slow"))

        nursery.start_soon(in_flight)
        await trio.sleep(0.1)
        start = trio.current_time()
        stop.set()
        # The idle connection closed, the request in flight finished, then serve
        # returned with the lifespan shut down; well within graceful_timeout.
    assert slow[0].json() == {"path": "/slow"}
    assert trio.current_time() - start < 2.0
    assert app.lifespan == ["startup", "shutdown"]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(OSError):
        await trio.open_tcp_stream(host, int(port))


async def test_serve_serves_an_inherited_listening_socket() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    fd = sock.detach()  # serve owns it now, as a --listen-fd child does
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(_serving(_App(), _config(f"fd://{fd}", "127.0.0.1:0"), stop))
        assert urls[0] == f"http://127.0.0.1:{port}"
        assert len(urls) == 2
        async with httpx.AsyncClient() as client:
            for url in urls:
                assert (await client.get(url + "/")).status_code == 200
        stop.set()


@pytest.mark.parametrize(
    "fields",
    [{"quic_bind": ["127.0.0.1:0"]}, {"statsd_host": "127.0.0.1:8125"}, {"max_requests": 10}],
)
async def test_serve_refuses_what_it_does_not_support(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="does not support"):
        await serve(_App(), _config(**fields), shutdown_trigger=trio.sleep_forever)


@pytest.mark.parametrize("fields", [{"certfile": "c.pem"}, {"keyfile": "k.pem"}])
async def test_serve_refuses_half_a_tls_config(fields: dict[str, Any]) -> None:
    # hypercorn would serve plain HTTP with either alone.
    with pytest.raises(ValueError, match="both a certfile and a keyfile"):
        await serve(_App(), _config(**fields), shutdown_trigger=trio.sleep_forever)


@pytest.mark.slow
async def test_hypercorns_own_serve_alongside_is_hypercorn_as_it_is() -> None:
    # Two servers in one process: the seam's connection gets the seam's classes, a
    # connection of hypercorn's own serve gets hypercorn's.
    stop = trio.Event()
    plain = Config()
    plain.bind, plain.accesslog, plain.errorlog = ["127.0.0.1:0"], None, None
    async with trio.open_nursery() as nursery:
        (ours,) = await nursery.start(_serving(_App(), _config(), stop))
        (theirs,) = await nursery.start(
            partial(hypercorn.trio.serve, _App(), plain, shutdown_trigger=stop.wait)
        )
        async with httpx.AsyncClient() as a, httpx.AsyncClient() as b:
            assert (await a.get(ours + "/")).status_code == 200
            assert (await b.get(theirs + "/")).status_code == 200
            (seam,) = _instances(HeadwaterTCPServer)
            (upstream,) = _instances(TCPServer)
            assert type(seam.protocol.protocol) is HeadWithBodyH11Protocol
            assert type(upstream.protocol.protocol) is H11Protocol
            assert type(upstream.idle_task) is TrioSingleTask
        stop.set()


class _FakeProtocol:
    protocol = None

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


async def test_each_connection_takes_its_write_timeout_from_its_own_config(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dropped: dict[float, float] = {}

    async def stalled_write(write_timeout: float) -> None:
        server_side, client_side = trio.testing.lockstep_stream_pair()
        fake = HeadwaterTCPServer.__new__(HeadwaterTCPServer)  # what protocol_send touches
        fake.stream = server_side  # type: ignore[assignment]
        fake.config = _config(write_timeout=write_timeout)
        fake.send_lock = trio.Lock()
        fake.protocol = _FakeProtocol()  # type: ignore[assignment]
        start = trio.current_time()
        await fake.protocol_send(RawData(b"x" * 1024))  # nobody reads client_side
        assert any(isinstance(e, Closed) for e in fake.protocol.events)  # type: ignore[attr-defined]
        dropped[write_timeout] = trio.current_time() - start
        await client_side.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled_write, 3.0)
        nursery.start_soon(stalled_write, 7.0)
    assert dropped == {3.0: 3.0, 7.0: 7.0}
