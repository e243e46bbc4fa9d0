"""Mutual TLS on the request plane: a frontend's client and workers, and the KV pull.

Test policy: real sockets on 127.0.0.1 port 0, workers run in-process with
``serve_worker`` (the mocker sped up so engine time vanishes), certificates made in the
test by a CA of its own (tls_fixture). Every refusal is bounded by ``connect_timeout``
(2 s here) and the test asserts it came well before that: a refusal, not a hang. One
test puts a whole frontend (frontend_fixture, ``--workers``) in front of TLS workers.
"""

from __future__ import annotations

import ssl
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trustme

from headwater.cli import build_parser, env_name
from headwater.cli import main as headwater_main
from headwater.plane.base import CannotConnect, WorkerError, WorkerInstance
from headwater.plane.client import connect_worker
from headwater.plane.connection import HandshakeFailed, PlaneConfig, dial, tcp_connector
from headwater.plane.server import PlaneServer
from headwater.plane.tls import TlsConfig, check_certificate, tls_config
from headwater.wire import ErrorCode, GenerateRequest, Role, SamplingParams
from headwater.wire.addresses import parse_tcp_address
from workers.engines.mocker import MockerConfig, MockerEngine
from workers.lifecycle import RunningWorker, WorkerConfig, serve_worker

from frontend_fixture import serve_frontend
from helpers import start_runtime
from tls_fixture import Pem, issue

MODEL = "deepseek-v4"
SECRET = b"correct horse battery"  # the secret's handshake runs inside TLS too
CONNECT = 2.0  # connect_timeout: every refusal must come well before it


def request(rid: str, max_tokens: int = 8, prompt: int = 100) -> GenerateRequest:
    return GenerateRequest(
        rid,
        MODEL,
        list(range(3, 3 + prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
    )


def tls_of(pem: Pem) -> TlsConfig:
    return TlsConfig(pem.certfile, pem.keyfile, pem.ca_file)


def plane(pem: Pem | None) -> PlaneConfig:
    return PlaneConfig(connect_timeout=CONNECT, tls=tls_of(pem) if pem else None)


async def start_worker(
    nursery: trio.Nursery, pem: Pem | None, *, role: Role = Role.AGG, **kw: object
) -> RunningWorker:
    config = WorkerConfig(
        role=role,
        engine_config=MockerConfig(speedup_ratio=100_000.0, kv_bytes_per_token=16),
        secret=SECRET,
        tls=tls_of(pem) if pem else None,
        **kw,  # type: ignore[arg-type]
    )
    worker: RunningWorker = await nursery.start(partial(serve_worker, config))
    return worker


def instance_of(worker: RunningWorker) -> WorkerInstance:
    return WorkerInstance(worker.worker_id, worker.role, worker.model, worker.address)


async def tokens(client: object, req: GenerateRequest) -> list[int]:
    async with client.stream(req) as chunks:  # type: ignore[attr-defined]
        return [t async for c in chunks for t in c.token_ids]


async def refused(connect: object) -> CannotConnect:
    """The error of the attempt that *connect* (an async callable) ends in, well within
    connect_timeout: a HandshakeFailed, unless said otherwise."""
    start = trio.current_time()
    with pytest.raises(CannotConnect) as info:
        await connect()  # type: ignore[operator]
    assert trio.current_time() - start < CONNECT * 0.75
    # dial raises it; connect_worker raises a CannotConnect caused by it.
    cause = info.value.__cause__
    return cause if isinstance(cause, CannotConnect) else info.value


# ---- a frontend's client and a worker ----------------------------------------------------


async def test_a_frontend_client_and_a_worker_over_mutual_tls(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    worker = await start_worker(nursery, issue(ca, tmp_path, "worker", "127.0.0.1"))
    frontend = issue(ca, tmp_path, "frontend", "frontend.headwater")
    client = await connect_worker(
        instance_of(worker), nursery, secret=SECRET, config=plane(frontend)
    )
    assert len(await tokens(client, request("a"))) == 8
    conn = client._conn
    assert conn is not None
    assert isinstance(conn._stream, trio.SSLStream)  # what the frames travel in
    assert conn._stream.version() == "TLSv1.3"
    stats = await client.fetch_stats()
    assert (stats["plane_tls_failures_total"], stats["plane_auth_failures_total"]) == (0, 0)


async def test_a_worker_that_closes_a_tls_connection_is_seen_to_close_it(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    # trio closes a TLS stream without close_notify on the worker's side (it aborts):
    # the client reads that as the worker closing, not as a broken read.
    worker = await start_worker(nursery, issue(ca, tmp_path, "worker", "127.0.0.1"))
    frontend = issue(ca, tmp_path, "frontend", "frontend.headwater")
    client = await connect_worker(
        instance_of(worker), nursery, secret=SECRET, config=plane(frontend)
    )
    conn = client._conn
    assert conn is not None
    await worker.server.close_connections(1.0)
    with trio.fail_after(5):
        await conn.closed.wait()
    assert conn.reason == "the worker closed the connection"


async def test_a_client_without_a_certificate_is_refused(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    worker = await start_worker(nursery, issue(ca, tmp_path, "worker", "127.0.0.1"))
    host, port = parse_tcp_address(worker.address)

    async def no_certificate() -> trio.SSLStream[trio.SocketStream]:
        context = ssl.create_default_context()
        ca.configure_trust(context)  # trusts the worker, has nothing to show it
        stream = trio.SSLStream(
            await trio.open_tcp_stream(host, port), context, server_hostname=host
        )
        await stream.do_handshake()  # TLS 1.3: the client's side ends before the check
        return stream

    failure = await refused(
        partial(
            dial, no_certificate, role="frontend", peer_id="anon", secret=SECRET, config=plane(None)
        )
    )
    assert isinstance(failure, HandshakeFailed)
    assert failure.code == "tls"
    assert "does it accept this end's certificate?" in str(failure)
    # A client that does not speak TLS at all gets no further.
    failure = await refused(
        partial(
            dial,
            tcp_connector(worker.address),
            role="frontend",
            peer_id="plain",
            secret=SECRET,
            config=plane(None),
        )
    )
    assert "TLS" in str(failure)
    assert worker.server.statistics().tls_failures_total == 2
    # The worker serves on, to a client with a certificate.
    frontend = issue(ca, tmp_path, "frontend", "frontend.headwater")
    client = await connect_worker(
        instance_of(worker), nursery, secret=SECRET, config=plane(frontend)
    )
    assert len(await tokens(client, request("b"))) == 8


async def test_a_wrong_ca_is_refused_either_way(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    worker = await start_worker(nursery, issue(ca, tmp_path, "worker", "127.0.0.1"))
    other = trustme.CA()
    # The client trusts another CA: it refuses the worker.
    mistrusting = issue(ca, tmp_path, "mistrusting", "frontend.headwater", trusting=other)
    failure = await refused(
        partial(
            connect_worker, instance_of(worker), nursery, secret=SECRET, config=plane(mistrusting)
        )
    )
    assert isinstance(failure, HandshakeFailed)
    assert failure.code == "tls"
    assert "certificate verify failed" in str(failure)
    # The client's certificate is another CA's: the worker refuses it.
    stranger = issue(other, tmp_path, "stranger", "frontend.headwater", trusting=ca)
    failure = await refused(
        partial(connect_worker, instance_of(worker), nursery, secret=SECRET, config=plane(stranger))
    )
    assert isinstance(failure, HandshakeFailed)
    assert failure.code == "tls"
    assert "refused by the worker" in str(failure)
    assert worker.server.statistics().tls_failures_total == 2


async def test_a_worker_whose_certificate_does_not_name_its_host_is_refused(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    elsewhere = issue(ca, tmp_path, "elsewhere", "gpu-7.internal")
    # serve_worker checks the advertised host against its own certificate, at start.
    with pytest.raises(ValueError, match=r"'127\.0\.0\.1'.*mismatch"):
        await start_worker(nursery, elsewhere)
    # A worker that skipped that check (a PlaneServer of its own) is refused by clients.
    engine = MockerEngine(MockerConfig(speedup_ratio=100_000.0), Role.AGG, "w-else")
    runtime = await start_runtime(nursery, engine, "w-else")
    server = PlaneServer(runtime, role=Role.AGG, model=MODEL, secret=SECRET, tls=tls_of(elsewhere))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    port = listeners[0].socket.getsockname()[1]
    instance = WorkerInstance("w-else", Role.AGG, MODEL, f"tcp://127.0.0.1:{port}")
    frontend = issue(ca, tmp_path, "frontend", "frontend.headwater")
    failure = await refused(
        partial(connect_worker, instance, nursery, secret=SECRET, config=plane(frontend))
    )
    assert isinstance(failure, HandshakeFailed)
    assert failure.code == "tls"
    assert "IP address mismatch" in str(failure)
    # Advertised under the name its certificate has, it passes the check.
    check_certificate(tls_of(elsewhere), "gpu-7.internal")


async def test_tls_against_a_plain_worker_is_refused(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    worker = await start_worker(nursery, None)
    frontend = issue(ca, tmp_path, "frontend", "frontend.headwater")
    failure = await refused(
        partial(connect_worker, instance_of(worker), nursery, secret=SECRET, config=plane(frontend))
    )
    assert isinstance(failure, HandshakeFailed)
    assert failure.code == "tls"
    assert "TLS handshake with 127.0.0.1" in str(failure)


# ---- the KV pull -------------------------------------------------------------------------


async def test_the_kv_pull_between_two_tls_workers(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    prefill = await start_worker(
        nursery, issue(ca, tmp_path, "prefill", "127.0.0.1"), role=Role.PREFILL
    )
    decode = await start_worker(
        nursery, issue(ca, tmp_path, "decode", "127.0.0.1"), role=Role.DECODE
    )
    frontend = plane(issue(ca, tmp_path, "frontend", "frontend.headwater"))
    to_prefill = await connect_worker(instance_of(prefill), nursery, secret=SECRET, config=frontend)
    to_decode = await connect_worker(instance_of(decode), nursery, secret=SECRET, config=frontend)
    req = request("disagg", max_tokens=5, prompt=3000)
    async with to_prefill.stream(req) as chunks:
        (handoff,) = [c async for c in chunks]
    handle = handoff.kv_handle
    assert handle is not None
    decode_leg = GenerateRequest(req.request_id, MODEL, req.token_ids, req.sampling, handle)
    assert len(await tokens(to_decode, decode_leg)) == 5
    p, d = await to_prefill.fetch_stats(), await to_decode.fetch_stats()
    assert p["plane_kv_pulls_served_total"] == 1
    assert p["plane_kv_bytes_served_total"] == d["kv_bytes_total"] == 3000 * 16
    assert p["plane_connections"] == 2  # the frontend's and the decode worker's
    assert p["plane_tls_failures_total"] == 0
    assert decode.kv_transfer is not None
    (kv_conn,) = decode.kv_transfer._connections.values()
    assert isinstance(kv_conn._stream, trio.SSLStream)


async def test_a_decode_worker_without_tls_cannot_pull_from_a_tls_prefill_worker(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery
) -> None:
    prefill = await start_worker(
        nursery, issue(ca, tmp_path, "prefill", "127.0.0.1"), role=Role.PREFILL
    )
    decode = await start_worker(nursery, None, role=Role.DECODE)
    frontend = plane(issue(ca, tmp_path, "frontend", "frontend.headwater"))
    to_prefill = await connect_worker(instance_of(prefill), nursery, secret=SECRET, config=frontend)
    to_decode = await connect_worker(
        instance_of(decode), nursery, secret=SECRET, config=plane(None)
    )
    req = request("disagg", max_tokens=5)
    async with to_prefill.stream(req) as chunks:
        (handoff,) = [c async for c in chunks]
    decode_leg = GenerateRequest(
        req.request_id, MODEL, req.token_ids, req.sampling, handoff.kv_handle
    )
    with trio.fail_after(10), pytest.raises(WorkerError) as info:
        await tokens(to_decode, decode_leg)
    assert info.value.code is ErrorCode.KV_TRANSFER_FAILED
    assert "requires TLS" in info.value.message


# ---- configuration -----------------------------------------------------------------------


def test_tls_takes_all_three_files_or_none() -> None:
    assert tls_config(None, None, None) is None
    assert tls_config("c", "k", "ca") == TlsConfig("c", "k", "ca")
    for partial_set in (("c", None, None), ("c", "k", None), (None, None, "ca")):
        with pytest.raises(ValueError, match="all three"):
            tls_config(*partial_set)
    with pytest.raises(ValueError, match="empty"):
        TlsConfig("c", "", "ca")


def test_headwater_worker_refuses_bad_tls_options(
    ca: trustme.CA, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pem = issue(ca, tmp_path, "worker", "gpu-7.internal")
    assert headwater_main(["worker", "--plane-tls-certfile", pem.certfile]) == 2
    assert "all three" in capsys.readouterr().err
    files = [
        "--plane-tls-certfile",
        pem.certfile,
        "--plane-tls-keyfile",
        pem.keyfile,
        "--plane-tls-ca-file",
        pem.ca_file,
    ]
    assert headwater_main(["worker", *files]) == 2  # advertised as 127.0.0.1
    assert "mismatch" in capsys.readouterr().err
    missing = [*files[:-1], str(tmp_path / "missing.pem")]
    assert headwater_main(["worker", *missing]) == 2
    assert "missing.pem" in capsys.readouterr().err


# ---- a whole frontend in front of TLS workers ----------------------------------------------


async def test_a_frontend_serves_through_tls_workers(
    ca: trustme.CA, tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADWATER_PLANE_SECRET", SECRET.decode())
    prefill = await start_worker(
        nursery, issue(ca, tmp_path, "prefill", "127.0.0.1"), role=Role.PREFILL
    )
    decode = await start_worker(
        nursery, issue(ca, tmp_path, "decode", "127.0.0.1"), role=Role.DECODE
    )
    workers = ",".join(f"{w.address}?role={w.role}&id={w.worker_id}" for w in (prefill, decode))
    mine = issue(ca, tmp_path, "frontend", "frontend.headwater")
    settings = {
        "workers": workers,
        "plane_tls_certfile": mine.certfile,
        "plane_tls_keyfile": mine.keyfile,
        "plane_tls_ca_file": mine.ca_file,
    }
    async with serve_frontend(**settings) as (_, url), httpx.AsyncClient(base_url=url) as c:
        with trio.fail_after(10):  # static workers are connected in the background
            while (await c.get("/health")).status_code != 200:
                await trio.sleep(0.02)
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}],
        }
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    stats = prefill.server.statistics()
    assert stats.kv_pulls_served_total == 1
    assert stats.tls_failures_total == 0


def test_the_plane_tls_options_are_documented() -> None:
    for command in ("worker", "serve"):
        text = build_parser(command).format_help()
        for option in ("--plane-tls-certfile", "--plane-tls-keyfile", "--plane-tls-ca-file"):
            assert option in text, (command, option)
            assert env_name(option) in "".join(text.split()), (command, option)
