"""``python -m workers``: the same as ``headwater worker`` (see :mod:`workers.cli`)."""

from __future__ import annotations

import argparse
import sys

from headwater.cli import apply_env_defaults
from workers import cli


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers",
        description=(cli.__doc__ or "").strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cli.add_arguments(parser)
    apply_env_defaults(parser)
    return cli.main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
