"""The group's ``/metrics``: every frontend process's page, merged into one (no I/O).

With ``headwater serve --processes N`` the shared port's ``/metrics`` answers for the
whole group: the process that takes the request asks the supervisor, which scrapes
every process on its private port and merges the pages here.

**Why the supervisor scrapes and merges, and not prometheus-client's multiprocess mode**
(``PROMETHEUS_MULTIPROC_DIR``, a file of mmap'd values per process that any process
sums when scraped):

* the frontend's gauges that mirror live objects (queue depths, tokenizer threads busy,
  worker states) are refreshed by a hook when *that* process is scraped; in
  multiprocess mode the other processes' files would hold whatever their last scrape
  left. Custom collectors (the in-process workers') are not aggregated at all, and
  every gauge would need a mode chosen at creation;
* the merge would run in the process that took the request, on its event loop: reading
  and decoding N processes' files (N per restart: dead counters' files stay) in
  prometheus-client's pure Python. Here the serving loop only relays bytes; the
  parsing and merging run in the supervisor, which serves no traffic;
* the dashboard needs the processes' live state too (loop delays, stall records,
  workers), which no metrics file holds: it is gathered the same way
  (:mod:`headwater.cluster.group_view`), so one mechanism serves both;
* every observation would become a locked write into a shared file (the ITL histogram
  is observed per streamed token), and the per-process pages stay as they are.

What multiprocess mode does better, and what this does about it: its files survive a
crash, so no count is ever lost. Here a process's counts since the group was last
scraped are lost if it dies (a SIGKILL, the OOM killer) before the next scrape; with
Prometheus scraping every 15 s, at most 15 s of that one process's counts.

**Merging**, per family type:

* counters and histograms (buckets, ``_count``, ``_sum``) add up across processes;
* gauges add up (requests in flight, queued, tokenizer threads, ``max_inflight``: the
  group's), except :data:`MAX_GAUGES` (the worst loop's largest delay and longest GC
  pause, draining if any process is), over the processes that answered this scrape;
  ``worker_state``, summed, counts the processes that see a worker in each state;
* ``_created`` is the group's start for every series.

**Restarts keep the counters monotonic.** When a process is replaced (a new
incarnation in its slot), the last values scraped from the one that died are kept
(*retired*) and added to every later total, and the new one counts from 0 on top: a
group counter never goes down, so Prometheus sees no counter reset, and nothing is
counted twice. A process that does not answer a scrape (stalled, restarting) keeps
its last counter values in the total; its gauges are left out until it answers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

#: Gauges merged by their largest value (names after the prefix), the others add up.
MAX_GAUGES = frozenset({"event_loop_max_delay_seconds", "gc_max_pause_seconds", "draining"})
_CUMULATIVE = frozenset({"counter", "histogram", "summary"})

Labels = tuple[tuple[str, str], ...]
SampleKey = tuple[str, Labels]  # (sample name, labels in their order)


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family to render: its samples in order (sample name, labels, value)."""

    name: str
    type: str
    documentation: str
    samples: tuple[tuple[str, Labels, float], ...]


@dataclass(slots=True)
class _Slot:
    incarnation: int
    cumulative: dict[str, dict[SampleKey, float]] = field(default_factory=dict)
    gauges: dict[str, dict[SampleKey, float]] | None = None  # None: no answer this round


class GroupMetrics:
    """The merged view of the group's processes; see the module docstring.

    Feed it each process's page with :meth:`observe` (one call per process per scrape,
    ``None`` for one that did not answer), then :meth:`render`. *started_at* (unix
    seconds) is every series' ``_created``.
    """

    def __init__(self, *, started_at: float) -> None:
        self.started_at = started_at
        self._slots: dict[int, _Slot] = {}
        self._retired: dict[str, dict[SampleKey, float]] = {}
        self._meta: dict[str, tuple[str, str]] = {}  # name → (type, help), first seen first

    def observe(self, slot: int, incarnation: int, page: str | None) -> None:
        """What the process in *slot* (its *incarnation*: a new one means the last
        died) answered, or ``None``. Raises ValueError for a page that does not parse
        (nothing is recorded then)."""
        current = self._slots.get(slot)
        if current is not None and current.incarnation != incarnation:
            self._retire(current)
            current = None
        if current is None:
            current = self._slots[slot] = _Slot(incarnation)
        if page is None:
            current.gauges = None
            return
        families = _parse(page)
        gauges: dict[str, dict[SampleKey, float]] = {}
        for name, kind, doc, samples in families:
            self._meta.setdefault(name, (kind, doc))
            if kind in _CUMULATIVE:
                # Merged, not replaced: a page filtered by name[] holds some series only.
                current.cumulative.setdefault(name, {}).update(samples)
            else:
                gauges[name] = dict(samples)
        current.gauges = gauges

    def answered(self) -> int:
        """Processes that answered their latest scrape."""
        return sum(1 for s in self._slots.values() if s.gauges is not None)

    def families(self) -> list[Family]:
        """The merged families, in the order their names were first seen."""
        out = []
        for name, (kind, doc) in self._meta.items():
            samples = self._cumulative(name) if kind in _CUMULATIVE else self._gauge(name)
            if samples:
                out.append(Family(name, kind, doc, tuple(samples)))
        return out

    def render(self, extra: Iterable[Family] = (), names: Collection[str] | None = None) -> bytes:
        """The text exposition format of :meth:`families` and *extra*; *names* keeps
        only those sample names (``/metrics?name[]=...``)."""
        return render([*self.families(), *extra], names)

    # -- internals -----------------------------------------------------------------------

    def _retire(self, slot: _Slot) -> None:
        for name, samples in slot.cumulative.items():
            into = self._retired.setdefault(name, {})
            for key, value in samples.items():
                into[key] = into.get(key, 0.0) + value

    def _cumulative(self, name: str) -> list[tuple[str, Labels, float]]:
        totals: dict[SampleKey, float] = {}
        for source in (
            self._retired.get(name, {}),
            *(s.cumulative.get(name, {}) for s in self._slots.values()),
        ):
            for key, value in source.items():
                totals[key] = totals.get(key, 0.0) + value
        samples = [(k[0], k[1], v) for k, v in totals.items()]
        created: dict[Labels, None] = {}
        for _, labels, _ in samples:
            created[tuple(kv for kv in labels if kv[0] != "le")] = None
        samples += [(f"{name}_created", labels, self.started_at) for labels in created]
        return samples

    def _gauge(self, name: str) -> list[tuple[str, Labels, float]]:
        biggest = any(name.endswith(suffix) for suffix in MAX_GAUGES)
        merged: dict[SampleKey, float] = {}
        for slot in self._slots.values():
            for key, value in (slot.gauges or {}).get(name, {}).items():
                if key not in merged:
                    merged[key] = value
                elif biggest:
                    merged[key] = max(merged[key], value)
                else:
                    merged[key] += value
        return [(k[0], k[1], v) for k, v in merged.items()]


def _parse(page: str) -> list[tuple[str, str, str, list[tuple[SampleKey, float]]]]:
    try:
        # ``_created`` samples are dropped (the group has its own), also where the
        # parser makes a gauge family of them.
        return [
            (
                f.name,
                f.type,
                f.documentation,
                [
                    ((s.name, tuple(s.labels.items())), s.value)
                    for s in f.samples
                    if not s.name.endswith("_created")
                ],
            )
            for f in text_string_to_metric_families(page)
            if not f.name.endswith("_created")
        ]
    except Exception as exc:  # the parser raises ValueError, and others on odd input
        raise ValueError(f"cannot parse a metrics page: {exc}") from exc


def render(families: Iterable[Family], names: Collection[str] | None = None) -> bytes:
    """*families* in the Prometheus text format (version 0.0.4) as prometheus-client's
    ``generate_latest`` writes it (a counter's TYPE line names its ``_total`` sample, and
    ``_created`` samples follow as a gauge family of their own); *names* keeps only those
    sample names."""
    lines: list[str] = []
    for family in families:
        kept = [s for s in family.samples if names is None or s[0] in names]
        created = [s for s in kept if s[0].endswith("_created")]
        main = [s for s in kept if not s[0].endswith("_created")]
        typed = f"{family.name}_total" if family.type == "counter" else family.name
        _family_lines(lines, typed, family.type, family.documentation, main)
        _family_lines(lines, f"{family.name}_created", "gauge", family.documentation, created)
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _family_lines(
    lines: list[str], name: str, kind: str, doc: str, samples: list[tuple[str, Labels, float]]
) -> None:
    if samples:
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        for sample, labels, value in samples:
            if labels:
                text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
                lines.append(f"{sample}{{{text}}} {_value(value)}")
            else:
                lines.append(f"{sample} {_value(value)}")


def _value(value: float) -> str:
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
