"""Drive a real ``headwater serve`` at 10x its ``--max-inflight`` and report how it answers.

Starts ``python -m headwater serve`` on a free loopback port (in-process mocker workers at
``--speedup-ratio 1``, so a request lasts about as long as on the GPU Dynamo's timing model
was fitted to; more ``headwater serve`` options after ``--``) and waits until it is
healthy. Then ``--factor`` x ``--max-inflight`` clients send short chat requests back to
back for ``--duration`` seconds, half of them streamed. They ignore ``Retry-After`` unless
``--honour-retry-after``: the harshest client there is. Reports the answers by status (and
transport errors by name), whether every 200 was whole, the server's RSS before the load,
its largest sample during the load, after it, and its own rejection counter. Finally the
server is stopped with SIGTERM (it drains) and its exit status and error log lines are
reported too.

Bounded: loopback only, a fixed duration, a timeout on every request and on the stop.
Linux only (RSS from ``/proc``).

Usage: ``.venv/bin/python -m scripts.overload [--max-inflight 32] [--factor 10]
[--duration 20] [--json] [-- serve args...]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import h11
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from headwater.cluster.recipes import start_frontend, wait_healthy

CHAT = [{"role": "user", "content": "Write a haiku about rivers."}]


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """*field* of ``/proc/<pid>/status`` (VmRSS: now; VmHWM: the peak), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} for pid {pid}")


async def server_metrics(http: httpx.AsyncClient) -> dict[str, Any]:
    """The server's refusals by reason and the worst event-loop delay it saw."""
    samples = [
        s
        for family in text_string_to_metric_families((await http.get("/metrics")).text)
        for s in family.samples
    ]
    return {
        "rejected": {
            s.labels["reason"]: s.value
            for s in samples
            if s.name == "headwater_frontend_rejected_requests_total"
        },
        "loop_max_delay_s": next(
            (
                round(s.value, 3)
                for s in samples
                if s.name == "headwater_frontend_event_loop_max_delay_seconds"
            ),
            None,
        ),
    }


class Connection:
    """One client's keep-alive HTTP/1.1 connection, spoken with h11 over a trio stream.

    Why not httpx: at a few hundred connections its pool costs the client more CPU than
    the server spends refusing, so the load would measure the client. h11 on a plain
    stream costs tens of microseconds a request."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: trio.SocketStream | None = None
        self.h11 = h11.Connection(h11.CLIENT)

    async def post(self, target: str, payload: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        """(status, headers, body) of one POST; reconnects when the last answer said so.
        Raises OSError, trio.BrokenResourceError or h11.ProtocolError."""
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(self.host, self.port)
            self.h11 = h11.Connection(h11.CLIENT)
        h = self.h11
        head = h11.Request(
            method="POST",
            target=target,
            headers=[
                ("Host", self.host),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
            ],
        )
        await self.stream.send_all(
            h.send(head) + h.send(h11.Data(data=payload)) + h.send(h11.EndOfMessage())
        )
        status, headers, body = 0, {}, bytearray()
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await self.stream.receive_some(2**16))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the server closed the connection mid-answer")
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
        else:  # Connection: close
            await self.aclose()
        return status, headers, bytes(body)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None


async def run_overload(
    *,
    max_inflight: int = 32,
    factor: int = 10,
    clients: int | None = None,
    duration: float = 20.0,
    max_tokens: int = 32,
    prompt_words: int = 0,
    honour_retry_after: bool = False,
    serve_args: tuple[str, ...] = (),
    log_dir: Path,
) -> dict[str, Any]:
    """One run; returns the report (see the module docstring). *clients* overrides
    ``factor * max_inflight`` (a run without a limit, to compare)."""
    clients = clients or factor * max_inflight
    messages = [{"role": "user", "content": "river " * prompt_words}] if prompt_words else CHAT
    answers: Counter[str] = Counter()
    whole = broken = 0
    rss_samples: list[float] = []
    # Every client is on loopback: no limit per client address, which would refuse
    # connections beyond 256 before admission control saw them.
    extra = (
        "--max-inflight",
        str(max_inflight),
        "--speedup-ratio",
        "1",
        "--log-level",
        "info",
        "--max-connections-per-client",
        "0",
        *serve_args,
    )
    async with trio.open_nursery() as nursery:
        server = await start_frontend(nursery, log_dir=log_dir, extra_args=extra, ready_within=120)
        await wait_healthy(server.address, within=60, child=server)
        host, port = server.address.removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=server.address, timeout=30) as http:
            warm = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 2}
            assert (await http.post("/v1/chat/completions", json=warm)).status_code == 200
            rss_start = rss_mb(server.pid)
            deadline = trio.current_time() + duration

            async def client(i: int) -> None:
                nonlocal whole, broken
                stream = i % 2 == 0
                payload = json.dumps(
                    {
                        "model": "deepseek-v4",
                        "messages": messages,
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "stream": stream,
                    }
                ).encode()
                conn = Connection(host, int(port))
                while trio.current_time() < deadline:
                    try:
                        with trio.fail_after(30):
                            status, headers, body = await conn.post("/v1/chat/completions", payload)
                    except (
                        OSError,
                        trio.BrokenResourceError,
                        trio.TooSlowError,
                        h11.ProtocolError,
                    ) as exc:
                        answers[type(exc).__name__] += 1
                        await conn.aclose()
                        continue
                    answers[str(status)] += 1
                    if status == 200:
                        ok = body.endswith(b"data: [DONE]\n\n") if stream else b'"usage"' in body
                        whole, broken = whole + ok, broken + (not ok)
                    elif status == 429 and honour_retry_after:
                        await trio.sleep(float(headers[b"retry-after"]))
                await conn.aclose()

            async def sample_rss() -> None:
                while trio.current_time() < deadline:
                    rss_samples.append(rss_mb(server.pid))
                    await trio.sleep(0.5)

            start = trio.current_time()
            async with trio.open_nursery() as load:
                load.start_soon(sample_rss)
                for i in range(clients):
                    load.start_soon(client, i)
            elapsed = trio.current_time() - start
            rss_end = rss_mb(server.pid)
            rss_peak = rss_mb(server.pid, "VmHWM")
            seen = await server_metrics(http)
            health = (await http.get("/health")).status_code
        with trio.fail_after(90):
            exit_status = await server.stop(grace=60)
        nursery.cancel_scope.cancel()
    log_text = (log_dir / "frontend.log").read_text(errors="replace")
    error_lines = [
        line for line in log_text.splitlines() if " ERROR " in line or line.startswith("Traceback")
    ]
    total = sum(answers.values())
    return {
        "max_inflight": max_inflight,
        "clients": clients,
        "prompt_words": prompt_words,
        "honour_retry_after": honour_retry_after,
        "duration_s": round(elapsed, 1),
        "answers": dict(sorted(answers.items())),
        "answers_per_s": round(total / elapsed, 1),
        "ok_per_s": round(answers["200"] / elapsed, 1),
        "ok_whole": whole,
        "ok_broken": broken,
        "server_rejected": seen["rejected"],
        "server_loop_max_delay_s": seen["loop_max_delay_s"],
        "health_after_load": health,
        "rss_mb": {
            "start": round(rss_start, 1),
            "max_during_load": round(max(rss_samples), 1),
            "end": round(rss_end, 1),
            "process_peak_VmHWM": round(rss_peak, 1),
            "every_5_s": [round(v) for v in rss_samples[::10]],
        },
        "server_exit_status": exit_status,
        "server_error_lines": error_lines[:20],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-inflight", type=int, default=32, help="the server's limit (default 32)")
    p.add_argument(
        "--factor", type=int, default=10, help="clients per slot: the overload (default 10)"
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="clients, instead of factor x max-inflight (to compare a run with --max-inflight 0)",
    )
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    p.add_argument("--max-tokens", type=int, default=32, help="per request (default 32)")
    p.add_argument(
        "--prompt-words",
        type=int,
        default=0,
        help="a prompt of this many words (~1 token each) instead of a short one",
    )
    p.add_argument(
        "--honour-retry-after",
        action="store_true",
        help="clients wait Retry-After after a 429 (default: retry at once)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: headwater serve args")
    args = p.parse_args()
    serve_args = tuple(a for a in args.serve_args if a != "--")
    with tempfile.TemporaryDirectory(prefix="headwater-overload-") as tmp:
        report = trio.run(
            lambda: run_overload(
                max_inflight=args.max_inflight,
                factor=args.factor,
                clients=args.clients,
                duration=args.duration,
                max_tokens=args.max_tokens,
                prompt_words=args.prompt_words,
                honour_retry_after=args.honour_retry_after,
                serve_args=serve_args,
                log_dir=Path(tmp),
            )
        )
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>20}: {value}")
    clean = set(report["answers"]) <= {"200", "429", "503"} and not report["ok_broken"]
    sys.exit(0 if clean and report["server_exit_status"] == 0 else 1)


if __name__ == "__main__":
    main()
