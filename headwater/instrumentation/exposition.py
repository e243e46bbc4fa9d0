"""The Prometheus text format of a registry, rendered at a fraction of the library's cost.

Why: ``/metrics`` renders on the event loop, and ``prometheus_client.generate_latest``
redoes name validation (by regex), label escaping and sorting for every line on every
scrape: ~2.1 ms for the frontend's ~250 lines, which every task on the loop waits
through, ~1.3 ms of it formatting (``scripts/measure/exposition.py``). A dashboard or the
benchmark's 4 Hz sampler scrapes often. Everything in a line but its value is fixed per
series, so :class:`TextExposition` builds that part once, with the library's own
escaping, and per scrape only formats values (~0.5 ms).

The output is byte for byte ``generate_latest``'s (``tests/test_observability.py``
compares them), so scrapers and the text parsers see no difference.

A scrape may ask for some series only, by sample name, as prometheus-client's own
handler allows (``/metrics?name[]=x_bucket&name[]=x_count``): then only the collectors
of those names run (``CollectorRegistry.restricted_registry``): the loop series alone in
0.15 ms instead of the whole page's 1.2 ms. The benchmark samples the loop that way, at
4 Hz, on one kept-alive connection (docs/performance.md, "The observer").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# generate_latest's defaults: legacy names, non-legacy characters escaped to underscores.
_ESCAPING = openmetrics.UNDERSCORES
# OpenMetrics-only samples that the Prometheus text format moves into gauges of their own
# at the end of their family (in this order, as generate_latest sorts them).
_OM_SUFFIXES = ("_created", "_gcount", "_gsum")
# Metric types as the Prometheus text format names them (others keep their name).
_TEXT_TYPE = {
    "info": "gauge",
    "stateset": "gauge",
    "gaugehistogram": "histogram",
    "unknown": "untyped",
}
_TEXT_NAME_SUFFIX = {"counter": "_total", "info": "_info"}
_INF = float("inf")


class _Collects(Protocol):
    """A registry, or a restricted view of one."""

    def collect(self) -> Iterable[Metric]: ...


class TextExposition:
    """Renders *registries* (concatenated, in order) as ``generate_latest`` would.

    The fixed text of each family's header and of each series' line (name and labels)
    is cached; a scrape formats the values. Series that stop being reported leave the
    cache when it grows past twice the series of the latest scrape (worker ids come
    and go). Not thread-safe: render from one thread (the event loop).
    """

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries
        self._headers: dict[tuple[str, str, str], str] = {}
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def render(self, names: Collection[str] | None = None) -> bytes:
        """Every series, or with *names* only the samples of those names (``name[]``)."""
        out: list[str] = []
        lines = 0
        for registry in self._registries:
            source = registry if names is None else registry.restricted_registry(names)
            lines += self._render_registry(source, out)
        if names is None and len(self._series) > 2 * lines:
            self._series.clear()  # rebuilt on the next scrape from the live series
        return "".join(out).encode("utf-8")

    def _render_registry(self, registry: _Collects, out: list[str]) -> int:
        lines = 0
        line = self._line
        for metric in registry.collect():
            mtype = metric.type
            out.append(
                self._header(
                    metric.name + _TEXT_NAME_SUFFIX.get(mtype, ""),
                    _TEXT_TYPE.get(mtype, mtype),
                    metric.documentation,
                )
            )
            held: dict[str, list[str]] = {}
            om_names = {metric.name + suffix: suffix for suffix in _OM_SUFFIXES}
            for s in metric.samples:
                suffix = om_names.get(s.name)
                if suffix is None:
                    out.append(line(s))
                else:
                    held.setdefault(suffix, []).append(line(s))
                lines += 1
            for suffix in _OM_SUFFIXES:
                if suffix in held:
                    out.append(self._header(metric.name + suffix, "gauge", metric.documentation))
                    out.extend(held[suffix])
        return lines

    def _header(self, name: str, mtype: str, documentation: str) -> str:
        key = (name, mtype, documentation)
        text = self._headers.get(key)
        if text is None:
            escaped = openmetrics.escape_metric_name(name, _ESCAPING)
            doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
            text = self._headers[key] = f"# HELP {escaped} {doc}\n# TYPE {escaped} {mtype}\n"
        return text

    def _line(self, sample: Sample) -> str:
        key = (sample.name, tuple(sample.labels.items()))
        prefix = self._series.get(key)
        if prefix is None:
            prefix = self._series[key] = _series_prefix(sample.name, sample.labels.items())
        v = float(sample.value)
        # floatToGoString is repr() below 1e6 (Go switches to exponents above 6 integer
        # digits) and for negative numbers; NaN and infinities fail the test.
        value = repr(v) if -_INF < v < 1e6 else str(floatToGoString(v))  # type: ignore[no-untyped-call]
        if sample.timestamp is None:
            return f"{prefix}{value}\n"
        return f"{prefix}{value} {int(float(sample.timestamp) * 1000):d}\n"


def _series_prefix(name: str, labels: Iterable[tuple[str, str]]) -> str:
    """``name{k="v",...} `` with generate_latest's escaping and label order."""

    def pair(key: str, value: str) -> str:
        # Label values are always UTF-8: generate_latest escapes only \\, \n and ".
        escaped_value = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        return f'{openmetrics.escape_label_name(key, _ESCAPING)}="{escaped_value}"'

    labelstr = ",".join(pair(k, v) for k, v in sorted(labels))
    escaped = openmetrics.escape_metric_name(name, _ESCAPING)
    return f"{escaped}{{{labelstr}}} " if labelstr else f"{escaped} "
