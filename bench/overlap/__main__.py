"""``python -m bench.overlap``: see :mod:`bench.overlap.cli`."""

import sys

from bench.overlap.cli import main

sys.exit(main())
