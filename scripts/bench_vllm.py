"""headwater in front of a real engine: vLLM's CPU build on the tiny model (docs/engines.md).

The figures and the commands that made them: docs/performance-vllm.md.

    python scripts/bench_vllm.py [--model artifacts/tiny-llama] [--out bench-results/vllm]
        [--only load,probe,disagg] [--rounds 1] [--compiled]
    python scripts/bench_vllm.py --render A/results.json B/results.json  # tables of both

Three measurements, each server started alone on loopback and stopped before the next
(a vLLM CPU instance is ~3.5 GB and busy cores would measure each other):

* ``load`` — the frontend's cost in front of vLLM: ``headwater serve --engine vllm
  --mode agg`` (headwater's frontend, a worker in-process, its vLLM child) against
  vLLM's own OpenAI API server on the same model, tokenizing the same text itself.
  Streaming ``/v1/completions``, ~2k and ~7k-token distinct prompts, at c4 and c16:
  req/s, TTFT p50/p99 and CPU per request of each kind of process. Both generate
  ``--max-tokens`` tokens per request. ``--peers`` chooses the servers (PEERS: vLLM's,
  headwater through vLLM's API server, headwater with vLLM in-process, aggregated or
  disaggregated).
* ``probe`` — responsiveness under long prompts: 16 distinct ~40k-token prompts at
  once (``--max-model-len 50000``), while another process GETs ``/v1/models`` every
  20 ms; the probe's p50/p99/max latency, per server. Every body is built before
  the clock starts, and the probe is a process of its own, so neither measures the
  client's own stalls. vLLM's CPU engine needs ~10 s per such prompt: the long
  requests' TTFT measures its queue, the probe the frontend's loop.
* ``disagg`` — ``headwater serve --engine vllm --mode disagg`` (prefill and decode
  vLLMs, KV over NIXL) against ``--mode agg``: per-request KV transfer time (the
  decode vLLM's ``vllm:nixl_xfer_time_seconds``), TTFT, and decode tokens/s.

Each measurement runs ``--rounds`` times, the peers taking turns going first.
Writes every round to ``<out>/results.json`` and prints markdown tables of the
medians. Needs ``make vllm`` and the tiny model (``python scripts/build_tiny_model.py``).
One round of all three takes ~15-25 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from headwater.ports import free_port  # noqa: E402
from scripts.bench import prompts as bench_prompts  # noqa: E402
from scripts.bench.loadgen import run_load  # noqa: E402
from scripts.bench.stats import summarise  # noqa: E402

MODEL_NAME = "tiny"  # the name both servers serve the model under
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
}


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def server(name: str, argv: Sequence[str], port: int, log: Path, ready: str) -> Iterator[Server]:
    """Start *argv* in its own process group; wait for GET *ready* to answer 200."""
    env = {**os.environ, **VLLM_ENV}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    srv = Server(name, url, process, log)
    try:
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {srv.text()[-3000:]}")
            try:
                if httpx.get(url + ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > 600:
                raise RuntimeError(f"{name} not ready in 600 s")
            time.sleep(0.5)
        print(f"# {name} ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
        yield srv
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    for signum, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            # The vLLM a headwater worker started has a process group of its own.
        except subprocess.TimeoutExpired:
            continue
    time.sleep(3)


#: How vLLM's CLI is run (``--vllm-command``): this Python with headwater's launcher.
VLLM_COMMAND = [sys.executable, "-m", "workers.engines.vllm.launcher"]
#: Extra options of headwater's vLLM workers (``--kv-buffer-device`` on GPUs).
WORKER_EXTRA: list[str] = []


def vllm_server(model: Path, port: int, log: Path, eager: bool, max_len: int) -> Any:
    argv = [
        *VLLM_COMMAND,
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(max_len),
    ]
    if eager:
        argv.append("--enforce-eager")
    return server("vllm", argv, port, log, "/health")


#: The peers of the load and probe measurements: vLLM's own server, and headwater
#: (``--mode``, ``--vllm-client``) with its worker reaching vLLM each way, aggregated,
#: and disaggregated (a prefill and a decode vLLM, NIXL between them).
PEERS = {
    "vllm": ("", ""),
    "headwater": ("agg", "api-server"),
    "headwater-inproc": ("agg", "in-process"),
    # `headwater launch`: the frontend alone in its process, worker processes each with
    # vLLM in-process (the layout `auto` chooses in-process for): one aggregated, or a
    # prefill and a decode worker (NIXL between their engines).
    "headwater-launch": ("launch", "in-process"),
    "headwater-launch-disagg": ("launch-disagg", "in-process"),
}


def peer_server(kind: str, model: Path, port: int, log: Path, eager: bool, max_len: int) -> Any:
    if kind == "vllm":
        return vllm_server(model, port, log, eager, max_len)
    mode, client = PEERS[kind]
    if mode.startswith("launch"):
        return headwater_cluster(model, port, log, eager, max_len, disagg=mode.endswith("disagg"))
    return headwater_server(model, port, log, eager, max_len, mode, client=client)


def engine_options(eager: bool, max_len: int) -> list[str]:
    """The vLLM engine options of a headwater worker, in either layout."""
    options = [
        "--max-model-len",
        str(max_len),
        "--cpu-kv-cache-gib",
        VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"],
        "--cpu-bind",
        "role",
        *WORKER_EXTRA,
    ]
    return [*options, "--enforce-eager"] if eager else options


def headwater_server(
    model: Path,
    port: int,
    log: Path,
    eager: bool,
    max_len: int,
    mode: str = "agg",
    client: str = "api-server",
) -> Any:
    """``headwater serve --engine vllm``: the frontend and its in-process worker, which
    reaches its vLLM child through vLLM's API server (``api-server``) or runs vLLM's
    engine client itself (``in-process``: no API server)."""
    argv = [
        sys.executable,
        "-m",
        "headwater",
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--mode",
        mode,
        "--port",
        str(port),
        "--model-name",
        MODEL_NAME,
        "--vllm-client",
        client,
        *engine_options(eager, max_len),
    ]
    name = f"headwater-{mode}" + ("-in-process" if client == "in-process" else "")
    return server(name, argv, port, log, "/health")


def headwater_cluster(
    model: Path, port: int, log: Path, eager: bool, max_len: int, disagg: bool = False
) -> Any:
    """``headwater launch``: the frontend in a process of its own, worker processes each
    running vLLM's engine client itself (its engine core a child of it): one aggregated
    (``--agg 1``), or a prefill and a decode (``--prefill 1 --decode 1``, each engine on
    a core of its own as ``--cpu-bind role`` places them)."""
    worker = engine_options(eager, max_len)
    argv = [
        sys.executable,
        "-m",
        "headwater",
        "launch",
        "--engine",
        "vllm",
        "--model",
        str(model),
        *(("--prefill", "1", "--decode", "1") if disagg else ("--agg", "1")),
        "--discovery",
        "static",
        "--port",
        str(port),
        "--model-name",
        MODEL_NAME,
        "--vllm-client",
        "in-process",
        "--worker-args",
        " ".join(worker),
        "--",  # the frontend's own bound on a prompt
        "--context-length",
        str(max_len),
    ]
    name = "headwater-launch-disagg" if disagg else "headwater-launch"
    return server(name + "-in-process", argv, port, log, "/health")


# ---- load ------------------------------------------------------------------------------


def cpu_by_process(srv: Server) -> dict[str, float]:
    """CPU seconds so far of the server's processes, by kind: headwater (frontend and
    in-process worker), vLLM's API server, its engine core (with its worker). A process
    that exits between two readings takes its CPU time with it (none does mid-run).
    psutil is one of vLLM's own dependencies, so it is there whenever this script runs."""
    import psutil

    totals: dict[str, float] = {}
    try:
        root = psutil.Process(srv.process.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return totals
    for proc in procs:
        try:
            name = proc.name()
            cmd = " ".join(proc.cmdline())
            t = proc.cpu_times()
        except psutil.Error:
            continue
        if "EngineCore" in name or "VLLM::" in name:
            kind = "vllm_engine"
        elif "headwater" in cmd:
            kind = "headwater"
        elif "launcher serve" in cmd or "vllm" in cmd:
            kind = "vllm_api_server"
        else:
            kind = "other"
        totals[kind] = totals.get(kind, 0.0) + t.user + t.system
    return totals


def greedy_bodies(ps: Any, max_tokens: int) -> list[bytes]:
    """Streaming completions of *ps*, greedy, each generating *max_tokens* tokens."""
    return bench_prompts.build_bodies(
        ps,
        endpoint="completions",
        stream=True,
        max_tokens=max_tokens,
        model=MODEL_NAME,
        extra={"ignore_eos": True, "temperature": 0},
    )


def run_load_matrix(
    srv: Server, prompt_sets: dict[int, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    url = srv.url + "/v1/completions"
    for size, ps in prompt_sets.items():
        bodies = greedy_bodies(ps, args.max_tokens)
        # One warm-up request, not counted.
        run_load(url, bodies[-1:], 1, 1, 120, True, progress=False)
        offset = 0
        for concurrency in (4, 16):
            n = max(2 * concurrency, args.requests)
            chunk = bodies[offset : offset + n]
            offset += n
            before = cpu_by_process(srv)
            result = run_load(url, chunk, concurrency, n, 900, True, progress=False)
            after = cpu_by_process(srv)
            s = summarise(result, f"{srv.name} {size} c{concurrency}")
            cpu_ms = {k: round(1000 * (after[k] - before.get(k, 0.0)) / n, 1) for k in after}
            rows.append(
                {
                    "server": srv.name,
                    "prompt_tokens": size,
                    "concurrency": concurrency,
                    "requests": s.requests,
                    "ok": s.ok,
                    "req_per_s": s.req_per_s,
                    "ttft_p50_ms": s.ttft_p50_ms,
                    "ttft_p99_ms": s.ttft_p99_ms,
                    "prompt_tokens_mean": s.prompt_tokens_mean,
                    "cpu_ms_per_request": cpu_ms,
                    "first_error": s.first_error,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


# ---- probe -----------------------------------------------------------------------------

PROBE_CODE = r"""
import json, sys, time, httpx
url, out, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
lat = []
stop = out + ".stop"
import os
with httpx.Client(timeout=30) as c:
    next_at = time.perf_counter()
    while not os.path.exists(stop):
        t0 = time.perf_counter()
        r = c.get(url)
        lat.append(time.perf_counter() - t0)
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
json.dump(lat, open(out, "w"))
"""


def run_probe(srv: Server, bodies: list[bytes], workdir: Path) -> dict[str, Any]:
    out = workdir / f"probe-{srv.name}.json"
    stop = Path(str(out) + ".stop")
    stop.unlink(missing_ok=True)
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE_CODE, srv.url + "/v1/models", str(out), "0.02"]
    )
    time.sleep(1.0)  # the probe's own warm-up, outside the window
    result = run_load(
        srv.url + "/v1/completions",
        bodies,
        len(bodies),
        len(bodies),
        1800,
        True,
        progress=False,
        request_timeout=1800,
    )
    stop.touch()
    probe.wait(timeout=60)
    lat = json.loads(out.read_text())
    s = summarise(result, srv.name)
    ms = sorted(x * 1000 for x in lat)
    row = {
        "server": srv.name,
        "long_requests": len(bodies),
        "ok": s.ok,
        "probe_samples": len(ms),
        "probe_p50_ms": ms[len(ms) // 2],
        "probe_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "probe_max_ms": ms[-1],
        "long_ttft_p50_ms": s.ttft_p50_ms,
        "long_ttft_p99_ms": s.ttft_p99_ms,
        "long_e2e_p50_ms": s.e2e_p50_ms,
        "long_e2e_p99_ms": s.e2e_p99_ms,
        "wall_s": s.wall_s,
        "prompt_tokens_mean": s.prompt_tokens_mean,
        "first_error": s.first_error,
    }
    print(json.dumps(row), file=sys.stderr)
    return row


# ---- disagg ----------------------------------------------------------------------------


def vllm_children(srv: Server) -> dict[str, str]:
    """The URLs of the vLLM servers a headwater serve started, by worker id."""
    found = re.findall(r"(local-\w+-\d+): starting vLLM on (http://\S+):", srv.text())
    return dict(found)


def nixl(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:nixl_xfer_time_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:nixl_xfer_time_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def run_disagg(srv: Server, ps: Any, args: argparse.Namespace) -> dict[str, Any]:
    bodies = greedy_bodies(ps, args.decode_tokens)
    run_load(srv.url + "/v1/completions", bodies[-1:], 1, 1, 300, True, progress=False)
    children = vllm_children(srv)
    decode_url = next((u for w, u in children.items() if "decode" in w), None)
    before = nixl(decode_url) if decode_url else (0.0, 0.0)
    row: dict[str, Any] = {"server": srv.name}
    for concurrency in (1, 4):
        n = 4 * concurrency
        chunk = bodies[:n] if concurrency == 1 else bodies[4 : 4 + n]
        result = run_load(
            srv.url + "/v1/completions", chunk, concurrency, n, 900, True, progress=False
        )
        s = summarise(result, srv.name)
        # Tokens after the first over the time after it (a chunk may carry several).
        rates = [
            (r.completion_tokens - 1) / (r.e2e_s - r.ttft_s)
            for r in result.ok
            if r.completion_tokens and r.ttft_s is not None and r.e2e_s > r.ttft_s
        ]
        row[f"c{concurrency}"] = {
            "ttft_p50_ms": s.ttft_p50_ms,
            "itl_p50_ms": s.itl_p50_ms,
            "decode_tok_per_s_per_request": statistics.median(rates) if rates else None,
            "output_tok_per_s": s.output_tokens_per_s,
            "ok": s.ok,
        }
    if decode_url:
        after = nixl(decode_url)
        transfers = after[1] - before[1]
        row["nixl_transfers"] = transfers
        row["nixl_xfer_ms_mean"] = 1000 * (after[0] - before[0]) / transfers if transfers else None
    print(json.dumps(row), file=sys.stderr)
    return row


# ---- summary ---------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if isinstance(row.get(key), int | float)]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _span(rows: list[dict[str, Any]], key: str, digits: int = 1) -> str:
    """The median over the rounds, and their range when there are several."""
    values = [row[key] for row in rows if isinstance(row.get(key), int | float)]
    if len(values) < 2:
        return _fmt(_median(rows, key), digits)
    return (
        f"{_fmt(statistics.median(values), digits)} "
        f"({_fmt(min(values), digits)}–{_fmt(max(values), digits)})"
    )


def _grouped(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[Any]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return groups


def _row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(results: dict[str, Any]) -> str:
    """The summary tables (medians over the rounds) for docs/performance-vllm.md."""
    out: list[str] = []
    if rows := results.get("load"):
        out += [
            _row(
                "server",
                "prompt tokens",
                "c",
                "rounds",
                "req/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "CPU ms/req: headwater",
                "vLLM API server",
                "vLLM engine",
            ),
            _row(*["---"] * 10),
        ]
        groups = _grouped(rows, "server", "prompt_tokens", "concurrency")
        for (server, size, c), group in sorted(groups.items()):
            cpu = [
                f"{statistics.median(g['cpu_ms_per_request'].get(k, 0.0) for g in group):.1f}"
                if any(k in g["cpu_ms_per_request"] for g in group)
                else "-"
                for k in ("headwater", "vllm_api_server", "vllm_engine")
            ]
            out.append(
                _row(
                    server,
                    size,
                    c,
                    len(group),
                    _span(group, "req_per_s", 2),
                    _span(group, "ttft_p50_ms", 0),
                    _span(group, "ttft_p99_ms", 0),
                    *cpu,
                )
            )
        out.append("")
    if rows := results.get("probe"):
        out += [
            _row(
                "server",
                "rounds",
                "probes",
                "probe p50 ms",
                "probe p99 ms",
                "probe max ms",
                "long e2e p50 s",
                "wall s",
            ),
            _row(*["---"] * 8),
        ]
        for (server,), group in sorted(_grouped(rows, "server").items()):
            e2e = _median(group, "long_e2e_p50_ms")
            out.append(
                _row(
                    server,
                    len(group),
                    _fmt(_median(group, "probe_samples"), 0),
                    _span(group, "probe_p50_ms"),
                    _span(group, "probe_p99_ms"),
                    _span(group, "probe_max_ms", 0),
                    _fmt(None if e2e is None else e2e / 1000),
                    _span(group, "wall_s", 0),
                )
            )
        out.append("")
    if rows := results.get("disagg"):
        out += [
            _row(
                "mode",
                "rounds",
                "c",
                "TTFT p50 ms",
                "ITL p50 ms",
                "decode tok/s per request",
                "output tok/s",
                "NIXL transfers",
                "KV transfer ms (mean)",
            ),
            _row(*["---"] * 9),
        ]
        for (server,), group in sorted(_grouped(rows, "server").items()):
            for c in ("c1", "c4"):
                cells = [g[c] for g in group if c in g]
                out.append(
                    _row(
                        server,
                        len(group),
                        c[1:],
                        _span(cells, "ttft_p50_ms", 0),
                        _span(cells, "itl_p50_ms"),
                        _span(cells, "decode_tok_per_s_per_request"),
                        _span(cells, "output_tok_per_s"),
                        _fmt(_median(group, "nixl_transfers"), 0),
                        _span(group, "nixl_xfer_ms_mean", 2),
                    )
                )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "artifacts" / "tiny-llama")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "vllm")
    parser.add_argument("--only", default="load,probe,disagg")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="let vLLM compile its graphs (slower start, ~30%% faster decode)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per measurement, the peers alternating which goes first; "
        "the summary gives medians over them",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="per load request")
    parser.add_argument("--requests", type=int, default=32, help="per load cell (at least 2c)")
    parser.add_argument("--long-requests", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--probe-tokens", type=int, default=40000, help="size of each long prompt of the probe run"
    )
    parser.add_argument(
        "--vllm-command",
        default="",
        help="vLLM's CLI (default: this Python with headwater's launcher; `vllm` for upstream)",
    )
    parser.add_argument("--kv-buffer-device", default="cpu", help="NIXL's (cuda on GPUs)")
    parser.add_argument(
        "--peers",
        default="vllm,headwater,headwater-inproc",
        help="servers of the load and probe measurements, from " + ", ".join(PEERS),
    )
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="measure nothing: print the tables of these results.json files, their rounds pooled",
    )
    args = parser.parse_args()
    if args.render:
        pooled: dict[str, Any] = {}
        for path in args.render:
            for key, rows in json.loads(path.read_text()).items():
                if isinstance(rows, list):
                    pooled.setdefault(key, []).extend(rows)
        print(markdown(pooled))
        return 0
    if args.vllm_command:
        VLLM_COMMAND[:] = args.vllm_command.split()
        WORKER_EXTRA.extend(["--vllm-command", args.vllm_command])
    WORKER_EXTRA.extend(["--kv-buffer-device", args.kv_buffer_device])
    eager = not args.compiled
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict[str, Any] = {"eager": eager, "model": str(args.model)}

    print("# building prompts", file=sys.stderr)
    sets = (
        {
            size: bench_prompts.make_prompts("long", 2 * args.requests + 32 + 2, tokens=size)
            for size in (2000, 7000)
        }
        if "load" in only
        else {}
    )

    def order(kinds: Sequence[str], r: int) -> tuple[str, ...]:
        """The peers take turns going first, round by round."""
        k = r % len(kinds)
        return (*kinds[k:], *kinds[:k])

    peers = [p for p in args.peers.split(",") if p]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}: choose from {', '.join(PEERS)}")

    if "load" in only:
        rows = []
        for r in range(args.rounds):
            for kind in order(peers, r):
                port = free_port()
                log = workdir / f"load-{kind}-{r}.log"
                with peer_server(kind, args.model, port, log, eager, 8192) as srv:
                    rows += [{**row, "round": r} for row in run_load_matrix(srv, sets, args)]
        results["load"] = rows

    if "probe" in only:
        max_len = args.probe_tokens + 10000
        rows = []
        for r in range(args.rounds):
            for kind in order(peers, r):
                # A fresh nonce per run (a fresh server too): no prefix-cache hit.
                long_set = bench_prompts.make_prompts(
                    "long", args.long_requests, tokens=args.probe_tokens
                )
                bodies = bench_prompts.build_bodies(
                    # 4 tokens: the first one's text may be a partial character (no TTFT).
                    long_set,
                    endpoint="completions",
                    stream=True,
                    max_tokens=4,
                    model=MODEL_NAME,
                    extra={"ignore_eos": True},
                )
                port = free_port()
                log = workdir / f"probe-{kind}-{r}.log"
                with peer_server(kind, args.model, port, log, eager, max_len) as srv:
                    rows.append({**run_probe(srv, bodies, workdir), "round": r})
        results["probe"] = rows

    if "disagg" in only:
        ps = bench_prompts.make_prompts("long", 24, tokens=2000)
        rows = []
        for r in range(args.rounds):
            for mode in order(("agg", "disagg"), r):
                port = free_port()
                log = workdir / f"{mode}-{r}.log"
                with headwater_server(args.model, port, log, eager, 8192, mode) as srv:
                    rows.append({**run_disagg(srv, ps, args), "round": r})
        results["disagg"] = rows

    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"# logs in {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
