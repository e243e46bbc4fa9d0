"""``python -m headwater ...`` is the ``headwater`` command (how supervisors start children)."""

import sys

from headwater.cli import main

sys.exit(main())
