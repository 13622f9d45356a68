"""`python -m router.sim`: the same as `kvgate sim`."""

import sys

from router.sim.cli import main

sys.exit(main())
