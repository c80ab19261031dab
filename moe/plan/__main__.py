"""``python -m moe.plan``: see :mod:`moe.plan.cli`."""

import sys

from moe.plan.cli import main

sys.exit(main())
