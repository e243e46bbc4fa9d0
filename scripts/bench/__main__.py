"""``python -m scripts.bench``: the same as ``python -m scripts.bench.loadgen``."""

from __future__ import annotations

import sys

from scripts.bench.cli import cli

sys.exit(cli())
