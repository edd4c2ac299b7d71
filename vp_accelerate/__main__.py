"""`python -m vp_accelerate <command>` — what `accelerate launch -m vp_accelerate train ...` runs."""

import sys

from vp_accelerate.cli import main

sys.exit(main())
