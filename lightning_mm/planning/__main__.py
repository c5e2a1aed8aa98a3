"""``python -m lightning_mm.planning``: the same as ``lightning-mm plan``."""

import sys

from lightning_mm.planning.cli import main

sys.exit(main())
