"""``python -m scripts.soak``: see :mod:`scripts.soak`."""

import sys

from scripts.soak.cli import main

sys.exit(main())
