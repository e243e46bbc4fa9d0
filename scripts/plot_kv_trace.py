"""Chart the trace benchmark's runs (scripts/bench_kv_trace.sh's JSON lines) as one PNG:
the cached share of prompt tokens and TTFT p50 / p90, a bar per setup, the medians of its
rounds (docs/routing.md, "The trace benchmark").

    python -m scripts.plot_kv_trace OUT.png RUNS.jsonl [RUNS.jsonl ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend


def medians(paths: list[Path]) -> dict[str, dict[str, float]]:
    """Each setup's (label's) median of each figure over its rounds, in first-seen order."""
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                run = json.loads(line)
                runs[run["label"]].append(run)
    figures = ("cached_share", "ttft_p50", "ttft_p90")
    return {
        label: {f: statistics.median(r[f] for r in rounds) for f in figures}
        for label, rounds in runs.items()
    }


def plot(out: Path, paths: list[Path]) -> Path:
    setups = medians(paths)
    labels = list(setups)
    fig, (share, ttft) = plt.subplots(1, 2, figsize=(12, 0.45 * len(labels) + 1.8))
    ys = range(len(labels))
    share.barh(ys, [100 * setups[k]["cached_share"] for k in labels], color="#55a868")
    share.set_yticks(list(ys), labels)
    share.invert_yaxis()
    share.set_xlabel("prompt tokens found cached (%)")
    width = 0.4
    ttft.barh(
        [y - width / 2 for y in ys],
        [1000 * setups[k]["ttft_p50"] for k in labels],
        height=width,
        label="p50",
        color="#4c72b0",
    )
    ttft.barh(
        [y + width / 2 for y in ys],
        [1000 * setups[k]["ttft_p90"] for k in labels],
        height=width,
        label="p90",
        color="#dd8452",
    )
    ttft.set_yticks(list(ys), [""] * len(labels))
    ttft.invert_yaxis()
    ttft.set_xlabel("time to first token (ms)")
    ttft.legend(loc="lower right")
    fig.suptitle("Mooncake's conversation trace, 4 simulated workers (medians of rounds)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(plot(Path(argv[0]), [Path(p) for p in argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
