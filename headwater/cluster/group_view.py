"""The group's view: what the shared port's ``/metrics`` and ``/dashboard/data`` answer.

``headwater serve --processes N``: a frontend process that takes ``GET /metrics`` or
``GET /dashboard/data`` on the shared port relays it to the supervisor (its
``group_url``), and the supervisor answers here, on a loopback port of its own, for the
whole group: it asks every process on its private port (concurrently, 2 s at most
each), merges the answers and adds what only it knows (restarts, every process's
memory, the zygote's and its own). The parsing and merging run on the supervisor's
loop, which serves no traffic; a serving loop only relays the bytes. Each process's
private port keeps answering for that process alone. Why this and not
prometheus-client's multiprocess mode: :mod:`headwater.cluster.group_metrics`.

The responder is a small HTTP/1.1 one (one request per connection, as a worker's
metrics endpoint): its only clients are the group's own processes. With API keys it
wants the same ``Authorization`` the process checked (``/metrics`` stays open unless
``--metrics-auth``), and it sends the group's first key when it asks a process. With
``--ssl-certfile`` the processes' private ports serve HTTPS, and it asks them over TLS,
trusting exactly the served certificate (:func:`private_port_tls`).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qs, urlencode, urlsplit

import orjson
import trio

from frontend.http.auth import ApiKeys, watch_keys_file
from frontend.http.dashboard import HISTORY_FIELDS, MAX_STALLS, LoadHistory
from frontend.http.group import GroupViewUnavailable, Relayed, http_get
from frontend.http.recent_errors import CAPACITY as RECENT_ERRORS
from headwater.cluster.group_metrics import Family, GroupMetrics
from headwater.instrumentation.plain_http import answer_one
from headwater.procmem import read_memory

log = logging.getLogger(__name__)

PROMETHEUS_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
PREFIX: Final = "headwater_frontend_"
ASK_TIMEOUT_S: Final = 2.0  # for one process to answer the supervisor


@dataclass(frozen=True, slots=True)
class Member:
    """One process of the group as the supervisor knows it now."""

    slot: int
    pid: int
    url: str  # its private URL
    running: bool
    restarts: int


def private_port_tls(certfile: str) -> ssl.SSLContext:
    """The client context with which the supervisor asks its own processes over TLS:
    it trusts the certificate they serve (*certfile*, the group's ``--ssl-certfile``;
    the leaf itself is enough, as a partial chain) and not the host name, which names
    the public address, not the loopback one asked."""
    context = ssl.create_default_context(cafile=certfile)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.check_hostname = False
    return context


class GroupView:
    """Answers for the group; see the module docstring.

    *members* returns the processes now (the latest incarnation of each slot);
    *others* the group's other processes by role (``{"supervisor": pid, "zygote":
    pid}``) for the memory table.
    """

    def __init__(
        self,
        members: Callable[[], Sequence[Member]],
        *,
        others: Callable[[], dict[str, int]],
        api_keys: Sequence[str] = (),
        api_keys_file: str | None = None,
        metrics_auth: bool = False,
        started_at: float | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._members = members
        self._tls = tls
        self._others = others
        # The same keys as the processes', the file followed as they follow it.
        self._fixed_keys = tuple(api_keys)
        self._keys_file = api_keys_file
        self._keys = ApiKeys(api_keys)
        self._metrics_open = not metrics_auth
        self.metrics = GroupMetrics(started_at=time.time() if started_at is None else started_at)
        self._history = LoadHistory()

    # -- the two answers -------------------------------------------------------------------

    async def render_metrics(
        self, names: Sequence[str] | None = None, authorization: str | None = None
    ) -> bytes:
        """The group's ``/metrics`` page (*names*: those samples only). *authorization*
        is the client's header, passed on to the processes, which check it too."""
        members = list(self._members())
        query = ("?" + urlencode([("name[]", n) for n in names])) if names else ""
        pages = await self._ask(
            members, "/metrics" + query, lambda r: r.body.decode(), authorization
        )
        for member, page in zip(members, pages, strict=True):
            try:
                self.metrics.observe(member.slot, member.pid, page)
            except ValueError as exc:
                log.warning("process %d's metrics do not parse: %s", member.slot, exc)
                self.metrics.observe(member.slot, member.pid, None)
        return self.metrics.render(self._group_families(members), names)

    async def dashboard(
        self, stalls_after: float | None = None, authorization: str | None = None
    ) -> dict[str, Any]:
        """The group's ``/dashboard/data``: :func:`merge_dashboards` of every process's."""
        members = list(self._members())
        path = "/dashboard/data"
        if stalls_after is not None:
            path += f"?stalls_after={stalls_after!r}"
        parts = await self._ask(members, path, lambda r: orjson.loads(r.body), authorization)
        pids = {**self._others(), **{f"process {m.slot}": m.pid for m in members if m.running}}
        memory = await trio.to_thread.run_sync(_memory, pids)
        return merge_dashboards(members, parts, self._history, time.time(), memory)

    def _group_families(self, members: Sequence[Member]) -> list[Family]:
        restarts = sum(m.restarts for m in members)
        return [
            Family(
                f"{PREFIX}group_processes",
                "gauge",
                "Frontend processes of this group (headwater serve --processes)",
                ((f"{PREFIX}group_processes", (), float(len(members))),),
            ),
            Family(
                f"{PREFIX}group_processes_up",
                "gauge",
                "Frontend processes that answered this scrape",
                ((f"{PREFIX}group_processes_up", (), float(self.metrics.answered())),),
            ),
            Family(
                f"{PREFIX}group_restarts",
                "counter",
                "Frontend processes restarted after they exited on their own",
                (
                    (f"{PREFIX}group_restarts_total", (), float(restarts)),
                    (f"{PREFIX}group_restarts_created", (), self.metrics.started_at),
                ),
            ),
        ]

    async def _ask(
        self,
        members: Sequence[Member],
        path: str,
        decode: Callable[[Relayed], Any],
        authorization: str | None,
    ) -> list[Any]:
        """Every running member's answer to GET *path* (``None`` where there was none),
        asked with the client's *authorization*."""
        out: list[Any] = [None] * len(members)
        headers = {"Authorization": authorization} if authorization else {}

        async def one(i: int, member: Member) -> None:
            url = urlsplit(member.url)
            try:
                with trio.fail_after(ASK_TIMEOUT_S):
                    r = await http_get(
                        url.hostname or "127.0.0.1", url.port or 80, path, headers, self._tls
                    )
                if r.status == 200:
                    out[i] = decode(r)
            except (GroupViewUnavailable, ValueError, trio.TooSlowError) as exc:
                log.debug("process %d did not answer %s: %r", member.slot, path, exc)

        async with trio.open_nursery() as nursery:
            for i, member in enumerate(members):
                if member.running:
                    nursery.start_soon(one, i, member)
        return out

    # -- the responder ---------------------------------------------------------------------

    async def serve(self, listener: trio.SocketListener) -> None:
        """Answer the group's processes on *listener* until cancelled."""
        async with trio.open_nursery() as nursery:
            if self._keys_file is not None:
                await nursery.start(
                    partial(watch_keys_file, self._keys, self._fixed_keys, self._keys_file)
                )
            handler = partial(answer_one, respond=self._respond, name="group view")
            await trio.serve_listeners(handler, [listener])

    async def _respond(self, head: bytes) -> tuple[str, str, bytes]:
        request_line, *header_lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        parts = request_line.decode("latin-1").split(" ")
        if len(parts) != 3 or parts[0] != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        path, _, query_text = parts[1].partition("?")
        if path not in ("/metrics", "/dashboard/data"):
            return "404 Not Found", "text/plain", b"not found\n"
        authorization = None
        for line in header_lines:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                authorization = value.strip()
        keyed = self._keys and not (path == "/metrics" and self._metrics_open)
        if keyed and not self._keys.allows(authorization):
            return "401 Unauthorized", "text/plain", b"an API key is needed\n"
        passed_on = authorization.decode("latin-1") if authorization else None
        query = parse_qs(query_text)
        if path == "/metrics":
            page = await self.render_metrics(query.get("name[]"), passed_on)
            return "200 OK", PROMETHEUS_TEXT, page
        after: float | None = None
        if raw := query.get("stalls_after"):
            try:
                after = float(raw[0])
            except ValueError:
                return "400 Bad Request", "text/plain", b"stalls_after must be a number\n"
        return "200 OK", "application/json", orjson.dumps(await self.dashboard(after, passed_on))


def _memory(pids: dict[str, int]) -> list[dict[str, Any]]:
    """Each process's memory (rows of role, pid, rss/pss/uss MB); blocking."""
    rows = []
    for role, pid in pids.items():
        try:
            rows.append({"role": role, **read_memory(pid).to_mb()})
        except (OSError, ValueError):
            continue
    return rows


# ---- merging the processes' dashboards (pure) -------------------------------------------


def merge_dashboards(
    members: Sequence[Member],
    parts: Sequence[dict[str, Any] | None],
    history: LoadHistory,
    now: float,
    memory: list[dict[str, Any]],
) -> dict[str, Any]:
    """One snapshot in the shape of a process's (``frontend.http.dashboard.snapshot``)
    for the group, from each member's (``None``: it did not answer), plus
    ``processes`` (one row per member) and ``memory`` (every process of the group).

    Counts add up (in flight, queued, threads, requests by status); the loop's delay
    per time bucket and the latency percentiles are the worst process's (percentiles
    of different processes do not add up; each process's own are on its private
    page), and ``loop.processes`` keeps every process's delay series; stall records,
    recent errors and workers are every process's, each marked with its ``process``. Samples
    *history* with the group's load. Raises ValueError for lists of different lengths.
    """
    if len(members) != len(parts):
        raise ValueError(f"{len(members)} members, {len(parts)} snapshots")
    answered = [(m, p) for m, p in zip(members, parts, strict=True) if p is not None]
    snaps = [p for _, p in answered]
    first = snaps[0] if snaps else None
    loop_series = {m.slot: p["loop"]["delays"] for m, p in answered}
    worst: dict[float, float] = {}
    for series in loop_series.values():
        for t, delay in series:
            worst[t] = max(worst.get(t, 0.0), delay)
    stall_records = [{**r, "process": m.slot} for m, p in answered for r in p["stalls"]["records"]]
    stall_records.sort(key=lambda r: r.get("started_at", 0.0), reverse=True)
    errors = [{**e, "process": m.slot} for m, p in answered for e in p.get("errors", ())]
    errors.sort(key=lambda e: e.get("at", 0.0), reverse=True)
    stats = [p["stalls"]["statistics"] for p in snaps if p["stalls"]["statistics"] is not None]
    pool_keys = ("threads", "busy", "waiting", "encoded_total", "inline_total")
    pool: dict[str, Any] = {k: sum(p["pool"].get(k, 0) for p in snaps) for k in pool_keys}
    # fastokens' segment cache, one per process: its counters and sizes add up.
    caches = [c for p in snaps if isinstance(c := p["pool"].get("segment_cache"), dict)]
    pool["segment_cache"] = (
        {k: sum(c.get(k, 0) for c in caches) for k in caches[0]} if caches else None
    )
    by_status = _summed([p["requests"]["by_status"] for p in snaps])
    by_code = _summed([p["requests"].get("by_code", {}) for p in snaps])
    inflight = sum(p["requests"]["inflight"] for p in snaps)
    history.add(
        (now, inflight, pool["waiting"], pool["busy"], pool["threads"], sum(by_status.values()))
    )
    memory_by_pid = {row["pid"]: row for row in memory}
    processes = []
    for m, part in zip(members, parts, strict=True):
        row: dict[str, Any] = {
            "process": m.slot,
            "pid": m.pid,
            "url": m.url,
            "up": part is not None,
            "restarts": m.restarts,
            "memory": memory_by_pid.get(m.pid),
        }
        if part is not None:
            stat = part["stalls"]["statistics"]
            row.update(
                inflight=part["requests"]["inflight"],
                finished=sum(part["requests"]["by_status"].values()),
                loop_max_s=max((d for _, d in part["loop"]["delays"]), default=0.0),
                stalls=stat["stalls_total"] if stat else None,
            )
        processes.append(row)
    return {
        "now": now,
        "model": first["model"] if first else None,
        "group": {"processes": len(members), "up": len(snaps)},
        "loop": {
            "threshold_s": first["loop"]["threshold_s"] if first else 0.02,
            "window_s": first["loop"]["window_s"] if first else 60.0,
            "bucket_s": first["loop"]["bucket_s"] if first else 0.25,
            "delays": sorted(worst.items()),
            "max_delay_s": max((p["loop"]["max_delay_s"] for p in snaps), default=0.0),
            "instrumented": all(p["loop"]["instrumented"] for p in snaps),
            "processes": [{"process": slot, "delays": d} for slot, d in loop_series.items()],
        },
        "stalls": {
            "records": stall_records[:MAX_STALLS],
            "statistics": None
            if not stats
            else {
                "stalls_total": sum(s["stalls_total"] for s in stats),
                "loop_stalls_total": sum(s["loop_stalls_total"] for s in stats),
                "gil_stalls_total": sum(s["gil_stalls_total"] for s in stats),
                "contention_stalls_total": sum(s.get("contention_stalls_total", 0) for s in stats),
                "last_duration_s": (stall_records[0]["duration_s"] if stall_records else None),
                "max_duration_s": max(s["max_duration_s"] for s in stats),
                "tracking": all(s["tracking"] for s in stats),
            },
        },
        "pool": {"mode": first["pool"]["mode"] if first else "thread", **pool},
        "requests": {
            "inflight": inflight,
            "queued": pool["waiting"],
            "by_status": by_status,
            "by_code": by_code,
            "disconnected_clients": sum(p["requests"]["disconnected_clients"] for p in snaps),
        },
        "history": {
            "fields": HISTORY_FIELDS,
            "points": [[round(pt[0], 3), *pt[1:]] for pt in history.recent(now)],
        },
        "latency": {
            name: _worst_window([p["latency"][name] for p in snaps]) for name in ("ttft", "itl")
        },
        "workers": [{**w, "process": m.slot} for m, p in answered for w in p["workers"]],
        "processes": processes,
        "memory": memory,
        "errors": errors[:RECENT_ERRORS],
        "routing": _routing([p.get("routing") for p in snaps]),
    }


def _routing(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The processes' routing counters added up (one policy: the group's options)."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    counts = _summed([{k: v for k, v in p.items() if k != "policy"} for p in known])
    return {"policy": known[0]["policy"], **counts}


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """Per-key totals of several processes' counts."""
    total: dict[str, int] = {}
    for part in counts:
        for key, n in part.items():
            total[key] = total.get(key, 0) + n
    return total


def _worst_window(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentile windows of several processes: counts add up, each percentile is the
    highest of any process (an upper bound of the group's)."""

    def highest(key: str) -> float | None:
        values = [s[key] for s in stats if s.get(key) is not None]
        return max(values) if values else None

    return {
        "window_s": stats[0]["window_s"] if stats else 60.0,
        "count": sum(s["count"] for s in stats),
        "p50": highest("p50"),
        "p90": highest("p90"),
        "p99": highest("p99"),
        "max": highest("max"),
    }
