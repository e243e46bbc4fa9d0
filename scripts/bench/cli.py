"""One benchmark run from the command line: synthesise, load, summarise, print.

    python -m scripts.bench.loadgen --url http://127.0.0.1:8000 --scenario short \\
        --concurrency 16 --requests 200 --stream [--pid PID] [--metrics-url URL]

With ``headwater serve --processes N`` give every process's own ``/metrics`` (its
private URL, printed at start-up): ``--metrics-url`` repeated; the loop figures are then
of all of them together (histograms summed, the worst max-delay gauge).

Prints one JSON line (the :class:`~scripts.bench.stats.Summary` plus scenario, client
usage, event-loop and per-process figures) and one markdown table row (``--header``
adds the header). Exit status 0 even if requests failed: the record says how many.

Follows the ``headwater`` subcommand convention (``add_arguments(parser)`` and
``main(args) -> int``), like the suite's :mod:`scripts.bench.run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import orjson

from scripts.bench import prompts, scrape, timeline
from scripts.bench.loadgen import (
    DEFAULT_REQUEST_TIMEOUT,
    LoadGenError,
    check_loopback,
    run_load,
)
from scripts.bench.stats import markdown_header, markdown_row, summarise


def resolve_url(url: str, endpoint: str) -> str:
    """*url* itself if it has a path, else *url* + the endpoint's path."""
    if urlsplit(url).path not in ("", "/"):
        return url
    return url.rstrip("/") + prompts.ENDPOINT_PATHS[endpoint]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (endpoint path appended) or a full endpoint URL; loopback only",
    )
    a("--endpoint", choices=sorted(prompts.ENDPOINT_PATHS), default="chat")
    a("--scenario", choices=[s.value for s in prompts.Scenario], default="short")
    a(
        "--prompt-tokens",
        type=int,
        default=None,
        help="content tokens per prompt (system prompt for shared-prefix); default per scenario",
    )
    a(
        "--user-tokens",
        type=int,
        default=prompts.DEFAULT_USER_TOKENS,
        help="user-turn tokens for shared-prefix",
    )
    a("--concurrency", type=int, default=16)
    a("--requests", type=int, default=200, help="requests to send (one distinct prompt each)")
    a("--time-limit", type=float, default=300.0, help="seconds; later requests are not sent")
    a("--stream", action="store_true", help="SSE streaming instead of unary")
    a("--max-tokens", type=int, default=8)
    a(
        "--agentic",
        action="store_true",
        help="tools in every request and thinking mode on (the parse stage's load)",
    )
    a("--model", default=prompts.DEFAULT_MODEL)
    a("--seed", type=int, default=None, help="reproducible prompts (default: fresh each run)")
    a("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT)
    a(
        "--metrics-url",
        action="append",
        default=[],
        help="scrape this /metrics before and after the run (repeatable: one per frontend "
        "process, merged)",
    )
    a("--metrics-prefix", default=scrape.HEADWATER_PREFIX)
    a(
        "--pid",
        type=int,
        action="append",
        default=[],
        help="report CPU and peak RSS of this server process (repeatable)",
    )
    a("--label", default="")
    a("--header", action="store_true", help="print the markdown table header first")
    a("--records", action="store_true", help="include per-request records in the JSON")
    a("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    url = resolve_url(args.url, args.endpoint)
    check_loopback(url)
    for metrics_url in args.metrics_url:
        check_loopback(metrics_url)
    prompt_set = prompts.make_prompts(
        args.scenario,
        args.requests,
        tokens=args.prompt_tokens,
        user_tokens=args.user_tokens,
        seed=args.seed,
    )
    bodies = prompts.build_bodies(
        prompt_set,
        endpoint=args.endpoint,
        stream=args.stream,
        max_tokens=args.max_tokens,
        model=args.model,
        extra=prompts.AGENTIC_EXTRA if args.agentic else None,
    )
    loop_before = _scrape_all(args.metrics_url, args.metrics_prefix)
    procs_before = [scrape.read_proc(pid) for pid in args.pid]
    result = run_load(
        url,
        bodies,
        args.concurrency,
        args.requests,
        args.time_limit,
        args.stream,
        request_timeout=args.request_timeout,
        progress=not args.no_progress,
        description=args.label or args.scenario,
    )
    procs = [scrape.proc_report(b, scrape.read_proc(b.pid)) for b in procs_before]
    loop = None
    if loop_before is not None:
        loop_after = _scrape_all(args.metrics_url, args.metrics_prefix)
        assert loop_after is not None  # the same URLs
        loop = scrape.loop_report(loop_before, loop_after)
    summary = summarise(result, args.label)
    record: dict[str, Any] = {
        **summary.to_json(),
        "scenario": prompt_set.scenario.value,
        "endpoint": args.endpoint,
        "url": url,
        "max_tokens": args.max_tokens,
        "content_tokens_mean": sum(p.tokens for p in prompt_set.prompts) / len(prompt_set),
        "hit_time_limit": result.hit_time_limit,
        "client_max_rss_kb": result.client.max_rss_kb,
        "loop": None if loop is None else asdict(loop),
        "procs": [asdict(p) for p in procs],
    }
    if args.records:
        record["records"] = result.to_json()["records"]
    sys.stdout.write(orjson.dumps(record).decode() + "\n")
    if args.header:
        print(markdown_header())
    print(markdown_row(summary))
    return 0


def _scrape_all(urls: Sequence[str], prefix: str) -> scrape.LoopSnapshot | None:
    """Every URL's loop metrics merged; ``None`` for no URLs. Raises OSError, ValueError."""
    if not urls:
        return None
    return timeline.merge_snapshots([scrape.scrape_loop(url, prefix) for url in urls])


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m scripts.bench`` and ``python -m scripts.bench.loadgen``."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench.loadgen",
        description=(__doc__ or "").strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except (ValueError, OSError, LoadGenError) as exc:
        parser.exit(1, f"error: {exc}\n")
