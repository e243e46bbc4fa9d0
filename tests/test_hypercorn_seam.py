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
import importlib.resources
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
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from quart.asgi import ASGIHTTPConnection

import frontend.http.serving
from frontend.http.connection import EndingHTTPConnection
from frontend.http.serving import ServerConfig, limits, serve
from frontend.http.serving.h11_protocol import HeadWithBodyH11Protocol
from frontend.http.serving.httptools_protocol import HttptoolsProtocol
from frontend.http.serving.stream import EndingHTTPStream
from frontend.http.serving.tcp_server import HeadwaterTCPServer, IdleDeadline

from frontend_fixture import serve_frontend


class Fingerprint(NamedTuple):
    sha256: str  # of inspect.getsource(the object)
    assumes: str  # what frontend/http/serving (or the middleware) takes for granted of it


#: Taken on Hypercorn 0.18.0, Quart 0.22.0, quart-trio 0.12.0, h11 0.16.0, Werkzeug 3.1.9,
#: httptools 0.9.0.
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
        "(which releases a held head); Data goes around it (websocket) unaffected. The "
        "override sends a LastBody as h11 Data and EndOfMessage, in one write",
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
        "head ended (even when its whole request was served in the same handle call); the "
        "override is a copy for an HTTP request (no Upgrade reaches it: no websocket) "
        "that makes an EndingHTTPStream",
    ),
    # -- HttptoolsProtocol: hypercorn's H11Protocol, with llhttp and h11's rules ---------------
    "hypercorn.protocol.h11.H11Protocol.handle": Fingerprint(
        "3b56e067447488df5e480fc728e20c7fcc9f5813374172a197fa555ec13c0e1c",
        "HttptoolsProtocol.handle does what it does: RawData to the parser (b'': the "
        "client's EOF, which h11 reads from receive_data(b'')), Closed closes the stream",
    ),
    "hypercorn.protocol.h11.H11Protocol._maybe_recycle": Fingerprint(
        "3ac53f52bc4e65de7e9b898df5c1c76c9865479e2821ed524acdf426c2075a88",
        "HttptoolsProtocol's copy: the stream closed, then the next cycle (can_read set, "
        "Updated(idle=True)) only when both sides are DONE (h11: keep-alive) and the "
        "server is not terminating, else can_read set and Closed",
    ),
    "hypercorn.protocol.h11.H11Protocol._close_stream": Fingerprint(
        "378930655d7bb41af90a2648eab11fed188c98ea9ec9dcbbdcacc37d550b5cf8",
        "HttptoolsProtocol's copy: StreamClosed to the stream, then no stream",
    ),
    "hypercorn.protocol.http_stream.HTTPStream.handle": Fingerprint(
        "6ed2e34c5e708c6aae3d2c9f56c7088379602ee3e1dbf406cd45024b3ed0a7db",
        "a Request spawns the app; Body, EndBody and StreamClosed reach it as "
        "http.request and http.disconnect: what either protocol hands a stream",
    ),
    "hypercorn.protocol.events": Fingerprint(
        "d22d1846c7821b3f71292e683ff0763224e5b5c86ab4e636efdc8bad0a3eab2e",
        "the stream events HttptoolsProtocol makes and takes, with these fields",
    ),
    "hypercorn.config.Config.response_headers": Fingerprint(
        "5a637c3d48180e55020523bbe601bbffbaae225baf265cd61f88efbe8171a9ca",
        "date and server fields, the same for both protocols with the label 'h11'",
    ),
    # h11's rules, which http11_codec writes again for llhttp (tests/test_http_parsers.py
    # compares the two protocols' answers).
    "h11._connection._keep_alive": Fingerprint(
        "eac4961738765ee6cfeabd31c012fd912f35e0448b1a19515f30fbf8061b138c",
        "http11_codec.keep_alive: HTTP/1.1 and no Connection: close",
    ),
    "h11._connection._body_framing": Fingerprint(
        "bbbb12006a0c9b1d346ed79ea99c7741018ee0a86cee2ac9d2c8313cbe289a58",
        "http11_codec.response_head's framing: no body for 204, 304, HEAD and a 2xx "
        "CONNECT, then chunked, then Content-Length, else read to close",
    ),
    "h11._connection.Connection._clean_up_response_headers_for_sending": Fingerprint(
        "a190401e4767c6414c345892d44596a3bf982099707984b507166bc814fb0b3f",
        "http11_codec.response_head's fields: chunked (HTTP/1.1) or bare and closing "
        "(older) for an unknown length, Connection: close with the other tokens sorted",
    ),
    "h11._connection.Connection._extract_next_receive_event": Fingerprint(
        "c0fc7051975f7a5b661f541f55f50bfd52066bffd6a208bdf09d8c54a4184c87",
        "a request waits (PAUSED) while the one before is DONE and bytes are buffered; "
        "the client's EOF is ConnectionClosed when nothing is buffered",
    ),
    "h11._connection.Connection._process_event": Fingerprint(
        "34a61e13cd672ae1011fb299f6517f8348d282828bd56804f472c1a49b03dc22",
        "the client stops waiting for 100 Continue at its first Data or EndOfMessage, "
        "or at the server's first response; a response may disable keep-alive",
    ),
    "h11._headers.normalize_and_validate": Fingerprint(
        "82a8fcccb31d27d4bd375b79fe1906258773dc164469e70ee07b6eca07d74c6b",
        "http11_codec: a transfer coding other than chunked, or two, is 501; a response's "
        "fields are checked and its Content-Length list made one value",
    ),
    "h11._headers.has_expect_100_continue": Fingerprint(
        "75de2ad05b2cea54bb8ad1786cbf531d7b728ff48e24b60cdc66e6d1c181fae6",
        "http11_codec.wants_continue: HTTP/1.1 and Expect: 100-continue",
    ),
    "h11._events.Request.__init__": Fingerprint(
        "e465e693adb3ceb430c65d7d0611a97390a23599b7780d1ed9da1dab65bd2bcb",
        "http11_codec.request_head_status: one Host field, required on HTTP/1.1",
    ),
    "h11._readers.maybe_read_from_IDLE_client": Fingerprint(
        "b0ae12d92b2c4db98cdc1c3519d857bedfd93a0d5d69148b9e2763c7ac514076",
        "a head whose first byte is below 0x21 is refused before it ends "
        "(HttptoolsProtocol._read_head does the same)",
    ),
    "h11._readers.ChunkedReader": Fingerprint(
        "4d2629eeaaf366b636b5d890b9eedf3c71d316ddb89e10d58786fc7cee1105fe",
        "http11_codec.ChunkedExtent reads the framing the same way: size line, data and "
        "CRLF, trailers until an empty line",
    ),
    "h11._writers.write_any_response": Fingerprint(
        "2dac073224410815f2f8b923ac3724175b52194f3b484daa3370eb66480969b7",
        "the status line has no reason phrase (http11_codec._head_bytes)",
    ),
    "h11._writers.write_headers": Fingerprint(
        "aeb8aefa9b19e88121530f1b632497244d06c52600869b940f2698b089364a3c",
        "fields as given, a Host field first (http11_codec._head_bytes)",
    ),
    "h11._writers.ChunkedWriter": Fingerprint(
        "816f6bf8247fe299cabea803020f0e797afe64e59640df2099bab46ae3da6e50",
        "HttptoolsProtocol writes chunks the same way, and ends with 0 and a blank line",
    ),
    "h11._abnf": Fingerprint(
        "c9b8b1af4c6cba99e403a18503232e6ee5c5e9373595bfe117cf743600ac7cd7",
        "http11_codec's field name, field value and chunk size patterns are its own",
    ),
    "httptools.parser.errors": Fingerprint(
        "655aed375b263c86ffa2943651ddee09b1a534b32510260cdbee92eebe4b9c7b",
        "HttpParserUpgrade (not an HttpParserError) for an upgrade or CONNECT, "
        "HttpParserError for anything llhttp refuses",
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
        "StreamClosed: http.disconnect to the app, the idle timer restarted); a last "
        "body with bytes in RESPONSE state is Body(bytes(body)) unless suppress_body, "
        "then _send_closed unless trailers: EndingHTTPStream sends it as one LastBody",
    ),
    # -- EndingHTTPStream (frontend/http/serving/stream.py) ----------------------------------
    "hypercorn.protocol.http_stream.HTTPStream._send_closed": Fingerprint(
        "9aaf2e1ac611e51c85bb587cc9ca28f7db77e8ec03b43231ee0efc42a4c40393",
        "EndBody, state CLOSED, the access log, StreamClosed: EndingHTTPStream does the "
        "same after its LastBody, which stands for Body and EndBody",
    ),
    # -- EndingHTTPConnection (frontend/http/connection.py) ----------------------------------
    "quart.asgi.ASGIHTTPConnection._send_response": Fingerprint(
        "2958216ed9d8d2ebf66be8a3fbcf2a2cb50a2e89a77b196a1f919e834f7c49c7",
        "a head (status, encode_headers(headers)), a message per piece of the body with "
        "more_body, then an empty last one: the override sends the same bytes, a known "
        "body and a stream's LastPiece as the last message",
    ),
    "quart.wrappers.response.DataBody": Fingerprint(
        "a0ec2d37126227306b77656ffd08f4b51b33af5d24d78e44bee78fc409f6b1f3",
        "its bytes are data[begin:end], in one piece",
    ),
    "quart.wrappers.response.IterableBody": Fingerprint(
        "6000c4eb1baca62281f8a192d253a6042948d885086796b140529dbd06d16c26",
        "iterates the app's async iterable itself (a LastPiece reaches the connection as "
        "yielded) and closes it on exit",
    ),
    "quart.asgi.ASGIHTTPConnection.handle_messages": Fingerprint(
        "c69dd49dbf636109e9f22d5970782611bff650f840d3bfb24c2ec11c3b913ee6",
        "returns on http.disconnect, which hypercorn sends from inside the final send",
    ),
    "quart_trio.asgi.TrioASGIHTTPConnection": Fingerprint(
        "6393e71c2a5138be0f89e98c65444e2dfa41309ac2ed855fa36cad56cea4b38d",
        "cancels the request's nursery when handle_messages returns, i.e. during the final "
        "body send, which ShieldFinalSend therefore shields; RESPONSE_TIMEOUT bounds sends. "
        "EndingHTTPConnection.__call__ runs handle_messages in the nursery's own task, "
        "handle_request as its one child, as __call__ starts both",
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


#: Upstream files that are not Python (a compiled module's source), as "package:file".
UPSTREAM_FILES: dict[str, Fingerprint] = {
    "httptools.parser:parser.pyx": Fingerprint(
        "c7405463d1331cd2820dac3e53c6e467531a286b6b390f225429b522e3ad1102",
        "HttpRequestParser(sink) calls the sink's on_url, on_header (a whole field: name, "
        "value without its leading whitespace), on_headers_complete, on_body and "
        "on_message_complete during feed_data, for the bytes given and no others; an "
        "upgrade skips the body and raises HttpParserUpgrade after on_message_complete; "
        "set_dangerous_leniencies(lenient_chunked_length=True) lets Content-Length with "
        "Transfer-Encoding through; get_method and get_http_version read the last head",
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
    pinned = ("hypercorn", "quart", "quart-trio", "h11", "werkzeug", "httptools")
    return ", ".join(f"{d} {importlib.metadata.version(d)}" for d in pinned)


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_code_is_the_code_the_seam_was_written_against(name: str) -> None:
    expected = UPSTREAM[name]
    digest = hashlib.sha256(inspect.getsource(_resolve(name)).encode()).hexdigest()
    if digest != expected.sha256:
        pytest.fail(
            f"{name} has changed upstream (installed: {_versions()}). Re-check the "
            f"seam (frontend/http/serving, frontend/http/middleware.py, "
            f"frontend/http/connection.py, frontend/http/routing.py) against it; it "
            f"assumes: {expected.assumes}. "
            f"Then set its fingerprint to {digest}.",
            pytrace=False,
        )


@pytest.mark.parametrize("name", list(UPSTREAM_FILES))
def test_upstream_files_are_the_files_the_seam_was_written_against(name: str) -> None:
    package, file = name.split(":")
    expected = UPSTREAM_FILES[name]
    digest = hashlib.sha256(importlib.resources.files(package).joinpath(file).read_bytes())
    if digest.hexdigest() != expected.sha256:
        pytest.fail(
            f"{name} has changed upstream (installed: {_versions()}). Re-check "
            f"frontend/http/serving/httptools_protocol.py against it; it assumes: "
            f"{expected.assumes}. Then set its fingerprint to {digest.hexdigest()}.",
            pytrace=False,
        )


def test_the_default_read_size_is_hypercorns() -> None:
    assert ServerConfig.read_size == MAX_RECV


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (HeadwaterTCPServer, TCPServer),
        (HeadWithBodyH11Protocol, H11Protocol),
        (HttptoolsProtocol, H11Protocol),  # not a subclass: its methods of the same names
        (EndingHTTPStream, HTTPStream),
        (EndingHTTPConnection, ASGIHTTPConnection),
    ],
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


@pytest.mark.parametrize("name", ["__init__", "initiate", "handle", "stream_send"])
def test_the_httptools_protocol_has_the_interface_of_hypercorns(name: str) -> None:
    # ProtocolWrapper and HeadwaterTCPServer call these, as they would H11Protocol's.
    ours = inspect.signature(getattr(HttptoolsProtocol, name))
    theirs = inspect.signature(getattr(H11Protocol, name))
    assert list(ours.parameters) == list(theirs.parameters)


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
        "http_parser",
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
async def test_serving_through_the_seam_leaves_hypercorn_untouched(http_parser: str) -> None:
    before = _snapshot()
    originals = (
        TCPServer.__init__,
        TCPServer.protocol_send,
        TCPServer._read_data,
        H11Protocol._send_h11_event,
        hypercorn.trio.tcp_server.TrioSingleTask,  # type: ignore[attr-defined]
    )
    # The keep-alive outlasts _instances()'s gc.collect() (0.3-0.4 s on a busy machine).
    async with (
        serve_frontend(keep_alive_timeout=1.5, http_parser=http_parser) as (fe, url),
        httpx.AsyncClient() as client,
    ):
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
        protocols = {"h11": HeadWithBodyH11Protocol, "httptools": HttptoolsProtocol}
        assert type(server.protocol.protocol) is protocols[http_parser]
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
            assert type(seam.protocol.protocol) is HttptoolsProtocol  # the default
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
