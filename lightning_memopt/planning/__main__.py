"""``python -m lightning_memopt.planning plan ...``: the console script without installing it."""

import sys

from lightning_memopt.planning.cli import main

sys.exit(main())
