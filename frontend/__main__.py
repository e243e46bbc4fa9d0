"""``python -m frontend`` is ``headwater serve``."""

import sys

from headwater.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
